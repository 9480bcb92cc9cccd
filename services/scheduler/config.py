"""Scheduler configuration."""

from __future__ import annotations

from enum import StrEnum

from services.scheduler.speculation import parse_speculative_config
from shared import limits
from shared.config import ServiceConfig, check_choice


class SchedulingPolicy(StrEnum):
    """Which waiting request runs first."""

    FCFS = "fcfs"  # arrival order
    PRIORITY = "priority"  # lower `priority` values first, then arrival order


class SchedulerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla scheduler: continuous batching over a paged KV cache, one per replica."""

    replica_id: str = "0"  # drives the worker with the same replica id
    max_num_seqs: int = limits.MAX_NUM_SEQS  # the batch limits: shared/limits.py
    max_num_batched_tokens: int = limits.MAX_NUM_BATCHED_TOKENS
    max_queued_requests: int = 4096  # waiting requests; past this a submit gets 429
    prefix_caching: bool = True  # --no-prefix-caching turns it off
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    max_steps_in_flight: int = 2  # 2 overlaps planning step N+1 with computing step N
    chunk_step_ratio: float = 0.0  # >0: steps with decodes and a prompt chunk take at most this
    # many decode-only steps' time (prompt chunks shrink to fit); 0: off
    # >0: such steps take at most this long; 0: off; None: 300 for a GPU worker's streams
    # (chunk_pacer.decode_stall_target_ms)
    max_decode_stall_ms: float | None = None
    # keep KV blocks free for the running requests' next tokens (admission.py)
    admission_reserve: bool = True
    step_timeout_s: float = 120.0  # a step taking longer means the worker is gone
    stats_interval_s: float = 0.5  # stats events at most this often (and as a heartbeat)
    kv_node_id: str = ""  # the node's kvstore (docs/kvstore.md); "": none
    # tier hits loaded in one step, beyond its first: a step that reads loaded blocks waits for
    # its whole copy, so smaller batches let loads and compute pipeline (0: no cap; 1,024 is
    # ~20 ms of an H200's host link: prefill512 4.87x -> 5.85x, docs/kvstore.md)
    max_kv_load_mib_per_step: int = 1024
    shutdown_timeout: float = 30.0  # s; on SIGTERM: finish held requests this long, fail the rest
    # speculative decoding (speculation.py): JSON with vLLM's names; "": off
    speculative_config: str = ""

    __help__ = {
        "speculative_config": "speculative decoding, JSON with vLLM's field names, e.g. "
                              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}' "
                              "(prompt lookup; greedy requests; docs/speculative-decoding.md)",
        "kv_node_id": "node id of the kvstore to use (empty: no kvstore)",
        "max_kv_load_mib_per_step": "MiB of kvstore hits loaded in one step, past its first "
                                    "hit (0: no cap)",
        "replica_id": "replica this scheduler drives (its worker uses the same id)",
        **limits.BATCH_LIMITS_HELP,
        "max_queued_requests": "most requests waiting to run; more are refused with 429",
        "prefix_caching": "reuse the KV of cached prompt prefixes",
        "scheduling_policy": "fcfs or priority",
        "max_steps_in_flight": "steps sent ahead to the worker (1: no overlap)",
        "chunk_step_ratio": "cap prompt chunks so a step that also decodes takes at most this "
                            "many decode-only steps' time (0: off)",
        "admission_reserve": "admit a request only while the running ones keep room to grow "
                             "(by the share of max_tokens finished requests used), so few are "
                             "preempted and computed twice",
        "max_decode_stall_ms": "cap prompt chunks so a step that also decodes takes at most "
                               "this long: the longest gap between a stream's tokens while "
                               "prompts are admitted (0: off; default 300 with a GPU "
                               "worker, off on a CPU)",
        "step_timeout_s": "seconds to wait for a step before failing its requests",
        "stats_interval_s": "seconds between stats events",
        "shutdown_timeout": "on SIGTERM, take no new requests and finish the running and "
                              "waiting ones for this long; then fail what is left (503) and exit",
    }

    def __post_init__(self) -> None:
        limits.check_batch_limits(self.max_num_seqs, self.max_num_batched_tokens)
        check_choice(self.scheduling_policy, SchedulingPolicy, "scheduling_policy")
        if self.chunk_step_ratio < 0 or (self.max_decode_stall_ms or 0) < 0:
            raise ValueError("chunk_step_ratio and max_decode_stall_ms must be 0 (off) or "
                             "positive")
        if self.shutdown_timeout < 0:
            raise ValueError("shutdown_timeout must be 0 or more")
        if self.max_kv_load_mib_per_step < 0:
            raise ValueError("max_kv_load_mib_per_step must be 0 (no cap) or positive")
        if self.max_steps_in_flight < 1:
            raise ValueError("max_steps_in_flight must be at least 1")
        parse_speculative_config(self.speculative_config)  # a bad one fails at start
