"""The block index's bus edge (docs/routing.md): keeps block_index.py current from the
schedulers' GPU-tier events and the kvstores' host/disk events, and fetches a scheduler's
or a kvstore's snapshot when the index asks (a seq gap, a late join). Part of the
gateway's bus edge with service.py, kept apart so that file stays about requests.

A snapshot is fetched page by page, each page with SNAPSHOT_PAGE_TIMEOUT_S and the whole
within SNAPSHOT_DEADLINE_S; any failure leaves that replica's (or node's) entries empty
(routing falls back to load, or to the other tiers) and the index asks again later.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine

import msgspec
import structlog

from services.gateway.block_index import BlockIndex
from services.gateway.metrics import GatewayMetrics
from shared.bus import Bus
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import (
    BlockSnapshotPart, BlockSnapshotReply, BlockSnapshotRequest, SchedulerBlockEvent,
)
from shared.scheduler_stats import SchedulerStats
from shared.kv_messages import KvBlockEvent
from shared.subjects import Subjects

log = structlog.get_logger()

SNAPSHOT_PAGE_TIMEOUT_S = 2.0
SNAPSHOT_DEADLINE_S = 10.0


class BlockFeed:
    def __init__(self, bus: Bus, subjects: Subjects, index: BlockIndex, metrics: GatewayMetrics,
                 spawn: Callable[[Coroutine], None]) -> None:
        self.bus = bus
        self.subjects = subjects
        self.index = index
        self.metrics = metrics
        self._spawn = spawn

    async def start(self) -> None:
        await self.bus.subscribe(self.subjects.scheduler_blocks, SchedulerBlockEvent,
                                 self._on_scheduler_event)
        await self.bus.subscribe(self.subjects.kvstore_blocks, KvBlockEvent, self._on_kv_event)

    def on_stats(self, stats: SchedulerStats) -> None:
        now, routing = time.monotonic(), stats.routing
        if self.index.on_scheduler_stats(stats.scheduler_id, routing.block_event_seq, now):
            self._spawn(self.fetch_snapshot(stats.scheduler_id))
        if routing.kv_node_id and self.index.on_kv_node_seen(routing.kv_node_id, now):
            self._spawn(self.fetch_kv_snapshot(routing.kv_node_id))

    def on_link(self, up: bool) -> None:
        """Events sent while our link was down are lost: rebuild every source."""
        if up:
            self.index.resync_all()

    async def _on_scheduler_event(self, event: SchedulerBlockEvent) -> None:
        if self.index.on_scheduler_event(event, time.monotonic()):
            self._spawn(self.fetch_snapshot(event.scheduler_id))

    async def _on_kv_event(self, event: KvBlockEvent) -> None:
        outcome = self.index.on_kv_event(event, time.monotonic())
        if outcome.reset:
            log.info("kv_block_index_reset", node_id=event.node_id, store_id=event.store_id,
                     reason=outcome.reset)
        if outcome.fetch:
            self._spawn(self.fetch_kv_snapshot(event.node_id))

    async def fetch_snapshot(self, scheduler_id: str) -> None:
        subject = self.subjects.scheduler_blocks_snapshot(scheduler_id)
        try:
            first, parts = await self._pages(subject)
        except (FlotillaError, msgspec.DecodeError) as exc:
            self.index.snapshot_failed(scheduler_id, time.monotonic())
            self.metrics.routing_snapshots.labels("failed").inc()
            log.warning("block_snapshot_failed", scheduler_id=scheduler_id, error=str(exc))
            return
        hashes = [h for part in parts for h in part.block_hashes]
        self.index.load_snapshot(scheduler_id, first.seq, hashes, time.monotonic())
        self.metrics.routing_snapshots.labels("loaded").inc()
        log.info("block_snapshot_loaded", scheduler_id=scheduler_id, seq=first.seq,
                 num_blocks=len(hashes))

    async def fetch_kv_snapshot(self, node_id: str) -> None:
        """The node's kvstore tiers, for the store_id the index follows now."""
        asked = self.index.kv_store_id(node_id)
        if asked is None:
            return
        bound = log.bind(node_id=node_id, store_id=asked)
        try:
            first, parts = await self._pages(self.subjects.kvstore(node_id, "blocks_snapshot"))
        except (FlotillaError, msgspec.DecodeError) as exc:
            self.index.kv_snapshot_failed(node_id, asked, time.monotonic())
            self.metrics.routing_snapshots.labels("kv_failed").inc()
            bound.warning("kv_block_snapshot_failed", error=str(exc))
            return
        loaded = self.index.load_kv_snapshot(node_id, asked, first.source_id, first.seq, parts,
                                             time.monotonic())
        self.metrics.routing_snapshots.labels("kv_loaded" if loaded else "kv_stale").inc()
        bound.info("kv_block_snapshot_loaded" if loaded else "kv_block_snapshot_stale",
                   source_id=first.source_id, seq=first.seq,
                   num_blocks=sum(len(part.block_hashes) for part in parts))

    async def _pages(self, subject: str) -> tuple[BlockSnapshotReply, list[BlockSnapshotPart]]:
        """Every page of a new snapshot: (the first page, all parts in order)."""
        deadline = time.monotonic() + SNAPSHOT_DEADLINE_S
        first = await self._page(subject, BlockSnapshotRequest(), deadline)
        parts = list(first.parts)
        num_got = sum(len(part.block_hashes) for part in parts)
        while num_got < first.num_hashes:
            page = await self._page(subject, BlockSnapshotRequest(
                offset=num_got, snapshot_seq=first.seq), deadline)
            got = sum(len(part.block_hashes) for part in page.parts)
            if not got:
                break
            parts += page.parts
            num_got += got
        return first, parts

    async def _page(self, subject: str, request: BlockSnapshotRequest,
                    deadline: float) -> BlockSnapshotReply:
        timeout = min(SNAPSHOT_PAGE_TIMEOUT_S, deadline - time.monotonic())
        if timeout <= 0:
            raise ServiceUnavailable("the block snapshot took too long")
        return await self.bus.request(subject, request, BlockSnapshotReply, timeout=timeout)
