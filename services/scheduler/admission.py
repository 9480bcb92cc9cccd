"""How many KV blocks admission keeps free for the running requests' next tokens. Pure.

A request admitted into the last free blocks is soon preempted as the running ones grow: it
is computed again later, from its prompt, and its stream stalls meanwhile. Measured with
vLLM's client on an H200 (1,000 streams of 1,024 + 256 tokens at once, dummy Llama-3.1-8B):
135 preemptions of ~1,150 tokens each, a sixth of the run's prefill done twice. So admission
keeps back room for what the running requests may still write: each one's share
``ratio × min(max_tokens − output, MAX_COUNTED_TOKENS)`` of tokens, one a step, after the
prompt tokens it has no blocks for yet. Room is needed at the peak of that, not for the sum:
a request that ends sooner frees its blocks for the longer ones (``peak_need``), so a mix of
short and long answers admits more at once than identical ones (for those, peak and sum are
one figure). Replayed (``python -m benchmarks.scheduler_replay --workload sharegpt
--dataset-path .devmodels/sharegpt-1000.json``, ShareGPT 1,000 at once): on the 70B TP2's
blocks (``--tokenizer .devmodels/dummy-llama-3.3-70b --num-blocks 23562 --step-model
0.0195,9e-5,5e-9``) the sum held the last 121 requests back (TTFT p99 23.0 s), the peak
admits all (8.3 s) and preempts none; on ``--num-blocks 8000`` of the 8B, 20.5 s to the last
token against the sum's 22.9, no preemption either way.

The share is learned, since clients often set max_tokens far above what they get: it is the
running mean of the share of their (counted) budget that finished requests used, and a
preemption (the reserve was too small) raises it. It starts at 1 (nothing known: reserve
all), so a burst of requests that run to max_tokens never preempts, and it falls within a
few finished requests where answers end early. Under the priority policy a request keeps
room only for running requests as important as it or more. At most MAX_COUNTED_TOKENS of a
request's budget count (longer outputs may still preempt, as without the reserve). Nothing
runs: the head is admitted whatever its own growth (it could otherwise wait forever).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import numpy as np

from services.scheduler.request import Request

# of one request's remaining budget: a request without max_tokens gets the context's room
# (8,192 on SmolLM2), and a cold server, reserving all of it, would run few at once until
# the first ones finish and teach the share
MAX_COUNTED_TOKENS = 1024
MIN_RATIO = 0.1
FINISHED_WEIGHT = 0.2  # of the newest finished request in the running mean
PREEMPTED_RAISE = 0.1


class Commitment(NamedTuple):
    """A running request's room: blocks held now (freed when it ends), prompt tokens it has
    no blocks for yet (needed at once) and tokens it may still write (one a step)."""

    held_tokens: int
    prompt_left: int
    growth: float


def peak_need(held: Sequence[float], prompt_left: Sequence[float],
              growth: Sequence[float]) -> float:
    """The most tokens beyond those held now that some commitments (as columns: one entry
    a request) need at one time, each writing a token a step and ending after its growth:
    checked at the start and just before each one ends (the need grows between those
    points and drops at each end)."""
    if not len(growth):
        return 0.0
    held, prompt_left, growth = (np.array(column, dtype=np.float64)
                                 for column in (held, prompt_left, growth))
    order = np.argsort(-growth, kind="stable")  # the longest first
    held, prompt_left, growth = held[order], prompt_left[order], growth[order]
    num_still_running = np.arange(1, len(growth) + 1)
    freed = held.sum() - np.cumsum(held)  # by those that end before each one
    just_before_each_end = np.cumsum(prompt_left) + num_still_running * growth - freed
    return float(max(prompt_left.sum(), just_before_each_end.max()))


class KeptRoom:
    """The running requests' commitments by priority (as columns: the admission loop asks
    for the peak once a candidate, over up to max_num_seqs of them), and admitted ones
    added as a step is planned."""

    def __init__(self) -> None:
        self._by_priority: dict[int, tuple[list, list, list]] = defaultdict(
            lambda: ([], [], []))

    def add(self, commitment: Commitment, priority: int) -> None:
        for column, value in zip(self._by_priority[priority], commitment):
            column.append(value)

    def need_with(self, own: Commitment, priority: int) -> float:
        """Room a request of ``priority`` committing ``own`` must leave free: the peak need
        of the running requests as important as it or more, and its own (the others would
        be preempted for it)."""
        columns = [[value] for value in own]
        for other, kept in self._by_priority.items():
            if other <= priority:
                for column, values in zip(columns, kept):
                    column.extend(values)
        return peak_need(*columns)


class AdmissionReserve:
    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.ratio = 1.0

    @staticmethod
    def budget_left(req: Request, max_model_len: int) -> int:
        """Tokens ``req`` may still write."""
        return max(0, min(req.sampling.max_tokens - len(req.output_token_ids),
                          max_model_len - req.num_tokens))

    def remaining_tokens(self, req: Request, max_model_len: int) -> int:
        """Tokens ``req`` may still write, as counted for the reserve."""
        return min(self.budget_left(req, max_model_len), MAX_COUNTED_TOKENS)

    def commitment(self, req: Request, num_held_blocks: int, num_prompt_left: int,
                   max_model_len: int) -> Commitment:
        """``req``'s room: the blocks it holds, its ``num_prompt_left`` prompt tokens not yet
        given blocks, and the learned share of what it may still write (none of it without
        the reserve)."""
        if not self.enabled:
            return Commitment(0, 0, 0.0)
        # past MAX_COUNTED_TOKENS its end is not counted on: its blocks free too late
        ends = self.budget_left(req, max_model_len) <= MAX_COUNTED_TOKENS
        return Commitment(num_held_blocks * self.block_size if ends else 0, num_prompt_left,
                          self.ratio * self.remaining_tokens(req, max_model_len))

    def kept_room(self, running: Iterable[Request], max_model_len: int,
                  num_sole_blocks: Callable[[list[int]], int]) -> KeptRoom:
        """The running requests' room (a prompt's blocks come chunk by chunk); each frees
        only the blocks no other sequence holds (``num_sole_blocks`` of its block table)."""
        kept = KeptRoom()
        if self.enabled:
            for req in running:
                kept.add(self.commitment(req, num_sole_blocks(req.block_table), max(
                    0, req.num_tokens - req.num_computed_tokens), max_model_len), req.sort_key[0])
        return kept

    def blocks_for(self, num_tokens: float) -> int:
        return math.ceil(num_tokens / self.block_size)

    def on_finished(self, req: Request) -> None:
        """``req`` ended (EOS, stop or length): how much of its budget it used."""
        counted = min(req.sampling.max_tokens, MAX_COUNTED_TOKENS)
        used = min(1.0, len(req.output_token_ids) / counted) if counted > 0 else 1.0
        self.ratio = max(MIN_RATIO, self.ratio + FINISHED_WEIGHT * (used - self.ratio))

    def on_preempted(self) -> None:
        self.ratio = min(1.0, self.ratio + PREEMPTED_RAISE)
