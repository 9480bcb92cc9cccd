"""Scheduler configuration."""

from __future__ import annotations

from shared.config import ServiceConfig


class SchedulerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla scheduler: continuous batching over a paged KV cache, one per replica."""

    replica_id: str = "0"  # drives the worker with the same replica id
    max_num_seqs: int = 64  # requests running at once
    max_num_batched_tokens: int = 2048  # tokens computed per step (decodes + prompt chunks)
    step_timeout_s: float = 120.0  # a step taking longer means the worker is gone
    stats_interval_s: float = 0.5  # stats events at most this often (and as a heartbeat)

    __help__ = {
        "replica_id": "replica this scheduler drives (its worker uses the same id)",
        "max_num_seqs": "most requests running at once",
        "max_num_batched_tokens": "most tokens computed in one step",
        "step_timeout_s": "seconds to wait for a step before failing its requests",
        "stats_interval_s": "seconds between stats events",
    }
