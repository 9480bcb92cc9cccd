"""The GPU tier's block events for the gateways' routing: the block manager's journal
(cached, evicted), the events made from it (numbered, batched, a replaced core's blocks
removed), the snapshot and its pages, and the stats fields the gateway prices by."""

from __future__ import annotations

import pytest

from services.scheduler import block_events
from services.scheduler.block_events import BlockEventPublisher, routing_stats
from services.scheduler.block_manager import BlockManager
from services.scheduler.kv_connector import NoKvConnector
from services.scheduler.scheduler import Scheduler
from services.scheduler.tiering import TierSpeeds
from shared.errors import InvalidRequest
from shared.messages import WorkerInfo
from shared.prefix_hash import extra_keys, usable_block_hashes
from shared.scheduler_stats import RoutingStats
from tests.services.scheduler.test_scheduler import (
    BLOCK_SIZE, FakeWorker, make_scheduler, request, run_to_completion,
)


def h(index: int) -> bytes:
    return index.to_bytes(32, "big")


def cache(manager: BlockManager, hashes: list[bytes]) -> list[int]:
    """Allocate a block per hash, cache it, free it (cached, evictable)."""
    block_ids = manager.allocate(len(hashes))
    for block_id, block_hash in zip(block_ids, hashes):
        manager.cache_block(block_id, block_hash, [block_id] * manager.block_size)
    manager.free(block_ids)
    return block_ids


def test_the_journal_records_cached_and_evicted_hashes():
    manager = BlockManager(num_blocks=4, block_size=4)
    cache(manager, [h(1)])
    assert manager.take_journal() == ([], [])  # kept only once asked for
    manager.keep_journal()
    cache(manager, [h(2), h(3), h(4)])
    assert manager.take_journal() == ([h(2), h(3), h(4)], [])
    assert manager.take_journal() == ([], [])  # drained
    manager.allocate(2)  # evicts the least recently freed: h(1), then h(4) (freed in reverse)
    assert manager.take_journal() == ([], [h(1), h(4)])
    assert sorted(manager.cached_hashes()) == [h(2), h(3)]


def test_the_last_change_of_a_hash_wins():
    manager = BlockManager(num_blocks=1, block_size=4)
    manager.keep_journal()
    cache(manager, [h(1)])
    cache(manager, [h(2)])  # evicts h(1)
    assert manager.take_journal() == ([h(2)], [h(1)])
    cache(manager, [h(1)])  # evicts h(2), then h(1) is findable again
    cache(manager, [h(2)])
    cache(manager, [h(1)])
    assert manager.take_journal() == ([h(1)], [h(2)])


def publisher(current) -> BlockEventPublisher:
    return BlockEventPublisher(bus=None, subjects=None, scheduler_id="s1", replica_id="0",
                               current_manager=current)


def test_events_count_up_from_one_and_carry_at_most_max_hashes(monkeypatch):
    monkeypatch.setattr(block_events, "MAX_HASHES_PER_EVENT", 3)
    manager = BlockManager(num_blocks=8, block_size=4)
    events = publisher(lambda: manager)
    assert events.collect(1.0) == [] and events.seq == 0  # an empty cache: nothing to say
    cache(manager, [h(i) for i in range(1, 8)])
    made = events.collect(2.0)
    assert [e.seq for e in made] == [1, 2, 3]
    assert [h_ for e in made for h_ in e.stored_hashes] == [h(i) for i in range(1, 8)]
    assert all(len(e.stored_hashes) <= 3 and e.scheduler_id == "s1" for e in made)
    assert events.collect(3.0) == []  # nothing changed
    manager.allocate(3)  # the free block, then two cached ones
    (evicted,) = events.collect(4.0)
    assert evicted.seq == 4 and len(evicted.removed_hashes) == 2 and not evicted.stored_hashes


def test_a_replaced_core_removes_everything_it_held():
    """The worker re-attached: the new core's cache is empty, and the gateways must not
    count the old one's blocks for this replica any more."""
    old, new = BlockManager(num_blocks=8, block_size=4), BlockManager(num_blocks=8, block_size=4)
    current = {"manager": old}
    events = publisher(lambda: current["manager"])
    cache(old, [h(1), h(2)])
    events.collect(1.0)
    old.allocate(1)  # h(2) evicted, not published yet
    cache(old, [h(3)])
    current["manager"] = BlockManager(num_blocks=0, block_size=0)  # the core without a worker
    (gone,) = events.collect(2.0)
    assert sorted(gone.removed_hashes) == [h(1), h(2), h(3)] and not gone.stored_hashes
    current["manager"] = new
    cache(new, [h(4)])  # cached before the publisher looked: announced all the same
    (fresh,) = events.collect(3.0)
    assert fresh.stored_hashes == [h(4)] and fresh.seq == gone.seq + 1


def test_a_snapshot_is_the_state_after_its_seq_and_pages(monkeypatch):
    monkeypatch.setattr(block_events, "MAX_HASHES_PER_PAGE", 2)
    manager = BlockManager(num_blocks=8, block_size=4)
    events = publisher(lambda: manager)
    cache(manager, [h(1), h(2), h(3)])
    made = events.collect(1.0)  # what the snapshot request publishes first
    events.take_snapshot(now=10.0)
    cache(manager, [h(4)])  # later: in the next event, not in this snapshot
    first = events.page(events.seq, 0, now=10.0)
    assert first.seq == made[-1].seq and first.num_hashes == 3 and first.source_id == "s1"
    second = events.page(first.seq, 2, now=11.0)
    pages = first.parts[0].block_hashes + second.parts[0].block_hashes
    assert sorted(pages) == [h(1), h(2), h(3)] and first.parts[0].tier == "gpu"
    assert events.page(first.seq, 4, now=11.0).parts[0].block_hashes == []
    with pytest.raises(InvalidRequest):  # expired: the reader starts over
        events.page(first.seq, 2, now=10.0 + block_events.SNAPSHOT_TTL_S)
    with pytest.raises(InvalidRequest):
        events.page(99, 0, now=11.0)


def test_the_events_carry_the_hashes_the_gateway_computes_from_a_prompt():
    """One spec: the scheduler's cached blocks of a prompt are the keys the gateway
    derives from the same token ids, model name and salt (shared/prefix_hash.py)."""
    scheduler = make_scheduler()
    events = publisher(lambda: scheduler.block_manager)
    events.collect(0.0)
    prompt = list(range(100, 100 + 5 * BLOCK_SIZE + 2))
    scheduler.add_request(request("r1", 0, 1, prompt=prompt, cache_salt="tenant-a"))
    run_to_completion(scheduler, FakeWorker(64))
    stored = {block_hash for event in events.collect(1.0) for block_hash in event.stored_hashes}
    expected = usable_block_hashes(prompt, BLOCK_SIZE, extra_keys("m", "tenant-a"))
    assert len(expected) == 5 and set(expected) <= stored


def test_routing_stats_count_queued_prefill_and_name_the_keys():
    scheduler = make_scheduler(max_num_batched_tokens=8)
    scheduler.add_request(request("a", 20, 4))
    scheduler.add_request(request("b", 30, 4))
    scheduler.schedule()  # 8 tokens of "a" computed or computing
    info = WorkerInfo(worker_id="w", replica_id="0", model_name="m", num_blocks=64,
                      block_size=BLOCK_SIZE, max_model_len=512, eos_token_ids=[0],
                      kv_cache_bytes=64 * 1000, device="cpu", dtype="float32")
    speeds = TierSpeeds(prefill_tokens_per_s=500.0)
    routing = routing_stats(scheduler, speeds, info, NoKvConnector(), block_event_seq=7)
    assert routing == RoutingStats(  # the kvstore's keys are the KV connector's: none here
        block_size=BLOCK_SIZE, model_name="m", num_queued_prefill_tokens=(20 - 8) + 30,
        prefill_tokens_per_s=500.0, host_load_bytes_per_s=0.0, disk_read_bytes_per_s=0.0,
        block_bytes=1000, block_event_seq=7,
        decode_seq_cost_tokens=0.0)  # no decode steps seen yet
    without_worker = Scheduler.without_worker(scheduler.config, NoKvConnector())
    assert routing_stats(without_worker, TierSpeeds(), None, NoKvConnector(), 0) == RoutingStats()
