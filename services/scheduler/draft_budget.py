"""How many drafts a request may get in the next step, from what drafts have earned so far
(speculative decoding's load-adaptive draft length, issue 28).

Drafts pay while a step's time hardly grows with its rows (a memory-bound GPU at small
batches) and enough of them are kept; they cost throughput when the device is already busy
(a large batch, a CPU) or few are kept. Rather than model either, the policy measures it: for
each batch size (in powers of two) and each draft cap 0..K it keeps a moving average of the
output tokens a second that decode steps planned with that cap delivered, and plans the next
step with the cap that delivered most. It tries an untried cap first (K, then none, so a
fresh server drafts as before) and, every EXPLORE_EVERY steps of a batch size, a cap next to
the best one, so a change of workload (acceptance, prompt mix) moves the choice.

A step's time is its period as the scheduler sees it: from the later of its plan and the
result before it to its own result. With overlapped steps that is the time the device spent
on it; otherwise it also holds the round trip and the host work a step that verifies waits
for, which is what such a step costs. Steps with prompt chunks say nothing about drafts and
are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

EMA_WEIGHT = 0.2  # of the newest step in a cap's average
EXPLORE_EVERY = 16  # steps of a batch size between tries of a cap beside the best one


def batch_bucket(num_running: int) -> int:
    """The power of two at or above ``num_running`` (1, 2, 4, ...)."""
    return 1 << max(0, num_running - 1).bit_length()


class DraftBudget:
    """The draft cap for each step (0..``max_drafts``), learnt from the steps' throughput."""

    def __init__(self, max_drafts: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_drafts = max_drafts
        self.clock = clock
        self._rates: dict[tuple[int, int], float] = {}  # (bucket, cap) -> tokens/s average
        self._num_decisions: dict[int, int] = {}  # bucket -> caps chosen
        self._planned: dict[int, tuple[int, int, float]] = {}  # step -> (bucket, cap, time)
        self._choice = (1, max_drafts)  # (bucket, cap) of the step being planned
        self._last_result_time = float("-inf")

    def cap(self, num_running: int) -> int:
        """The most drafts a request may get in the step being planned."""
        bucket = batch_bucket(num_running)
        cap = self._choose(bucket)
        self._choice = (bucket, cap)
        return cap

    def _choose(self, bucket: int) -> int:
        count = self._num_decisions[bucket] = self._num_decisions.get(bucket, 0) + 1
        for untried in (self.max_drafts, 0):
            if (bucket, untried) not in self._rates:
                return untried
        best = max(range(self.max_drafts + 1),
                   key=lambda cap: self._rates.get((bucket, cap), float("-inf")))
        if count % EXPLORE_EVERY == 0:  # alternately the cap below and above the best
            beside = best - 1 if (count // EXPLORE_EVERY) % 2 else best + 1
            if 0 <= beside <= self.max_drafts:
                return beside
        return best

    def planned(self, step_id: int, decodes_only: bool) -> None:
        """The step just planned (with the last ``cap``) is counted once its result is in,
        if it had no prompt chunks."""
        if decodes_only:
            bucket, cap = self._choice
            self._planned[step_id] = (bucket, cap, self.clock())

    def step_done(self, step_id: int, num_tokens: int) -> None:
        """A step's result is in: it delivered ``num_tokens`` output tokens."""
        now = self.clock()
        planned = self._planned.pop(step_id, None)
        for dropped in [s for s in self._planned if s < step_id]:  # (steps of a failed worker)
            del self._planned[dropped]
        started = self._last_result_time
        self._last_result_time = now
        if planned is None or num_tokens <= 0:
            return
        bucket, cap, plan_time = planned
        period = now - max(started, plan_time)
        if period <= 0:
            return
        rate = num_tokens / period
        old = self._rates.get((bucket, cap))
        self._rates[(bucket, cap)] = rate if old is None else (
            (1 - EMA_WEIGHT) * old + EMA_WEIGHT * rate)

    def rates(self, num_running: int) -> dict[int, float]:
        """The measured tokens/s by cap at this batch size (for logs and tests)."""
        bucket = batch_bucket(num_running)
        return {cap: rate for (b, cap), rate in self._rates.items() if b == bucket}
