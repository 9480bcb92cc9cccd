"""The block index kept over a real nats-server: a scheduler's event publisher (with a
real block manager) on one bus, the gateway's feed and index on another. A gateway that
joins late, or misses an event, rebuilds that scheduler's entries from a paged snapshot
and then follows its events; a scheduler that does not answer leaves no entries."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from services.gateway.block_feed import BlockFeed
from services.gateway.block_index import BlockIndex, block_key
from services.gateway.metrics import GatewayMetrics
from services.scheduler import block_events
from services.scheduler.block_events import BlockEventPublisher
from services.scheduler.block_manager import BlockManager
from shared.bus import Bus
from shared.scheduler_stats import RoutingStats, SchedulerStats
from shared.subjects import Subjects
from tests.nats_server import started_nats_server

pytestmark = pytest.mark.integration

SUBJECTS = Subjects(namespace="feedtest")


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory):
    server = started_nats_server(tmp_path_factory.mktemp("nats") / "nats.log")
    yield server.url
    server.stop()


def cache(manager: BlockManager, first: int, count: int) -> None:
    block_ids = manager.allocate(count)
    for offset, block_id in enumerate(block_ids):
        manager.cache_block(block_id, hashlib.sha256(b"%d" % (first + offset)).digest(), [block_id])
    manager.free(block_ids)


def stats(scheduler_id: str, block_event_seq: int) -> SchedulerStats:
    return SchedulerStats(scheduler_id=scheduler_id, replica_id="0", timestamp=0.0,
                          routing=RoutingStats(block_event_seq=block_event_seq))


def mirrors(index: BlockIndex, scheduler_id: str, manager: BlockManager) -> bool:
    """The index holds exactly the manager's cached blocks for this scheduler."""
    held = manager.cached_hashes()
    return index.is_synced(scheduler_id) and index.num_gpu_blocks() == len(held) and all(
        index.gpu_prefix_blocks([scheduler_id], [block_key(h)])[scheduler_id] == 1 for h in held)


async def eventually(condition, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.02)
    return False


def test_a_late_joiner_and_a_missed_event_rebuild_from_a_paged_snapshot(nats_url, monkeypatch):
    monkeypatch.setattr(block_events, "MAX_HASHES_PER_PAGE", 10)

    async def scenario() -> None:
        scheduler_bus = await Bus.connect(nats_url, name="scheduler")
        gateway_bus = await Bus.connect(nats_url, name="gateway")
        manager = BlockManager(num_blocks=64, block_size=4)
        publisher = BlockEventPublisher(scheduler_bus, SUBJECTS, "s1", "0", lambda: manager)
        await publisher.start()
        await scheduler_bus.flush()  # its snapshot handler answers from now on
        cache(manager, 0, 25)
        # events made before the gateway listens, never seen by it (publishing them here
        # raced the subscription below: 2 runs in 15 delivered them and no snapshot came)
        publisher.collect(time.time())
        index, metrics, tasks = BlockIndex(), GatewayMetrics(), set()
        feed = BlockFeed(gateway_bus, SUBJECTS, index, metrics,
                         lambda coro: tasks.add(asyncio.create_task(coro)))
        await feed.start()
        await gateway_bus.flush()
        publishing = asyncio.create_task(publisher.run())
        try:
            feed.on_stats(stats("s1", publisher.seq))  # joined late: events are out
            assert await eventually(lambda: mirrors(index, "s1", manager)), "no snapshot"
            assert metrics.routing_snapshots.labels("loaded")._value.get() == 1
            cache(manager, 100, 10)  # then events, in order
            manager.allocate(30)  # evicts some
            assert await eventually(lambda: mirrors(index, "s1", manager))
            cache(manager, 200, 5)
            publisher.collect(time.time())  # an event lost on the way
            cache(manager, 300, 3)  # the next one shows the gap: a snapshot again
            assert await eventually(lambda: mirrors(index, "s1", manager)
                                    and metrics.routing_snapshots.labels("loaded")._value.get() == 2)
            # a scheduler that never answers: no entries, the failure counted
            feed.on_stats(stats("gone", 5))
            assert await eventually(
                lambda: metrics.routing_snapshots.labels("failed")._value.get() == 1, 10)
            assert not index.is_synced("gone")
        finally:
            publishing.cancel()
            for task in tasks:
                task.cancel()
            await scheduler_bus.close()
            await gateway_bus.close()

    asyncio.run(scenario())
