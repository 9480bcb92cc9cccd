"""The kvstore's NATS edge (docs/kvstore.md). Addressed by node: every verb is served on
``Subjects.kvstore(node_id, verb)``.

- attach, reserve, lookup, pin, stats, blocks_snapshot: requests with a reply;
- commit and release: served as requests that answer ``Empty``, so a caller may publish
  them (fire and forget, the worker's way) or ask and wait to know they were applied;
- keepalive: a plain subscription.

A lookup may pin the leading run of host hits (``KvLookupRequest.pin_id``): the
scheduler's one round trip for a host hit. Pins are handled concurrently (a disk read
runs in a thread; lookups and other pins go on meanwhile); each other verb in order.
Block events are batched every ``event_interval_s``; blocks_snapshot drains them first,
then pages out every indexed hash per namespace and tier (shared/block_snapshots.py),
for the gateways' routing index. Silent owners are expired every second. Arena files
live under ``kv_shm_dir`` and are removed at exit; those of earlier kvstores of this node
at start.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import tempfile
import time
import uuid
from pathlib import Path

import structlog

from services.kvstore.config import KvStoreConfig
from services.kvstore.disk_tier import DiskTier
from services.kvstore.disk_writer import DiskWriter, WriteJob
from services.kvstore.metrics import KvStoreMetrics
from services.kvstore.rate import RateMeter
from services.kvstore.store import DISK, HOST, KvStore, Namespace, num_host_slots, slot_nbytes_of
from shared.block_snapshots import KeptSnapshots
from shared.bus import Bus
from shared.errors import InvalidRequest, ServiceUnavailable
from shared.kv_arena import KvArena
from shared.messages import BlockSnapshotReply, BlockSnapshotRequest, Empty, HealthReply
from shared.kv_messages import (
    KvAttachReply, KvAttachRequest, KvBlockEvent, KvCommitRequest, KvKeepAlive, KvLookupReply,
    KvLookupRequest, KvPinReply, KvPinRequest, KvReleaseRequest, KvReserveReply,
    KvReserveRequest, KvStatsReply,
)
from shared.runtime import freeze_startup_objects
from shared.subjects import Subjects

log = structlog.get_logger()

EXPIRE_EVERY_S = 1.0
STATS_EVERY_S = 1.0
ARENA_PREFIX = "flotilla-kv-"


def shm_dir(config: KvStoreConfig) -> Path:
    path = Path(config.kv_shm_dir)
    if path.is_dir():
        return path
    fallback = Path(tempfile.gettempdir())
    log.warning("kv_shm_dir_missing", path=str(path), using=str(fallback))
    return fallback


def lock_arena(path: Path) -> int:
    """Hold a shared lock on our arena file for as long as we live (the kernel drops it
    when we die, kill -9 included): how a later kvstore tells a dead one's file."""
    fd = os.open(path, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return fd


def remove_stale_arenas(directory: Path, node_id: str) -> int:
    """Remove the arena files of dead kvstores of this node (a kill -9 leaves them behind);
    a live one's (another stack on this machine, a test) is locked and kept."""
    removed = 0
    for path in directory.glob(f"{ARENA_PREFIX}{node_id}-*"):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            continue  # its kvstore lives
        finally:
            os.close(fd)
        path.unlink(missing_ok=True)
        removed += 1
    return removed


class KvStoreService:
    def __init__(self, config: KvStoreConfig, bus: Bus, disk: DiskTier | None,
                 metrics: KvStoreMetrics, arena_dir: Path) -> None:
        self.config = config
        self.bus = bus
        self.store_id = uuid.uuid4().hex[:16]
        self.subjects = Subjects(config.namespace)
        self.metrics = metrics
        # the hot verbs' labelled counters, looked up once (labels() takes a lock each call)
        self._hits = {tier: metrics.hits.labels(tier) for tier in (HOST, DISK)}
        self._pinned_blocks = {tier: metrics.pinned_blocks.labels(tier) for tier in (HOST, DISK)}
        self.arena_dir = arena_dir
        self.store = KvStore(self.store_id, config.node_id, disk=disk,
                             owner_timeout_s=config.owner_timeout_s,
                             max_pinned_fraction=config.max_pinned_fraction,
                             max_reserved_fraction=config.max_reserved_fraction)
        self.writer = DiskWriter(disk, config.kv_disk_queue) if disk is not None else None
        self.disk_read_speed = RateMeter()
        self._loop = asyncio.get_running_loop()
        self._arena_locks: list[int] = []  # file descriptors, locked until we exit
        self._snapshots = KeptSnapshots()
        self._publishing = asyncio.Lock()  # events go out in seq order, snapshots between
        self.log = log.bind(node_id=config.node_id, store_id=self.store_id)

    def _subject(self, verb: str) -> str:
        return self.subjects.kvstore(self.config.node_id, verb)

    async def start(self) -> None:
        serve, s = self.bus.serve, self._subject
        await serve(s("attach"), KvAttachRequest, self._on_attach)
        await serve(s("reserve"), KvReserveRequest, self._on_reserve)
        await serve(s("commit"), KvCommitRequest, self._on_commit)
        await serve(s("lookup"), KvLookupRequest, self._on_lookup)
        await serve(s("pin"), KvPinRequest, self._on_pin, concurrent=True)
        await serve(s("release"), KvReleaseRequest, self._on_release)
        await serve(s("stats"), Empty, self._on_stats)
        await serve(s("blocks_snapshot"), BlockSnapshotRequest, self._on_blocks_snapshot)
        await self.bus.subscribe(s("keepalive"), KvKeepAlive, self._on_keepalive)
        await serve(s("health"), Empty, self._on_health)  # this node's (its probe)
        await serve(self.subjects.health("kvstore"), Empty, self._on_health,
                    queue=self.subjects.queue_group("kvstore"))

    async def run(self, stop: asyncio.Event) -> None:
        loops = [asyncio.create_task(self._events_loop()), asyncio.create_task(self._owners_loop())]
        try:
            await stop.wait()
        finally:
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            await self._publish_events()

    async def close(self) -> None:
        """Finish queued disk writes (bounded), then remove the arena files."""
        if self.writer is not None:
            finished = await asyncio.to_thread(self.writer.close, self.config.shutdown_timeout)
            if not finished:
                self.log.warning("kv_disk_writes_abandoned", num_queued=self.writer.num_queued)
        for ns in self.store.namespaces.values():
            ns.arena.unlink()

    # ------------------------------------------------------------ handlers
    async def _on_attach(self, request: KvAttachRequest) -> KvAttachReply:
        layout = request.layout
        try:
            slot_nbytes = slot_nbytes_of(layout, request.itemsize)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        name = layout.namespace
        self.store.keepalive(request.owner_id, time.monotonic())
        ns = self.store.namespaces.get(name)
        if ns is None:
            ns = await self._create_namespace(name, slot_nbytes, layout)
        elif ns.slot_nbytes != slot_nbytes:
            raise InvalidRequest(f"namespace {name} has {ns.slot_nbytes}-byte slots, not "
                                 f"{slot_nbytes} (itemsize {request.itemsize})")
        self.log.info("kv_attached", owner_id=request.owner_id, namespace=name)
        return KvAttachReply(store_id=self.store_id, node_id=self.config.node_id, namespace=name,
                             arena_path=str(ns.arena.path), num_slots=ns.host.num_slots,
                             slot_nbytes=slot_nbytes)

    async def _create_namespace(self, name: str, slot_nbytes: int, layout) -> Namespace:
        try:
            stat = os.statvfs(self.arena_dir)
            free_bytes = stat.f_bavail * stat.f_frsize
        except OSError:
            free_bytes = None
        num_slots = num_host_slots(self.config.host_memory_bytes, slot_nbytes, free_bytes)
        if num_slots < 1:
            raise ServiceUnavailable(
                f"the host tier has no room for one {slot_nbytes}-byte block (--kv-host-memory "
                f"{self.config.kv_host_memory}, {free_bytes} bytes free in {self.arena_dir})")
        path = self.arena_dir / f"{ARENA_PREFIX}{self.config.node_id}-{name}-{self.store_id}"
        arena = await asyncio.to_thread(KvArena.create, path, num_slots, slot_nbytes,
                                        self.store_id)
        self._arena_locks.append(lock_arena(path))
        ns = Namespace(name, slot_nbytes, arena, self.store.new_host_tier(num_slots))
        self.store.add_namespace(ns)
        disk_blocks = self.store.disk.count_namespace(name) if self.store.disk else 0
        self.log.info("kv_namespace_created", namespace=name, num_slots=num_slots,
                      slot_nbytes=slot_nbytes, arena=str(path), disk_blocks=disk_blocks,
                      layout=str(layout.slot_shape), dtype=layout.dtype)
        return ns

    async def _on_reserve(self, request: KvReserveRequest) -> KvReserveReply:
        slot_ids = self.store.reserve(request.namespace, request.owner_id, request.num_slots,
                                      time.monotonic())
        return KvReserveReply(store_id=self.store_id, slot_ids=slot_ids)

    async def _on_commit(self, request: KvCommitRequest) -> Empty:
        try:
            stored = self.store.commit(request, time.monotonic())
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self.metrics.blocks_committed.inc(len(stored))
        if stored and self.writer is not None:
            self._write_through(self.store.namespaces[request.namespace], stored)
        return Empty()

    def _write_through(self, ns: Namespace, stored: list[tuple[bytes, int, list[int]]]) -> None:
        """Queue each new block for the disk; its slot is held until written."""
        for block_hash, slot_id, token_ids in stored:
            if self.store.disk.contains(ns.name, block_hash):
                continue
            ns.host.hold(slot_id)
            job = WriteJob(ns.name, block_hash, token_ids, ns.slot_view(slot_id),
                           self._on_written(ns, slot_id))
            if not self.writer.submit(job):
                ns.host.unhold(slot_id)
                self.metrics.dropped_writes.inc()

    def _on_written(self, ns: Namespace, slot_id: int):
        def done(num_bytes: int, seconds: float) -> None:  # on the writer thread
            if num_bytes:
                self.metrics.bytes_written.labels(DISK).inc(num_bytes)
                self.metrics.store_latency.observe(seconds)
            self._loop.call_soon_threadsafe(ns.host.unhold, slot_id)
        return done

    async def _on_lookup(self, request: KvLookupRequest) -> KvLookupReply:
        started = time.perf_counter()
        try:
            tiers, slot_ids, token_ids = self.store.lookup(request, time.monotonic())
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        self._count_hits(tiers, len(request.block_hashes))
        if slot_ids:  # (none unless the lookup pins)
            self._pinned_blocks[HOST].inc(len(slot_ids))
            self.metrics.load_latency.observe(time.perf_counter() - started)
        return KvLookupReply(store_id=self.store_id, tiers=tiers,
                             disk_read_bytes_per_s=self.disk_read_speed.bytes_per_s,
                             slot_ids=slot_ids, token_ids=token_ids)

    def _count_hits(self, tiers: list[str], num_looked_up: int) -> None:
        num_host = tiers.count(HOST)
        if num_host:
            self._hits[HOST].inc(num_host)
        if num_host < len(tiers):
            self._hits[DISK].inc(len(tiers) - num_host)
        if num_looked_up > len(tiers):
            self.metrics.misses.inc(num_looked_up - len(tiers))

    async def _on_pin(self, request: KvPinRequest) -> KvPinReply:
        started = time.perf_counter()
        try:
            plan = self.store.begin_pin(request, time.monotonic())
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        read: list[list[int]] = []
        if plan.disk_items:
            read_started = time.perf_counter()
            read = await asyncio.to_thread(self.store.read_pin, plan)
            reply = self.store.finish_pin(plan, read)
            nbytes = len(read) * plan.namespace.slot_nbytes
            self.disk_read_speed.record(nbytes, time.perf_counter() - read_started)
            self.metrics.bytes_read.labels(DISK).inc(nbytes)
            self.metrics.disk_read_speed.set(self.disk_read_speed.bytes_per_s)
        else:
            reply = self.store.finish_pin(plan, read)
        for tier in (HOST, DISK):
            if count := reply.tiers.count(tier):
                self._pinned_blocks[tier].inc(count)
        self.metrics.load_latency.observe(time.perf_counter() - started)
        return reply

    async def _on_release(self, request: KvReleaseRequest) -> Empty:
        self.store.release(request.namespace, request.owner_id, request.pin_ids, time.monotonic())
        return Empty()

    async def _on_keepalive(self, message: KvKeepAlive) -> None:
        self.store.keepalive(message.owner_id, time.monotonic())

    async def _on_stats(self, _: Empty) -> KvStatsReply:
        return KvStatsReply(store_id=self.store_id, node_id=self.config.node_id,
                            tiers=self.store.tier_stats())

    async def _on_blocks_snapshot(self, request: BlockSnapshotRequest) -> BlockSnapshotReply:
        """A page of every block hash in the tiers, per namespace and tier (routing: a
        gateway that missed events, or started after blocks were stored). Offset 0 takes a
        new snapshot: pending events are drained and published first, so it is exactly the
        state after the seq it reports."""
        now = time.monotonic()
        if request.offset == 0:
            async with self._publishing:
                events, seq, parts = self.store.snapshot(time.time())
                self._snapshots.keep(seq, parts, now)
                await self._send_events(events)
            self.log.info("kv_block_snapshot_taken", seq=seq,
                          num_hashes=sum(len(part.block_hashes) for part in parts))
        else:
            seq = request.snapshot_seq
        return self._snapshots.page(self.store_id, seq, request.offset, now)

    async def _on_health(self, _: Empty) -> HealthReply:
        return HealthReply(service="kvstore", instance_id=self.config.instance_id,
                           detail={"node_id": self.config.node_id, "store_id": self.store_id,
                                   "namespaces": len(self.store.namespaces)})

    # ------------------------------------------------------------ loops
    async def _events_loop(self) -> None:
        last_stats = 0.0
        while True:
            await asyncio.sleep(self.config.event_interval_s)
            await self._publish_events()
            if time.monotonic() - last_stats >= STATS_EVERY_S:
                last_stats = time.monotonic()
                self.metrics.set_tiers(self.store.tier_stats())

    async def _publish_events(self) -> None:
        async with self._publishing:
            await self._send_events(self.store.collect_events(time.time()))

    async def _send_events(self, events: list[KvBlockEvent]) -> None:
        for event in events:
            try:
                await self.bus.publish(self.subjects.kvstore_blocks, event)
            except ServiceUnavailable:  # NATS is down: the seq gap tells subscribers
                pass

    async def _owners_loop(self) -> None:
        while True:
            await asyncio.sleep(EXPIRE_EVERY_S)
            for owner_id, (freed, pins) in self.store.expire_owners(time.monotonic()).items():
                self.metrics.expired_owners.inc()
                self.log.info("kv_owner_expired", owner_id=owner_id, slots_freed=freed,
                              pins_dropped=pins)


async def serve(config: KvStoreConfig, stop: asyncio.Event) -> None:
    metrics = KvStoreMetrics()
    arena_dir = shm_dir(config)
    removed = remove_stale_arenas(arena_dir, config.node_id)
    disk = None
    if config.kv_disk_dir:  # a block failing verification is counted from whichever thread
        disk = DiskTier(Path(config.kv_disk_dir).expanduser(), config.disk_size_bytes,
                        on_corrupt=lambda *_: metrics.corrupt.inc())
        num_blocks, num_corrupt = await asyncio.to_thread(disk.scan)
        log.info("kv_disk_indexed", path=str(disk.root), num_blocks=num_blocks,
                 num_bytes=disk.num_bytes, num_corrupt=num_corrupt)
    bus = await Bus.connect(config.nats_url, name=f"kvstore-{config.instance_id}",
                            on_lost=stop.set)
    service = KvStoreService(config, bus, disk, metrics, arena_dir)
    await service.start()
    if config.metrics_port:
        metrics.serve(config.metrics_port, config.metrics_host)
    freeze_startup_objects()
    service.log.info("kvstore_started", arena_dir=str(arena_dir), stale_arenas_removed=removed,
                     host_memory=config.kv_host_memory, disk_dir=config.kv_disk_dir or None,
                     metrics_port=config.metrics_port or None)
    try:
        await service.run(stop)
    finally:
        await bus.close()
        await service.close()
    bus.exit_if_lost()
