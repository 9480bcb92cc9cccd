"""What the gateways' KV-aware routing learns from this scheduler (docs/routing.md): the
block hashes that enter and leave its GPU prefix cache, as ``SchedulerBlockEvent``s, a
snapshot of them on request, and the stats fields that price them. Part of the
scheduler's bus edge with service.py (kept apart so that file stays about the step loop).

Events go out at most every PUBLISH_INTERVAL_S, each with at most MAX_HASHES_PER_EVENT
hashes, numbered 1, 2, ... per scheduler instance: a gateway that sees a gap (or joins
late) asks for a snapshot. A snapshot is taken right after the journal is drained into
events, so it is exactly the state those events leave; it is kept for SNAPSHOT_TTL_S and
paged out MAX_HASHES_PER_PAGE hashes at a time (NATS carries at most 1 MB a message).

When the service replaces its core (the worker re-attached: an empty cache), every hash
the old core held is published as removed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog

from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_connector import NoKvConnector
from services.scheduler.scheduler import Scheduler
from services.scheduler.tiering import TierSpeeds
from shared.block_snapshots import MAX_HASHES_PER_PAGE, MAX_SNAPSHOTS_KEPT, SNAPSHOT_TTL_S
from shared.bus import Bus
from shared.errors import InvalidRequest, ServiceUnavailable
from shared.messages import (
    BlockSnapshotPart, BlockSnapshotReply, BlockSnapshotRequest, SchedulerBlockEvent, WorkerInfo,
)
from shared.scheduler_stats import RoutingStats
from shared.subjects import Subjects

log = structlog.get_logger()

PUBLISH_INTERVAL_S = 0.05
MAX_HASHES_PER_EVENT = 2000  # ~70 KB of hashes


class BlockEventPublisher:
    def __init__(self, bus: Bus, subjects: Subjects, scheduler_id: str, replica_id: str,
                 current_manager: Callable[[], BlockManager]) -> None:
        self.bus = bus
        self.subjects = subjects
        self.scheduler_id = scheduler_id
        self.replica_id = replica_id
        self.seq = 0  # of the last event made
        self._current_manager = current_manager
        self._manager: BlockManager | None = None  # the cache the published events describe
        self._snapshots: dict[int, tuple[float, list[bytes]]] = {}  # seq -> (taken at, hashes)

    async def start(self) -> None:
        await self.bus.serve(self.subjects.scheduler_blocks_snapshot(self.scheduler_id),
                             BlockSnapshotRequest, self._on_snapshot)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            await self._publish(self.collect(time.time()))

    def collect(self, now: float) -> list[SchedulerBlockEvent]:
        """Events for what changed since the last call (the caller publishes them)."""
        manager = self._current_manager()
        changes: dict[bytes, bool] = {}  # hash -> findable now (the last change wins)
        if manager is not self._manager:
            if self._manager is not None:  # replaced: nothing it held is findable now
                _, removed = self._manager.take_journal()
                changes.update((h, False) for h in removed + self._manager.cached_hashes())
            manager.keep_journal()
            changes.update((h, True) for h in manager.cached_hashes())
            self._manager = manager
        else:
            stored, removed = manager.take_journal()
            changes.update((h, False) for h in removed)
            changes.update((h, True) for h in stored)
        items = list(changes.items())
        events = []
        for start in range(0, len(items), MAX_HASHES_PER_EVENT):
            chunk = items[start:start + MAX_HASHES_PER_EVENT]
            self.seq += 1
            events.append(SchedulerBlockEvent(
                scheduler_id=self.scheduler_id, replica_id=self.replica_id, seq=self.seq,
                stored_hashes=[h for h, held in chunk if held],
                removed_hashes=[h for h, held in chunk if not held], timestamp=now))
        return events

    async def _publish(self, events: list[SchedulerBlockEvent]) -> None:
        for event in events:
            try:
                await self.bus.publish(self.subjects.scheduler_blocks, event)
            except ServiceUnavailable:  # NATS is down: the seq gap tells the gateways
                pass

    # ------------------------------------------------------------ snapshots
    async def _on_snapshot(self, request: BlockSnapshotRequest) -> BlockSnapshotReply:
        now = time.monotonic()
        if request.offset == 0:
            events = self.collect(time.time())
            self.take_snapshot(now)
            await self._publish(events)
            seq = self.seq
        else:
            seq = request.snapshot_seq
        return self.page(seq, request.offset, now)

    def take_snapshot(self, now: float) -> None:
        """Keep the cache's hashes as of the last event collected (call right after
        ``collect``)."""
        self._snapshots = {seq: kept for seq, kept in self._snapshots.items()
                           if now - kept[0] < SNAPSHOT_TTL_S}
        if self.seq not in self._snapshots:
            hashes = self._manager.cached_hashes() if self._manager is not None else []
            self._snapshots[self.seq] = (now, hashes)
            while len(self._snapshots) > MAX_SNAPSHOTS_KEPT:
                del self._snapshots[min(self._snapshots)]

    def page(self, seq: int, offset: int, now: float) -> BlockSnapshotReply:
        kept = self._snapshots.get(seq)
        if kept is None or now - kept[0] >= SNAPSHOT_TTL_S:
            raise InvalidRequest(f"snapshot {seq} is gone: ask for a new one (offset 0)",
                                 param="snapshot_seq", code="snapshot_gone")
        hashes = kept[1]
        return BlockSnapshotReply(
            source_id=self.scheduler_id, seq=seq, num_hashes=len(hashes), offset=offset,
            parts=[BlockSnapshotPart(block_hashes=hashes[offset:offset + MAX_HASHES_PER_PAGE])])


def routing_stats(core: Scheduler, speeds: TierSpeeds, worker: WorkerInfo | None,
                  kv: NoKvConnector, block_event_seq: int) -> RoutingStats:
    """The part of the stats the gateway routes by (docs/routing.md)."""
    return RoutingStats(
        block_size=core.block_manager.block_size, model_name=core.model_name,
        kv_node_id=kv.node_id, kv_namespace=kv.namespace,
        num_queued_prefill_tokens=core.num_queued_prefill_tokens,
        prefill_tokens_per_s=speeds.prefill_tokens_per_s or 0.0,
        host_load_bytes_per_s=speeds.host_load_bytes_per_s or 0.0,
        disk_read_bytes_per_s=speeds.disk_read_bytes_per_s or 0.0,
        block_bytes=worker.kv_cache_bytes // worker.num_blocks if worker and worker.num_blocks
        else 0, block_event_seq=block_event_seq,
        decode_seq_cost_tokens=speeds.decode_seq_cost_tokens or 0.0)
