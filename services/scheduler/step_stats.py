"""What the scheduler's stats events report (SchedulerStats, shared/scheduler_stats.py),
pure: the heartbeat; the engine's figures (the worker's busy time and its idle share over
an interval with work throughout, the recent steps' sizes and times); speculation's; a MoE
model's expert routing (expert_counts.py); and the speeds measured from each step
(tiering.py: the kvstore's choice and the gateways' routing, whose part block_events.py
makes). service.py publishes them."""

from __future__ import annotations

import time

import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.expert_counts import ExpertCounts
from services.scheduler.kv_tier import KvTierHooks
from services.scheduler.scheduler import Scheduler
from services.scheduler.tiering import TierSpeeds
from shared.messages import StepPlan, StepResult
from shared.scheduler_stats import (
    EngineStats, LoraStats, MoeStats, RoutingStats, SchedulerStats, SpeculationStats,
)

log = structlog.get_logger()

MAX_STEP_SAMPLES = 512  # per stats event


class StepStats:
    def __init__(self, speeds: TierSpeeds) -> None:
        self.speeds = speeds
        self.worker_busy_s = 0.0
        self.encoder = [0, 0, 0.0]  # images encoded, cache hits, seconds (docs/vision.md)
        self._samples: list[tuple[int, float]] = []  # (tokens, seconds) since the last event
        # the last interval's end: monotonic time, busy seconds, and whether work was held
        self._last = (time.monotonic(), 0.0, False)
        self.expert_counts = ExpertCounts()  # since the worker attached

    def worker_attached(self) -> None:
        """A (new) worker attached: its expert counts start from zero."""
        self.expert_counts.reset()

    def record_step(self, plan: StepPlan, result: StepResult) -> None:
        num_tokens = sum(s.num_new_tokens for s in plan.scheduled)
        self.worker_busy_s += result.step_time_s
        if result.num_images_encoded or result.num_encoder_cache_hits:
            self.encoder[0] += result.num_images_encoded
            self.encoder[1] += result.num_encoder_cache_hits
            self.encoder[2] += result.encoder_time_s
        num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        self.speeds.observe_step(num_tokens, num_prompt, result.step_time_s,  # routing too
                                 result.kv_load_bytes, result.kv_load_bytes_per_s)
        if len(self._samples) < MAX_STEP_SAMPLES:
            self._samples.append((num_tokens, result.step_time_s))
        if result.expert_token_counts:  # a MoE worker's report (about once a second)
            try:
                self.expert_counts.add(result.expert_token_counts)
            except ValueError as exc:
                log.warning("expert_counts_ignored", step_id=plan.step_id, reason=str(exc))
        log.debug("step_done", step_id=plan.step_id, num_scheduled=len(plan.scheduled),
                  num_tokens=num_tokens, num_prompt_tokens=num_prompt,
                  num_stores=len(plan.kv_stores), worker_time_s=round(result.step_time_s, 4),
                  kv_load_bytes=result.kv_load_bytes,
                  kv_load_gb_per_s=round(result.kv_load_bytes_per_s / 1e9, 1))

    def report(self, config: SchedulerConfig, core: Scheduler, kv: KvTierHooks,
               routing: RoutingStats, *, worker_ready: bool, now: float) -> SchedulerStats:
        """The stats event for the interval since the last one: the heartbeat, ``routing``
        (block_events.py), the engine's figures, speculation's and the experts'."""
        return SchedulerStats(
            scheduler_id=config.instance_id, replica_id=config.replica_id,
            timestamp=time.time(), worker_ready=worker_ready, num_running=len(core.running),
            num_waiting=len(core.waiting), num_steps=core.num_steps, routing=routing,
            engine=self._engine_stats(core, kv, now), speculation=speculation_stats(core),
            moe=MoeStats(expert_token_counts=self.expert_counts.counts()),
            lora=lora_stats(core))

    def _engine_stats(self, core: Scheduler, kv: KvTierHooks, now: float) -> EngineStats:
        last_wall, last_busy, was_busy = self._last
        is_busy = bool(core.running)
        # Idle share of the worker's time over an interval with work throughout.
        idle_ratio = (max(0.0, 1.0 - (self.worker_busy_s - last_busy) / (now - last_wall))
                      if was_busy and is_busy and now > last_wall else -1.0)
        self._last = (now, self.worker_busy_s, is_busy)
        samples, self._samples = self._samples, []
        return EngineStats(
            num_blocks_used=core.block_manager.num_used_blocks,
            num_blocks_total=core.block_manager.num_blocks,
            num_preemptions=core.num_preemptions, num_prefix_queries=core.num_prefix_queries,
            num_prefix_hits=core.num_prefix_hits,
            num_kv_tier_hits=sum(kv.num_tokens_loaded.values()),
            num_kv_tier_hits_by_tier=dict(kv.num_tokens_loaded),
            worker_busy_s=self.worker_busy_s, worker_idle_ratio=idle_ratio,
            num_images_encoded=self.encoder[0], num_encoder_cache_hits=self.encoder[1],
            encoder_time_s=self.encoder[2],
            recent_step_tokens=[tokens for tokens, _ in samples],
            recent_step_times_s=[seconds for _, seconds in samples])


def lora_stats(core: Scheduler) -> LoraStats:
    """The replica's adapters, and those its running and waiting requests use (by name)."""
    loras = core.loras
    if not loras.enabled:
        return LoraStats()
    return LoraStats(
        adapters=loras.refs(), max_loras=loras.max_loras,
        running=sorted({r.lora.name for r in core.running if r.lora is not None}),
        waiting=sorted({r.lora.name for r in core.waiting if r.lora is not None}))


def speculation_stats(core: Scheduler) -> SpeculationStats:
    books, drafter = core.draft_books, core.drafter
    return SpeculationStats(
        num_draft_tokens=books.num_draft_tokens, num_accepted_drafts=books.num_accepted_drafts,
        num_drafted_steps=books.num_drafted_steps,
        num_accepted_per_position=list(books.num_accepted_per_position),
        draft_cap=drafter.step_cap if drafter.enabled else -1)
