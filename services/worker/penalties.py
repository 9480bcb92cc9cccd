"""Presence, frequency and repetition penalties, vectorized over the batch.

Each request with a penalty owns a row (a "slot") of two device tables kept across steps:
how often each token occurs in its output, and which tokens its prompt holds. A step sends
one small parameter tensor (slot and penalties per row), penalizes every row in one pass
(``kernels/penalties.py``: the Triton kernel on CUDA, its torch reference on CPU) and counts
the sampled tokens with one scatter, so the cost does not grow with the context length and
there is no per-request loop on the device.

Semantics (OpenAI for presence/frequency, the HF/vLLM convention for repetition):
``logit -= frequency_penalty * count + presence_penalty * (count > 0)`` over output tokens;
for every token seen in the prompt or the output, a positive logit is divided by
``repetition_penalty`` and a negative one multiplied by it.
"""

from __future__ import annotations

import torch

from kernels.penalties import apply_penalties, apply_penalties_ref
from services.worker.transfer import to_device
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
            self.prompt_mask[slot, to_device(torch.tensor(prompt_token_ids), self.device)] = True
        if output_token_ids:
            self.output_counts[slot].index_add_(
                0, to_device(torch.tensor(output_token_ids), self.device),
                torch.ones(len(output_token_ids), dtype=torch.int32, device=self.device))

    def remove(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def apply(self, logits: torch.Tensor, request_ids: list[str],
              params: list[SamplingParams]) -> None:
        """Penalize, in place, the rows of ``logits`` [num_rows, vocab_size] whose request has
        penalties; ``request_ids``/``params`` give each row's request."""
        # [4, num_rows]: slot (-1: none), repetition, frequency, presence
        rows = [[self._slots.get(r, -1) if p.has_penalties else -1 for r, p in
                 zip(request_ids, params)],
                [p.repetition_penalty for p in params], [p.frequency_penalty for p in params],
                [p.presence_penalty for p in params]]
        packed = to_device(torch.tensor(rows, dtype=torch.float32), logits.device)
        if logits.is_cuda:
            apply_penalties(logits, self.output_counts, self.prompt_mask, packed)
        else:
            apply_penalties_ref(logits, self.output_counts, self.prompt_mask, packed)

    def count(self, request_ids: list[str], token_ids: list[int]) -> None:
        """Add each sampled token to its request's output counts (requests without a slot skip)."""
        pairs = [(self._slots[r], t) for r, t in zip(request_ids, token_ids) if r in self._slots]
        if not pairs:
            return
        # one atomic add per (slot, token) into the flattened table (index_put_ with
        # accumulate sorts its indices first: ten times slower on CUDA)
        flat_index = to_device(torch.tensor([slot * self.vocab_size + token
                                             for slot, token in pairs]), self.device)
        self.output_counts.view(-1).index_add_(
            0, flat_index, torch.ones(len(pairs), dtype=torch.int32, device=self.device))

    def _grow(self) -> None:
        num_slots = self.output_counts.shape[0]
        self.output_counts = torch.cat([self.output_counts, torch.zeros_like(self.output_counts)])
        self.prompt_mask = torch.cat([self.prompt_mask, torch.zeros_like(self.prompt_mask)])
        self._free_slots.extend(range(2 * num_slots - 1, num_slots - 1, -1))
