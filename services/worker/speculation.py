"""Speculative decoding in the worker (issue 28): verifying a step's drafts.

A request scheduled with drafts (``ScheduledRequest.draft_token_ids``, proposed by the
scheduler: services/scheduler/speculation.py) computes its last known token and the
drafts in one query, so the step has logits at each of those positions. Greedy
verification keeps draft i while it equals the argmax at the position before it; the
token sampled from the row after the last kept draft follows them. That is the token
plain decoding would have sampled there (the sampler draws it, from the same row), so
the request's tokens are the ones it gets without speculation, 1 to K + 1 a step.
Rejected drafts' positions count as not computed: their KV slots are written again.
"""

from __future__ import annotations

import torch

from services.worker.step_inputs import LogitsLayout, SequenceChunk


def verify_drafts(logits: torch.Tensor, layout: LogitsLayout, chunks: list[SequenceChunk]
                  ) -> tuple[list[int], list[int]]:
    """logits: [num_logit_rows, vocab_size] -> (per sampled chunk: the row to sample from,
    the drafts it keeps; [] when the step has none). One argmax over the verify rows, one
    read back."""
    sampled = [chunk for chunk in chunks if chunk.sample]
    rows = list(layout.sample_rows)
    if not any(chunk.num_drafts for chunk in sampled):
        return rows, []
    verify = [(row, chunk) for row, chunk in zip(rows, sampled) if chunk.num_drafts]
    index = [row + i for row, chunk in verify for i in range(chunk.num_drafts)]
    argmax = iter(logits[index].argmax(-1).tolist())  # [num draft rows]
    kept = {}
    for row, chunk in verify:
        drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:]
        matches = [next(argmax) == draft for draft in drafts]
        kept[row] = matches.index(False) if False in matches else len(drafts)
    accepted = [kept.get(row, 0) for row in rows]
    return [row + num for row, num in zip(rows, accepted)], accepted


def keep_accepted(states: list, chunks: list[SequenceChunk], num_accepted: list[int]) -> None:
    """The sampled requests' states (``states``, in the order of the sampled ``chunks``)
    after their step: kept drafts join their tokens (the sampled token follows them); the
    rejected ones' positions count as not computed."""
    for state, chunk, num in zip(states, [c for c in chunks if c.sample], num_accepted):
        if chunk.num_drafts:
            drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:]
            state.token_ids.extend(drafts[:num])
            state.num_computed_tokens -= chunk.num_drafts - num
