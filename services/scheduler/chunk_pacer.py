"""Pacing prompt chunks against running decodes: a latency policy.

A step that carries a prompt chunk as well as decodes makes every decoding stream wait for
the chunk. Two targets cap the prompt tokens of such steps (the smaller cap wins):
``--max-decode-stall-ms T``, so such a step takes at most T, and ``--chunk-step-ratio R``,
so it takes at most R times a decode-only step. The cost of a chunk grows with its context
(attention reads everything before it), so the cap is learned step by step: after each
mixed step, ``time ≈ decode + per_token × chunk`` gives the per-token cost at the current
context (running sums over recent chunks), and the next chunk is the one that would take
exactly the target. Steps without decodes are never capped (no stream is waiting). A
step's time is its period as the scheduler sees results come (``StepClock``): with
overlapped steps, the device's time on it, which is the gap a stream sees; the worker's own
step time also holds the step before it, still on the device.

The stall target is on by default for a GPU worker's streams (``decode_stall_target_ms``):
one H200, 1,000 streams of 1,024 in / 256 out at once through the stack, vLLM's own client,
both servers on their defaults otherwise: at 300 ms flotilla's ITL p99 was 359 ms against
vLLM 0.26.0's 435, TTFT p50 13.7 s against 14.3 and total tok/s 1.09x; off (another lease,
7a1a43b), ITL p99 517 against 438 (docs/bench.md; rows `streams` in BENCHMARKS.md with the
command). On the 2-core CPU it stays off: there a decode step of a few requests alone takes
~100 ms, and the CPU comparisons were measured without it. The in-process engine (offline
runs: nobody watches the gaps) leaves it off too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from shared import limits
from shared.messages import StepPlan

DECODE_EMA_WEIGHT = 0.2  # of the newest decode-only step in the running mean
# The per-token cost is the ratio of running sums, chunk seconds over chunk tokens, each
# moved this far toward the newest mixed step: symmetric, so periods that come in pairs
# (a result the host reads late holds two steps, the one right after it almost none)
# average out. Before, a dearer step was believed at once and a cheaper one moved the cost
# 30%: on an H200 at a 300 ms target the chunks of a 1,000-request burst stayed at 2-4k
# tokens where ~10k fit (TTFT p50 14.3 -> 17.8 s). Paired periods are the likeliest cause;
# this estimator is not yet measured on the GPU.
CHUNK_EMA_WEIGHT = 0.2  # (paired periods then swing the cost ±11% about its mean)


def decode_stall_target_ms(configured: float | None, gpu_worker: bool) -> float:
    """``--max-decode-stall-ms`` as given (0: off), or by default limits.GPU_DECODE_STALL_MS for a
    GPU worker's streams and off otherwise."""
    if configured is not None:
        return configured
    return limits.GPU_DECODE_STALL_MS if gpu_worker else 0.0


class StepClock:
    """Each step's period: from the later of its plan and the result before it to its own
    result (``clock``: time.monotonic; tests pass their own)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._plan_times: dict[int, float] = {}
        self._last_result_time = 0.0

    def planned(self, step_id: int) -> None:
        self._plan_times[step_id] = self.clock()

    def period(self, step_id: int) -> float:
        """The period of the step whose result just came (0 if it was not planned here)."""
        now = self.clock()
        plan_time = self._plan_times.pop(step_id, now)
        for dropped in [s for s in self._plan_times if s < step_id]:  # (a failed worker's)
            del self._plan_times[dropped]
        started, self._last_result_time = self._last_result_time, now
        return now - max(started, plan_time)


class ChunkPacer:
    def __init__(self, ratio: float, max_tokens: int, min_tokens: int,
                 target_s: float = 0.0) -> None:
        self.ratio = ratio
        self.target_s = target_s  # a mixed step's longest time (0: none)
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.decode_step_s: float | None = None  # running mean of decode-only steps
        # the recent chunks' cost per prompt token (it grows with the context), from running
        # sums of their seconds beyond the decodes' and of their tokens; a step with no
        # decodes counts whole, which overestimates it: the first paced chunk is small
        self.per_token_s: float | None = None
        self._chunk_s = self._chunk_tokens = 0.0

    @property
    def enabled(self) -> bool:
        return self.ratio > 0 or self.target_s > 0

    @property
    def limit(self) -> int:
        """Prompt tokens allowed in a step that also decodes."""
        if not self.per_token_s:
            return self.max_tokens
        wanted = [self.max_tokens]
        if self.ratio > 0 and self.decode_step_s is not None:
            wanted.append(round((self.ratio - 1) * self.decode_step_s / self.per_token_s))
        if self.target_s > 0:  # (no decode-only step yet: the chunk's cost holds it all)
            room_s = self.target_s - (self.decode_step_s or 0.0)
            # decodes alone near the target must not starve prompts: an eighth at least
            wanted.append(max(self.max_tokens // 8, round(room_s / self.per_token_s)))
        return max(self.min_tokens, min(wanted))

    def chunk_budget(self, num_decodes: int) -> int:
        """Prompt tokens a step with ``num_decodes`` decodes may carry."""
        return self.limit if num_decodes else self.max_tokens

    def observe(self, plan: StepPlan, step_time_s: float) -> None:
        if not self.enabled or step_time_s <= 0:
            return
        num_decodes = sum(1 for s in plan.scheduled if s.num_new_tokens == 1)
        num_chunk_tokens = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        if num_chunk_tokens == 0:
            self.decode_step_s = step_time_s if self.decode_step_s is None else (
                (1 - DECODE_EMA_WEIGHT) * self.decode_step_s + DECODE_EMA_WEIGHT * step_time_s)
            return
        base = self.decode_step_s if num_decodes and self.decode_step_s is not None else 0.0
        weight = 1.0 if self.per_token_s is None else CHUNK_EMA_WEIGHT
        self._chunk_s += weight * (max(step_time_s - base, 0.0) - self._chunk_s)
        self._chunk_tokens += weight * (num_chunk_tokens - self._chunk_tokens)
        self.per_token_s = max(self._chunk_s, 1e-9) / self._chunk_tokens
