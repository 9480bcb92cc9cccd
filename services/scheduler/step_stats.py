"""What the scheduler's stats events report (SchedulerStats), pure: the worker's busy
time and its idle share over an interval with work throughout, the recent steps' sizes
and times, and the speeds measured from each step (tiering.py: the kvstore's choice and
the gateways' routing). service.py publishes them."""

from __future__ import annotations

import time

import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.scheduler.tiering import TierSpeeds
from shared.messages import SchedulerStats, StepPlan, StepResult

log = structlog.get_logger()

MAX_STEP_SAMPLES = 512  # per stats event


class StepStats:
    def __init__(self, speeds: TierSpeeds) -> None:
        self.speeds = speeds
        self.worker_busy_s = 0.0
        self._samples: list[tuple[int, float]] = []  # (tokens, seconds) since the last event
        # the last interval's end: monotonic time, busy seconds, and whether work was held
        self._last = (time.monotonic(), 0.0, False)

    def record_step(self, plan: StepPlan, result: StepResult) -> None:
        num_tokens = sum(s.num_new_tokens for s in plan.scheduled)
        self.worker_busy_s += result.step_time_s
        num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        self.speeds.observe_step(num_tokens, num_prompt, result.step_time_s,  # routing too
                                 result.kv_load_bytes, result.kv_load_bytes_per_s)
        if len(self._samples) < MAX_STEP_SAMPLES:
            self._samples.append((num_tokens, result.step_time_s))
        log.debug("step_done", step_id=plan.step_id, num_scheduled=len(plan.scheduled),
                  num_tokens=num_tokens, num_prompt_tokens=num_prompt,
                  num_stores=len(plan.kv_stores), worker_time_s=round(result.step_time_s, 4),
                  kv_load_bytes=result.kv_load_bytes,
                  kv_load_gb_per_s=round(result.kv_load_bytes_per_s / 1e9, 1))

    def report(self, config: SchedulerConfig, core: Scheduler | None, *, draining: bool,
               now: float, **fields) -> SchedulerStats:
        """The stats event for the interval since the last one; ``fields``: the KV
        connector's and routing's."""
        last_wall, last_busy, was_busy = self._last
        is_busy = bool(core and core.running)
        # Idle share of the worker's time over an interval with work throughout.
        idle_ratio = (max(0.0, 1.0 - (self.worker_busy_s - last_busy) / (now - last_wall))
                      if was_busy and is_busy and now > last_wall else -1.0)
        self._last = (now, self.worker_busy_s, is_busy)
        samples, self._samples = self._samples, []
        manager = core.block_manager if core else None
        return SchedulerStats(
            scheduler_id=config.instance_id, replica_id=config.replica_id,
            timestamp=time.time(), num_running=len(core.running) if core else 0,
            num_waiting=len(core.waiting) if core else 0,
            num_blocks_used=manager.num_used_blocks if manager else 0,
            num_blocks_total=manager.num_blocks if manager else 0,
            num_steps=core.num_steps if core else 0,
            num_preemptions=core.num_preemptions if core else 0,
            # draining: not ready for new requests (gateways route around it)
            worker_ready=core is not None and not draining,
            num_prefix_queries=core.num_prefix_queries if core else 0,
            num_prefix_hits=core.num_prefix_hits if core else 0,
            num_draft_tokens=core.draft_books.num_draft_tokens if core else 0,
            num_accepted_drafts=core.draft_books.num_accepted_drafts if core else 0,
            num_drafted_steps=core.draft_books.num_drafted_steps if core else 0,
            num_accepted_per_position=list(core.draft_books.num_accepted_per_position)
            if core else [],
            draft_cap=core.drafter.step_cap if core and core.drafter.enabled else -1,
            worker_busy_s=self.worker_busy_s, worker_idle_ratio=idle_ratio,
            recent_step_tokens=[tokens for tokens, _ in samples],
            recent_step_times_s=[seconds for _, seconds in samples], **fields)
