"""Scheduler configuration: the sections it reads (shared/sections/), composed once."""

from __future__ import annotations

from shared.config import compose
from shared.sections.engine import BatchLimits, Lora
from shared.sections.kvstore import KvClient
from shared.sections.runtime import COMMON, Drain, Replica
from shared.sections.scheduling import Scheduling, SchedulingPolicy  # noqa: F401
from shared.sections.speculative import Speculation

SchedulerConfig = compose(
    "SchedulerConfig",
    "flotilla scheduler: continuous batching over a paged KV cache, one per replica.",
    (*COMMON, Replica, BatchLimits, Scheduling, Speculation, KvClient, Lora, Drain),
    module=__name__)
