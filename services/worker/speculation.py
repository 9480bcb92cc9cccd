"""Speculative decoding in the worker (issue 28): verifying a step's drafts.

A request scheduled with drafts (``ScheduledRequest.num_drafts``: their tokens proposed by
the scheduler, services/scheduler/speculation.py, or filled by the worker's draft model,
draft_model.py) computes its last known token and the drafts in one query, so the step has
logits at each of those positions. The step's result returns the drafts each request kept
(``StepResult.accepted_draft_ids``), whichever side proposed them.

Greedy verification keeps draft i while it equals the argmax at the position before it; the
argmax of the row after the last kept draft follows them. That is the token plain decoding
would have sampled there (the same argmax of the same adjusted row), so the request's tokens
are the ones it gets without speculation, 1 to K + 1 a step. One argmax over a chunk's K + 1
rows gives both, so a step whose sampled chunks all verify greedily reads back once and
draws nothing more.

A request that samples (temperature > 0) verifies by rejection sampling, which keeps the
target's distribution exactly: the drafter proposes one token with certainty, so draft i is
kept with the target's probability of it, p_i(draft) (after temperature, top-k and top-p),
and at the first rejection the token is drawn from p_i with the draft removed, renormalized;
when every draft is kept, the sampler draws the next token from the row after them. Each
uniform and each residual draw is seeded by (seed, output index) like any seeded draw, so a
seeded request given the same drafts gives the same tokens.

Each verify row is first adjusted as the sampler adjusts a row it draws from (logit_bias,
min_tokens, min_p), at its own output index, so what is kept is what plain decoding gives.

Rejected drafts' positions count as not computed: their KV slots are written again.

``verify_drafts`` is the runner's acceptance rule (``ModelRunner.verify``, a ``VerifyRule``);
a benchmark may install another in process (benchmarks/speculation_plugins.py keeps a set
share of the drafts whatever the model computes).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch

from kernels.sampling import draw_seed
from services.worker import ops
from services.worker.sampler import filtered_probs
from services.worker.staging import HostStaging
from services.worker.step_inputs import LogitsLayout, SequenceChunk, select_rows
from shared.messages import SamplingParams

_RESIDUAL_SALT = 0x5EED  # the residual draw's seed differs from the same position's uniform
# (rows [n, vocab_size], per row its sampled-chunk index, per row its output index) -> the rows
# as the sampler would draw from them
Adjust = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


class Verified(NamedTuple):
    rows: list[int]  # per sampled chunk: the logits row its next token comes from
    num_accepted: list[int]  # per sampled chunk: drafts kept ([] when the step has none)
    # sampled-chunk index -> its token, known from verification: a greedy chunk's argmax
    # after its kept drafts, a sampling chunk's draw from a rejected draft's residual
    known_tokens: dict[int, int]


class VerifyRule(Protocol):
    """Which drafts a step keeps (``verify_drafts``'s signature and meaning)."""

    def __call__(self, logits: torch.Tensor, layout: LogitsLayout, chunks: list[SequenceChunk],
                 params: list[SamplingParams], output_indices: list[int],
                 adjust: Adjust | None = None, staging: HostStaging | None = None
                 ) -> Verified: ...


def verify_drafts(logits: torch.Tensor, layout: LogitsLayout, chunks: list[SequenceChunk],
                  params: list[SamplingParams], output_indices: list[int],
                  adjust: Adjust | None = None, staging: HostStaging | None = None) -> Verified:
    """logits: [num_logit_rows, vocab_size]; params, output_indices: per sampled chunk (its
    request's sampling and tokens generated so far). ``adjust``: what the sampler does to a
    row before drawing from it (logit_bias, min_tokens, min_p; ``Sampler.adjusted``), given
    (rows, per row its sampled-chunk index, per row its output index); the verify rows go
    through it on a copy, so a draft is kept only where the adjusted row would give it.
    Greedy chunks: one argmax over their verify rows and the row after their last draft, one
    read back, which also gives the token after the kept drafts (the draw would compute the
    same argmax of the same adjusted row); sampling ones: ``reject_drafts``, with the
    request's seed or a fresh one (a tensor-parallel group's leader seeds every random
    request, so its ranks agree). ``staging``: the rows' indices go to the device through
    it (``select_rows``)."""
    sampled = [chunk for chunk in chunks if chunk.sample]
    rows = list(layout.sample_rows)
    if not any(chunk.num_drafts for chunk in sampled):
        return Verified(rows, [], {})
    verify = [(index, row, chunk) for index, (row, chunk) in enumerate(zip(rows, sampled))
              if chunk.num_drafts]
    accepted, known_tokens = [0] * len(rows), {}
    # [num verify rows, vocab_size]: draft i of a chunk is verified at its row + i; a greedy
    # chunk's row + num_drafts gives the token after all of them
    counts = [chunk.num_drafts + params[index].is_greedy for index, _, chunk in verify]
    owners = [index for (index, _, _), count in zip(verify, counts) for _ in range(count)]
    offsets = [offset for count in counts for offset in range(count)]
    verify_logits = select_rows(
        logits, [row + offset for (_, row, _), count in zip(verify, counts)
                 for offset in range(count)], staging)
    if adjust is not None:
        verify_logits = adjust(verify_logits, owners, [output_indices[index] + offset
                                                        for index, offset in zip(owners, offsets)])
    greedy_rows = [n for n, index in enumerate(owners) if params[index].is_greedy]
    argmax = iter([])
    if greedy_rows:
        greedy_logits = verify_logits if len(greedy_rows) == len(owners) \
            else select_rows(verify_logits, greedy_rows, staging)
        argmax = iter(ops.greedy_token_ids(greedy_logits).tolist())
    first = 0
    for (index, _, chunk), count in zip(verify, counts):
        drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:]
        own_rows, first = verify_logits[first:first + len(drafts)], first + count
        if params[index].is_greedy:
            tokens = [next(argmax) for _ in range(count)]  # [num_drafts + 1]
            matches = [token == draft for token, draft in zip(tokens, drafts)]
            accepted[index] = matches.index(False) if False in matches else len(drafts)
            known_tokens[index] = tokens[accepted[index]]
            continue
        probs = filtered_probs(own_rows.float(),
                               [params[index]] * len(drafts))  # [num_drafts, vocab_size]
        seed = params[index].seed
        accepted[index], token = reject_drafts(
            probs, drafts, seed if seed is not None else random.getrandbits(62),
            output_indices[index])
        if token is not None:
            known_tokens[index] = token
    return Verified([row + num for row, num in zip(rows, accepted)], accepted, known_tokens)


def reject_drafts(probs: torch.Tensor, drafts: list[int], seed: int, output_index: int
                  ) -> tuple[int, int | None]:
    """probs: [num_drafts, vocab_size], the target's distribution at each draft's position ->
    (drafts kept, the token drawn at the first rejection, or None when all were kept)."""
    draft_probs = probs[torch.arange(len(drafts), device=probs.device),
                        torch.tensor(drafts, device=probs.device)].tolist()
    for i, (draft, p_draft) in enumerate(zip(drafts, draft_probs)):
        generator = torch.Generator().manual_seed(draw_seed(seed, output_index + i))
        if torch.rand((), generator=generator).item() < p_draft:
            continue
        residual = probs[i].cpu().clone()  # [vocab_size]: p_i with the draft removed
        residual[draft] = 0.0
        generator.manual_seed(draw_seed(seed ^ _RESIDUAL_SALT, output_index + i))
        return i, int(torch.multinomial(residual, 1, generator=generator))
    return len(drafts), None


def keep_accepted(states: list, chunks: list[SequenceChunk], num_accepted: list[int]
                  ) -> list[list[int]]:
    """The sampled requests' states (``states``, in the order of the sampled ``chunks``)
    after their step: kept drafts join their tokens (the sampled token follows them); the
    rejected ones' positions count as not computed. -> per sampled chunk, the drafts it kept
    ([] when the step verified none: ``num_accepted`` empty)."""
    kept_drafts = []
    for state, chunk, num in zip(states, [c for c in chunks if c.sample], num_accepted):
        drafts = chunk.token_ids[len(chunk.token_ids) - chunk.num_drafts:][:num]
        state.token_ids.extend(drafts)
        state.num_computed_tokens -= chunk.num_drafts - num
        kept_drafts.append(drafts)
    return kept_drafts
