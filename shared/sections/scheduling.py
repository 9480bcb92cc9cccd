"""The scheduler's knobs: admission, step planning and pacing, and its patience."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from shared.config import Section, check_choice, check_number, knob


class SchedulingPolicy(StrEnum):
    """Which waiting request runs first."""

    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # lower `priority` values first, then arrival order


class Scheduling(Section, frozen=True, kw_only=True):
    max_queued_requests: Annotated[int, knob(
        "most requests waiting to run per replica; more are refused with 429 and "
        "Retry-After")] = 4096
    prefix_caching: Annotated[bool, knob(
        "automatic prefix caching: reuse the KV of cached prompt prefixes")] = True
    scheduling_policy: Annotated[SchedulingPolicy, knob(
        "which waiting request runs first: fcfs (arrival order) or priority (the request's "
        "`priority`, then arrival)")] = SchedulingPolicy.FCFS
    max_steps_in_flight: Annotated[int, knob(
        "steps sent ahead to the worker (2 overlaps planning step N+1 with computing step N; "
        "1: no overlap)")] = 2
    chunk_step_ratio: Annotated[float, knob(
        "cap prompt chunks so a step that also decodes takes at most this many decode-only "
        "steps' time (0: off)")] = 0.0
    max_decode_stall_ms: Annotated[float | None, knob(
        "cap prompt chunks so a step that also decodes takes at most this long: the longest "
        "gap between a stream's tokens while prompts are admitted; it costs time to first "
        "token (0: off; default 300 for a GPU worker's streams, off on a CPU)")] = None
    admission_reserve: Annotated[bool, knob(
        "admit a request only while the running ones keep room to grow (by the share of "
        "max_tokens finished requests used), so few are preempted and computed twice")] = True
    step_timeout_s: Annotated[float, knob(
        "seconds to wait for a step before failing its requests (the worker is gone)")] = 120.0
    stats_interval_s: Annotated[float, knob(
        "seconds between the scheduler's stats events (its heartbeat)")] = 0.5
    max_kv_load_mib_per_step: Annotated[int, knob(
        "MiB of kvstore hits loaded in one step past its first hit: a step that reads loaded "
        "blocks waits for its whole copy, so smaller batches let loads and compute pipeline "
        "(0: no cap; docs/kvstore.md)")] = 1024

    def __post_init__(self) -> None:
        check_choice(self.scheduling_policy, SchedulingPolicy, "scheduling_policy")
        check_number(self.chunk_step_ratio, "chunk_step_ratio")
        if self.max_decode_stall_ms is not None:
            check_number(self.max_decode_stall_ms, "max_decode_stall_ms")
        if self.max_kv_load_mib_per_step < 0:
            raise ValueError("max_kv_load_mib_per_step must be 0 (no cap) or positive")
        if self.max_steps_in_flight < 1:
            raise ValueError("max_steps_in_flight must be at least 1")
        if self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be 0 or more")
