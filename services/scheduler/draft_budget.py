"""How many drafts a request may get in the next step, from what drafts have earned so far
(speculative decoding's load-adaptive draft length, issue 28).

Drafts pay while a step's time hardly grows with its rows (a memory-bound GPU at small
batches) and enough of them are kept; they cost throughput when the device is already busy
(a large batch, a CPU) or few are kept. The policy measures both and plans each step with
the cap k (0..K) that gives the most output tokens a second:

    tokens(k) = n * (1 + sum_{i<k} offered_i * kept_i)
    rows(k)   = n * (1 + sum_{i<k} offered_i)
    choose k maximising tokens(k) / step_time(rows(k))

for n running requests, where offered_i is the share of drafted-for decodes that got an
(i+1)-th draft (a proposer often has fewer than k) and kept_i the share of those kept, both
decayed averages over recent steps that fade towards a prior (all offered, half kept) while
nothing is drafted, so drafts are tried again now and then; step_time is a decayed average
of the measured periods of steps by their rows (powers of two), fed by every step, prompt
chunks included. A size not measured yet is taken to cost what the nearest smaller one did,
or the nearest larger one scaled down with the rows: hopeful guesses, so it is tried once and
then known.

A step's time is its period as the scheduler sees it: from the later of its plan and the
result before it to its own result. With overlapped steps that is the time the device spent
on it; otherwise it also holds the round trip and the host work a step that verifies waits
for, which is what such a step costs.

One-off costs are kept out. A step in which the draft model first caught its cache up over
a request's context (its first drafted step, or its first after a pause) is not timed:
otherwise that one dear step makes its size look too dear to draft again, and no later step
of that size comes to correct the average (a draft model's batch-1 steps stopped drafting
after their first, which caught up over a 1,024-token context). And a period counts as at
most twice its size's average, against a collection pause or a late result; such a pause can
still leave its size a little too dear for good (three drafts a step where four would pay a
little more), since a size is timed again only when it is drafted.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

COST_EMA_WEIGHT = 0.3  # of the newest period in a size's average
# a period counts as at most this many times its size's average; a rise that lasts is
# still learnt, by 1.3x a step
MAX_PERIOD_RISE = 2.0
DRAFT_DECAY = 0.95  # per drafted step, of the draft counts (about the last 20 steps)
# per step without drafts: the counts fade towards the prior, so drafts are tried again
# now and then (every few hundred steps where they did not pay) and a new workload is seen
IDLE_DECAY = 0.995
PRIOR_KEPT = 0.5  # the kept share assumed for a position never drafted
PRIOR_WEIGHT = 2.0  # in drafts: one unlucky step does not settle a position


def size_bucket(num_rows: int) -> int:
    """The power of two at or above ``num_rows`` (1, 2, 4, ...)."""
    return 1 << max(0, num_rows - 1).bit_length()


class DraftBudget:
    """The draft cap for each step (0..``max_drafts``), from measured step times and drafts."""

    def __init__(self, max_drafts: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.max_drafts = max_drafts
        self.clock = clock
        self._step_s: dict[int, float] = {}  # rows bucket -> period average
        self._eligible = [0.0] * max_drafts  # [i]: decodes planned with a cap above i
        self._offered = [0.0] * max_drafts  # [i]: of those, given an (i+1)-th draft
        self._kept = [0.0] * max_drafts  # [i]: of those, kept it
        self._planned: dict[int, tuple[int, float]] = {}  # step -> (cap, plan time)
        self._last_result_time = float("-inf")

    # ------------------------------------------------------------ the choice
    def cap(self, num_running: int) -> int:
        """The most drafts a request may get in the step being planned."""
        n = max(1, num_running)
        best, best_rate = 0, 0.0
        gain, rows = 1.0, 1.0  # per request: tokens out, rows computed
        for k in range(self.max_drafts + 1):
            if k:
                offered, kept = self.offered_and_kept(k - 1)
                gain, rows = gain + offered * kept, rows + offered
            step_s = self.step_time(round(n * rows))
            if step_s is None:  # nothing measured yet: draft as many as may be
                best = self.max_drafts
                break
            rate = n * gain / step_s
            if rate > best_rate * 1.0001:  # (ties: fewer drafts)
                best, best_rate = k, rate
        return best

    def offered_and_kept(self, position: int) -> tuple[float, float]:
        """The share of decodes drafted for that got a draft at ``position`` (0-based), and
        the share of those kept (prior: all offered, half kept)."""
        eligible, offered = self._eligible[position], self._offered[position]
        share_offered = (offered + PRIOR_WEIGHT) / (eligible + PRIOR_WEIGHT)
        share_kept = (self._kept[position] + PRIOR_KEPT * PRIOR_WEIGHT) / (offered + PRIOR_WEIGHT)
        return share_offered, share_kept

    def step_time(self, num_rows: int) -> float | None:
        """The average period of a step of ``num_rows`` rows: its size's; else, hopefully
        (so the size gets tried), the nearest smaller size's, or the nearest larger one's
        scaled down with the rows; None before any step."""
        bucket = size_bucket(num_rows)
        if bucket in self._step_s:
            return self._step_s[bucket]
        smaller = [b for b in self._step_s if b < bucket]
        if smaller:
            return self._step_s[max(smaller)]
        if not self._step_s:
            return None
        larger = min(self._step_s)
        return self._step_s[larger] * bucket / larger

    # ------------------------------------------------------------ the books
    def planned(self, step_id: int, cap: int) -> None:
        """The step just planned, with draft cap ``cap``."""
        self._planned[step_id] = (cap, self.clock())

    def planned_cap(self, step_id: int) -> int:
        """The cap a step in flight was planned with (0: none, or not planned here)."""
        planned = self._planned.get(step_id)
        return planned[0] if planned is not None else 0

    def step_done(self, step_id: int, num_rows: int, drafts: list[tuple[int, int]],
                  timed: bool = True) -> None:
        """A step's result is in: it computed ``num_rows`` rows; ``drafts`` holds (offered,
        kept) for each decode it planned; ``timed``: false when its period holds a one-off
        cost (a draft model's catch-up), which is then not taken as a step's."""
        now = self.clock()
        planned = self._planned.pop(step_id, None)
        for dropped in [s for s in self._planned if s < step_id]:  # (steps of a failed worker)
            del self._planned[dropped]
        started, self._last_result_time = self._last_result_time, now
        if planned is None:
            return
        cap, plan_time = planned
        period = now - max(started, plan_time)
        if timed and period > 0 and num_rows > 0:
            self._time(num_rows, period)
        self._count_drafts(cap, drafts)

    def _time(self, num_rows: int, period: float) -> None:
        """Fold a step's period into its size's average, as at most MAX_PERIOD_RISE times that
        average. A size's first period is taken whole: a size dearer than hoped (a CPU's steps
        grow with their rows) is known at once."""
        bucket = size_bucket(num_rows)
        old = self._step_s.get(bucket)
        self._step_s[bucket] = period if old is None else (
            (1 - COST_EMA_WEIGHT) * old + COST_EMA_WEIGHT * min(period, MAX_PERIOD_RISE * old))

    def _count_drafts(self, cap: int, drafts: list[tuple[int, int]]) -> None:
        decay = DRAFT_DECAY if cap and drafts else IDLE_DECAY
        for counts in (self._eligible, self._offered, self._kept):
            counts[:] = [count * decay for count in counts]
        offered, kept = Counter(o for o, _ in drafts), Counter(k for _, k in drafts)
        for position in range(cap):  # a decode counts at every position below its drafts
            self._eligible[position] += len(drafts)
            self._offered[position] += sum(n for num, n in offered.items() if num > position)
            self._kept[position] += sum(n for num, n in kept.items() if num > position)
