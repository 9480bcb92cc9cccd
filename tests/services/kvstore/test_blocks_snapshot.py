"""The kvstore's blocks_snapshot over a real nats-server: the kvstore service in this
process (so the page size can be made small), with a disk tier. Blocks stored by a
worker's verbs; a paged snapshot equals the hashes indexed per namespace and tier, and
drains the pending events first (its seq is the last one published). Then the gateway's
feed and index on their own bus: a gateway that learns of the node from a scheduler's
stats, or misses an event, rebuilds the node's entries from the snapshot; a node whose
kvstore does not answer leaves no entries and counts a failure."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.gateway.block_feed import BlockFeed
from services.gateway.block_index import BlockIndex, block_key
from services.gateway.metrics import GatewayMetrics
from services.kvstore.config import KvStoreConfig
from services.kvstore.disk_tier import DiskTier
from services.kvstore.metrics import KvStoreMetrics
from services.kvstore.service import KvStoreService
from shared import block_snapshots
from shared.bus import Bus
from shared.errors import FlotillaError
from shared.messages import BlockSnapshotReply, BlockSnapshotRequest, Empty
from shared.scheduler_stats import RoutingStats, SchedulerStats
from shared.kv_messages import (
    KvAttachReply, KvAttachRequest, KvBlockEvent, KvCommitRequest, KvLayout, KvReserveReply,
    KvReserveRequest, KvStatsReply,
)
from shared.subjects import Subjects
from tests.nats_server import started_nats_server

pytestmark = pytest.mark.integration

SUBJECTS = Subjects(namespace="kvsnaptest")
LAYOUT = KvLayout(weights_version="test-weights", dtype="float32", num_layers=2, block_size=4,
                  num_kv_heads=2, head_dim=16)
SLOT_NBYTES = 2 * 2 * 4 * 2 * 16 * 4  # 2048
NODE = "snap-node"
OTHER_NS = "other-namespace"


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")  # the index keys a block by its first 8 bytes


@pytest.fixture
def nats_url(tmp_path):
    server = started_nats_server(tmp_path / "nats.log")
    yield server.url
    server.stop()


async def until(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if asyncio.iscoroutine(value):
            value = await value
        if value:
            return True
        await asyncio.sleep(0.02)
    return False


async def store_blocks(bus: Bus, attached: KvAttachReply, hashes: list[int]) -> None:
    """The worker's part: reserve (at most half the host slots at a time), commit."""
    rest = list(hashes)
    while rest:
        reserved = await bus.request(SUBJECTS.kvstore(NODE, "reserve"), KvReserveRequest(
            namespace=attached.namespace, owner_id="worker", num_slots=len(rest)), KvReserveReply)
        taken, rest = rest[:len(reserved.slot_ids)], rest[len(reserved.slot_ids):]
        await bus.request(SUBJECTS.kvstore(NODE, "commit"), KvCommitRequest(
            namespace=attached.namespace, owner_id="worker", store_id=attached.store_id,
            block_hashes=[h(i) for i in taken], slot_ids=reserved.slot_ids[:len(taken)],
            token_ids=[i for i in taken for _ in range(4)], block_size=4,
            returned_slot_ids=reserved.slot_ids[len(taken):]), Empty)
        if rest and not reserved.slot_ids:
            await asyncio.sleep(0.02)  # every slot held by a disk write: wait for it


async def snapshot(bus: Bus) -> tuple[list[BlockSnapshotReply], dict[tuple[str, str], list[bytes]]]:
    """Every page of a new snapshot, and its hashes by (namespace, tier)."""
    subject = SUBJECTS.kvstore(NODE, "blocks_snapshot")
    pages = [await bus.request(subject, BlockSnapshotRequest(), BlockSnapshotReply)]
    got = sum(len(part.block_hashes) for part in pages[0].parts)
    while got < pages[0].num_hashes:
        pages.append(await bus.request(subject, BlockSnapshotRequest(
            offset=got, snapshot_seq=pages[0].seq), BlockSnapshotReply))
        assert pages[-1].parts, "a page short of num_hashes came back empty"
        got += sum(len(part.block_hashes) for part in pages[-1].parts)
    hashes: dict[tuple[str, str], list[bytes]] = {}
    for page in pages:
        for part in page.parts:
            hashes.setdefault((part.namespace, part.tier), []).extend(part.block_hashes)
    return pages, hashes


def stats(kv_node_id: str) -> SchedulerStats:
    return SchedulerStats(scheduler_id="s1", replica_id="0", timestamp=0.0,
                          routing=RoutingStats(kv_node_id=kv_node_id,
                                               kv_namespace=LAYOUT.namespace))


def tiers_of(index: BlockIndex, namespace: str, hashes: list[bytes]) -> list[str]:
    return [(index.tier_run(NODE, namespace, [block_key(x)], 0) or ["-"])[0] for x in hashes]


async def test_a_paged_snapshot_is_the_indexed_hashes_and_rebuilds_a_gateways_entries(
        tmp_path, nats_url, monkeypatch):
    monkeypatch.setattr(block_snapshots, "MAX_HASHES_PER_PAGE", 7)
    disk = DiskTier(tmp_path / "disk", 1 << 20)
    disk.write(OTHER_NS, h(900), [9] * 4, memoryview(bytes(SLOT_NBYTES)))  # an earlier run's
    disk.scan()
    (tmp_path / "shm").mkdir()
    config = KvStoreConfig(nats_url=nats_url, namespace=SUBJECTS.namespace, node_id=NODE,
                           kv_shm_dir=str(tmp_path / "shm"), kv_host_memory=str(16 * SLOT_NBYTES),
                           kv_disk_dir=str(tmp_path / "disk"), kv_disk_size="1MiB",
                           event_interval_s=60.0)  # events go out when the test says
    kv_bus = await Bus.connect(nats_url, name="kvstore")
    bus = await Bus.connect(nats_url, name="test")
    gateway_bus = await Bus.connect(nats_url, name="gateway")
    service = KvStoreService(config, kv_bus, disk, KvStoreMetrics(), tmp_path / "shm")
    await service.start()
    await kv_bus.flush()  # its subscriptions answer before the test's connection asks
    stop = asyncio.Event()
    running = asyncio.create_task(service.run(stop))
    events: list[KvBlockEvent] = []

    async def on_event(event: KvBlockEvent) -> None:
        events.append(event)

    index, metrics, tasks = BlockIndex(), GatewayMetrics(), set()
    feed = BlockFeed(gateway_bus, SUBJECTS, index, metrics,
                     lambda coro: tasks.add(asyncio.create_task(coro)))
    try:
        await bus.subscribe(SUBJECTS.kvstore_blocks, KvBlockEvent, on_event)
        await bus.flush()
        attached = await bus.request(SUBJECTS.kvstore(NODE, "attach"), KvAttachRequest(
            owner_id="worker", layout=LAYOUT, itemsize=4), KvAttachReply)
        await store_blocks(bus, attached, list(range(24)))  # 16 host slots: 8 evicted

        async def all_on_disk() -> bool:
            reply = await bus.request(SUBJECTS.kvstore(NODE, "stats"), Empty(), KvStatsReply)
            return next(t for t in reply.tiers if t.tier == "disk").num_blocks == 25
        assert await until(all_on_disk)
        assert not events  # nothing published yet: every change is pending

        pages, hashes = await snapshot(bus)
        first = pages[0]
        assert first.source_id == attached.store_id and first.num_hashes == 16 + 25
        assert len(pages) == 6 and all(p.offset == 7 * i for i, p in enumerate(pages))
        host = service.store.namespaces[LAYOUT.namespace].host.block_hashes()
        assert len(host) == 16 and sorted(hashes[(LAYOUT.namespace, "host")]) == sorted(host)
        assert set(host) <= {h(i) for i in range(24)}
        assert sorted(hashes[(LAYOUT.namespace, "disk")]) == [h(i) for i in range(24)]
        assert hashes[(OTHER_NS, "disk")] == [h(900)]
        assert len(hashes) == 3
        # the pending events were drained first and published: the snapshot is their state
        assert await until(lambda: events and events[-1].seq == first.seq)
        assert [e.seq for e in events] == list(range(1, first.seq + 1))
        # a page of a snapshot that is not kept is an error, never a wrong page
        with pytest.raises(FlotillaError) as error:
            await bus.request(SUBJECTS.kvstore(NODE, "blocks_snapshot"), BlockSnapshotRequest(
                offset=7, snapshot_seq=first.seq + 5), BlockSnapshotReply)
        assert error.value.status == 400

        # a gateway started after all that learns the node from a scheduler's stats
        await feed.start()
        await gateway_bus.flush()
        feed.on_stats(stats(NODE))
        assert await until(lambda: index.is_kv_synced(NODE))
        assert metrics.routing_snapshots.labels("kv_loaded")._value.get() == 1
        expected = ["host" if h(i) in host else "disk" for i in range(24)]
        assert tiers_of(index, LAYOUT.namespace, [h(i) for i in range(24)]) == expected
        assert tiers_of(index, OTHER_NS, [h(900)]) == ["disk"]

        # then events, in step; a lost one shows as a gap and a snapshot rebuilds the node
        await store_blocks(bus, attached, [100])
        await service._publish_events()
        assert await until(lambda: tiers_of(index, LAYOUT.namespace, [h(100)]) == ["host"])
        await store_blocks(bus, attached, [101])
        service.store.collect_events(time.time())  # lost on the way
        await store_blocks(bus, attached, [102])
        await service._publish_events()
        assert await until(lambda: metrics.routing_snapshots.labels("kv_loaded")._value.get() == 2
                           and index.is_kv_synced(NODE))
        assert await until(lambda: tiers_of(index, LAYOUT.namespace, [h(101), h(102)])
                           == ["host", "host"])

        # a node whose kvstore never answers: no entries, the failure counted, no hang
        feed.on_stats(stats("nobody-home"))
        assert await until(lambda: metrics.routing_snapshots.labels("kv_failed")._value.get() == 1)
        assert not index.is_kv_synced("nobody-home")
    finally:
        stop.set()
        await running
        for task in tasks:
            task.cancel()
        await service.close()
        for b in (bus, gateway_bus, kv_bus):
            await b.close()
