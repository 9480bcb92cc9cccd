"""Presence, frequency and repetition penalties, vectorized over the batch.

Each request with a penalty owns a row (a "slot") of two device tables kept across steps:
how often each token occurs in its output, and which tokens its prompt holds. A step gathers
the batch's rows, adjusts all their logits with a few tensor ops, and counts the sampled
tokens with one scatter, so the cost does not grow with the context length and there is no
per-request loop on the device.

Semantics (OpenAI for presence/frequency, the HF/vLLM convention for repetition):
``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over output tokens;
for every token seen in the prompt or the output, a positive logit is divided by
``repetition_penalty`` and a negative one multiplied by it.
"""

from __future__ import annotations

import torch

from shared.messages import SamplingParams


class PenaltyTables:
    def __init__(self, vocab_size: int, device: torch.device, initial_slots: int = 8) -> None:
        self.vocab_size = vocab_size
        self.device = device
        # [num_slots, vocab_size]: occurrences of each token in a slot's output
        self.output_counts = torch.zeros(initial_slots, vocab_size, dtype=torch.int32, device=device)
        # [num_slots, vocab_size]: which tokens a slot's prompt holds
        self.prompt_mask = torch.zeros(initial_slots, vocab_size, dtype=torch.bool, device=device)
        self._free_slots = list(range(initial_slots - 1, -1, -1))
        self._slots: dict[str, int] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    def slot(self, request_id: str) -> int:
        return self._slots[request_id]

    def add(self, request_id: str, prompt_token_ids: list[int], output_token_ids: list[int]) -> None:
        """Give a request a slot, filled from its tokens so far (a resumed request has outputs)."""
        self.remove(request_id)
        if not self._free_slots:
            self._grow()
        slot = self._free_slots.pop()
        self._slots[request_id] = slot
        self.output_counts[slot].zero_()
        self.prompt_mask[slot].zero_()
        if prompt_token_ids:
            self.prompt_mask[slot, torch.tensor(prompt_token_ids, device=self.device)] = True
        if output_token_ids:
            self.output_counts[slot].index_add_(
                0, torch.tensor(output_token_ids, device=self.device),
                torch.ones(len(output_token_ids), dtype=torch.int32, device=self.device))

    def remove(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def apply(self, logits: torch.Tensor, rows: list[int], request_ids: list[str],
              params: list[SamplingParams]) -> None:
        """Penalize ``logits[rows]`` in place; ``request_ids``/``params`` belong to those rows."""
        if not rows:
            return
        device = logits.device
        row_index = torch.tensor(rows, device=device)
        slots = torch.tensor([self._slots[r] for r in request_ids], device=device)
        counts = self.output_counts[slots]  # [num_rows, vocab_size]
        in_output = counts > 0
        seen = in_output | self.prompt_mask[slots]
        penalties = torch.tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                                  for p in params], dtype=torch.float32, device=device)
        repetition, frequency, presence = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
        selected = logits[row_index].float()  # [num_rows, vocab_size]
        selected = torch.where(seen & (selected > 0), selected / repetition,
                               torch.where(seen, selected * repetition, selected))
        selected -= frequency * counts + presence * in_output
        logits[row_index] = selected.to(logits.dtype)

    def count(self, request_ids: list[str], token_ids: list[int]) -> None:
        """Add each sampled token to its request's output counts (requests without a slot skip)."""
        pairs = [(self._slots[r], t) for r, t in zip(request_ids, token_ids) if r in self._slots]
        if not pairs:
            return
        index = torch.tensor(pairs, device=self.device)  # [num_counted, 2]: (slot, token)
        self.output_counts.index_put_((index[:, 0], index[:, 1]),
                                      torch.ones(len(pairs), dtype=torch.int32, device=self.device),
                                      accumulate=True)

    def _grow(self) -> None:
        num_slots = self.output_counts.shape[0]
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self._free_slots.extend(range(2 * num_slots - 1, num_slots - 1, -1))
