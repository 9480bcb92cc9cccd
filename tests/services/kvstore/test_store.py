"""The kvstore's state across tiers: pins that read disk blocks into host slots, run
cuts, owner expiry, pin caps, events. A real arena file and block files; no NATS."""

from __future__ import annotations

import numpy as np
import pytest

from services.kvstore.disk_tier import DiskTier
from services.kvstore.events import MAX_HASHES_PER_EVENT, EventBatcher
from services.kvstore.owners import OwnerClock
from services.kvstore.rate import RateMeter
from services.kvstore.store import KvStore, Namespace, num_host_slots, slot_nbytes_of
from shared.kv_arena import KvArena
from shared.kv_messages import KvCommitRequest, KvLayout, KvLookupRequest, KvPinRequest

LAYOUT = KvLayout(weights_version="w", dtype="float32", num_layers=2, block_size=4,
                  num_kv_heads=1, head_dim=8)
NS = LAYOUT.namespace
SLOT = slot_nbytes_of(LAYOUT, 4)


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def make_store(tmp_path):
    arenas = []

    def make(num_slots: int = 8, disk: bool = True, pinned: float = 0.5) -> KvStore:
        store = KvStore("store1", "node", owner_timeout_s=10.0, max_pinned_fraction=pinned,
                        max_reserved_fraction=0.5,
                        disk=DiskTier(tmp_path / "disk", 1 << 20) if disk else None)
        arena = KvArena.create(tmp_path / f"arena{len(arenas)}", num_slots, SLOT, "store1")
        arenas.append(arena)
        store.add_namespace(Namespace(NS, SLOT, arena, store.new_host_tier(num_slots)))
        return store

    yield make
    for arena in arenas:
        arena.close()


def put(store: KvStore, hashes: list[int], owner: str = "w") -> None:
    """Reserve, write a recognizable pattern, commit; and write the blocks to disk."""
    ns = store.namespaces[NS]
    slots = store.reserve(NS, owner, len(hashes), now=0.0)
    assert len(slots) == len(hashes)
    for i, slot in zip(hashes, slots):
        ns.slots[slot] = i % 251
    stored = store.commit(KvCommitRequest(
        namespace=NS, owner_id=owner, store_id="store1",
        block_hashes=[h(i) for i in hashes], slot_ids=slots,
        token_ids=[i for i in hashes for _ in range(4)], block_size=4), now=0.0)
    for block_hash, slot, tokens in stored:
        if store.disk is not None:
            store.disk.write(NS, block_hash, tokens, ns.slot_view(slot))


def pin(store: KvStore, pin_id: str, hashes: list[int], owner: str = "s"):
    plan = store.begin_pin(KvPinRequest(namespace=NS, owner_id=owner, pin_id=pin_id,
                                        block_hashes=[h(i) for i in hashes]), now=0.0)
    return store.finish_pin(plan, store.read_pin(plan))


def evict_host(store: KvStore, hashes: list[int]) -> None:
    """Push blocks out of the host tier by filling it with others."""
    ns = store.namespaces[NS]
    put(store, [1000 + i for i in range(ns.host.num_slots // 2)], owner="filler")
    put(store, [2000 + i for i in range(ns.host.num_slots // 2)], owner="filler")
    assert all(ns.host.get(h(i)) is None for i in hashes)


def test_lookup_leading_run_over_tiers(make_store):
    store = make_store()
    put(store, [1, 2, 3])
    lookup = lambda hashes: store.lookup(KvLookupRequest(namespace=NS, block_hashes=[h(i) for i in hashes])).tiers
    assert lookup([1, 2, 3, 4]) == ["host"] * 3
    assert lookup([9, 1]) == []
    evict_host(store, [1, 2, 3])
    assert lookup([1, 2, 3]) == ["disk"] * 3
    assert store.lookup(KvLookupRequest(namespace="unknown", block_hashes=[h(1)])) == ([], [], [])


def lookup_pin(store: KvStore, pin_id: str, hashes: list[int], owner: str = "s", now: float = 0.0):
    return store.lookup(KvLookupRequest(namespace=NS, block_hashes=[h(i) for i in hashes],
                                        owner_id=owner, pin_id=pin_id), now)


def test_a_lookup_pins_the_leading_host_run_and_a_disk_hit_ends_it(make_store):
    store = make_store(num_slots=16)
    put(store, [1, 2, 3, 4])
    evict_host(store, [1, 2, 3, 4])
    put(store, [1, 2, 4])  # host: 1, 2, 4; disk: 1-4
    ns = store.namespaces[NS]
    tiers, slot_ids, token_ids = lookup_pin(store, "p", [1, 2, 3, 4, 5])
    assert tiers == ["host", "host", "disk", "host"]  # the whole run, as without a pin
    assert token_ids == [(1,) * 4, (2,) * 4]  # up to the disk hit
    assert slot_ids == [ns.host.get(h(i)).slot_id for i in (1, 2)]
    assert ns.host.pinned_slots("p") == slot_ids
    assert ns.host.num_pinned == 2
    # pinned as by a pin: other blocks cycle through the tier, they stay
    put(store, [3000 + i for i in range(8)], owner="filler")
    put(store, [4000 + i for i in range(8)], owner="filler")
    assert ns.host.get(h(4)) is None
    assert ns.host.get(h(1)) is not None and ns.host.get(h(2)) is not None
    assert store.release(NS, "s", ["p"], now=0.0) == 1 and ns.host.num_pinned == 0


def test_a_lookup_pins_nothing_on_a_miss_or_without_a_pin_id(make_store):
    store = make_store()
    put(store, [1, 2])
    ns = store.namespaces[NS]
    assert lookup_pin(store, "p", [9, 1]) == ([], [], [])  # a miss first: no run at all
    assert not ns.host.has_pin("p")
    for owner, pin_id in (("", "p"), ("s", "")):  # both are needed to pin
        tiers, slot_ids, _ = lookup_pin(store, pin_id, [1, 2], owner=owner)
        assert tiers == ["host", "host"] and slot_ids == []
    assert ns.host.num_pinned == 0
    tiers, slot_ids, _ = lookup_pin(store, "p", [1, 2, 3])  # the run stops at the miss
    assert tiers == ["host", "host"] and len(slot_ids) == 2


def test_a_lookup_pin_respects_the_pin_cap_and_refuses_a_pin_id_in_use(make_store):
    store = make_store(num_slots=8, pinned=0.5)  # pins hold at most 4 slots
    put(store, [1, 2, 3, 4])
    put(store, [5, 6])
    ns = store.namespaces[NS]
    assert len(lookup_pin(store, "p", [1, 2, 3]).slot_ids) == 3
    tiers, slot_ids, _ = lookup_pin(store, "q", [1, 2, 3, 4, 5, 6])
    # 1-3 are pinned already (no room needed), 4 takes the last slot of room, 5 has none
    assert tiers == ["host"] * 6 and len(slot_ids) == 4 and ns.host.num_pinned == 4
    assert lookup_pin(store, "r", [5, 6]) == (["host", "host"], [], [])
    assert not ns.host.has_pin("r")
    with pytest.raises(ValueError):
        lookup_pin(store, "p", [1])
    assert store.release(NS, "s", ["p", "q"], now=0.0) == 2 and ns.host.num_pinned == 0
    assert len(lookup_pin(store, "r", [5, 6]).slot_ids) == 2


def test_a_pinning_lookup_keeps_its_owner_alive(make_store):
    store = make_store()
    put(store, [1])
    lookup_pin(store, "p", [1], owner="sched", now=8.0)
    assert "sched" not in store.expire_owners(now=12.0)
    assert store.expire_owners(now=19.0) == {"sched": (0, 1)}
    assert store.namespaces[NS].host.num_pinned == 0


def test_commit_for_another_store_is_ignored(make_store):
    store = make_store()
    slots = store.reserve(NS, "w", 1, now=0.0)
    assert store.commit(KvCommitRequest(namespace=NS, owner_id="w", store_id="old",
                                        block_hashes=[h(1)], slot_ids=slots, token_ids=[1],
                                        block_size=1), 0.0) == []


def test_a_commits_columns_index_each_block_and_return_the_unused_slots(make_store):
    """Block i of the columns is (block_hashes[i], slot_ids[i], its block_size token ids);
    columns that do not line up are refused whole."""
    store = make_store(num_slots=16)
    slots = store.reserve(NS, "w", 4, now=0.0)
    tokens = list(range(100, 112))
    stored = store.commit(KvCommitRequest(
        namespace=NS, owner_id="w", store_id="store1",
        block_hashes=[h(1), h(2), h(3)], slot_ids=slots[:3], token_ids=tokens, block_size=4,
        returned_slot_ids=[slots[3]]), 0.0)
    assert stored == [(h(1), slots[0], (100, 101, 102, 103)),
                      (h(2), slots[1], (104, 105, 106, 107)),
                      (h(3), slots[2], (108, 109, 110, 111))]
    host = store.namespaces[NS].host
    assert host.get(h(2)).token_ids == (104, 105, 106, 107) and host.num_reserved == 0
    slots = store.reserve(NS, "w", 2, now=0.0)
    for bad in (dict(token_ids=tokens[:7]), dict(slot_ids=slots[:1]), dict(block_size=0)):
        columns = dict(block_hashes=[h(5), h(6)], slot_ids=slots, token_ids=tokens[:8],
                       block_size=4) | bad
        with pytest.raises(ValueError):
            store.commit(KvCommitRequest(namespace=NS, owner_id="w", store_id="store1",
                                         **columns), 0.0)
    assert host.get(h(5)) is None and host.num_reserved == 2


def test_pin_reads_disk_hits_into_host_slots(make_store):
    store = make_store()
    put(store, [1, 2, 3])
    evict_host(store, [1, 2, 3])
    put(store, [1])  # block 1 back on host; 2 and 3 only on disk
    ns = store.namespaces[NS]
    reply = pin(store, "p", [1, 2, 3, 4])
    assert reply.tiers == ["host", "disk", "disk"]
    assert [list(tokens) for tokens in reply.token_ids] == [[1] * 4, [2] * 4, [3] * 4]
    for i, slot in zip([1, 2, 3], reply.slot_ids):
        assert (ns.slots[slot] == i).all()
        assert ns.host.is_pinned(slot) and ns.host.get(h(i)).slot_id == slot
    assert ns.host.release(["p"], "s") == 1 and ns.host.num_pinned == 0


def test_a_corrupt_disk_block_cuts_the_run_and_frees_its_slot(make_store):
    store = make_store()
    put(store, [1, 2, 3])
    evict_host(store, [1, 2, 3])
    path = store.disk.path_of(NS, h(2))
    data = bytearray(path.read_bytes())
    data[200] ^= 0x10
    path.write_bytes(bytes(data))
    ns = store.namespaces[NS]
    reply = pin(store, "p", [1, 2, 3])
    assert reply.tiers == ["disk"] and len(reply.slot_ids) == 1
    assert not path.exists() and not store.disk.contains(NS, h(2))
    assert ns.host.num_pinned == 1 and ns.host.pinned_slots("p") == reply.slot_ids
    # reads stop at the first failure: block 3 was not read, and its slot is free again
    assert ns.host.get(h(3)) is None
    assert ns.host.num_free + ns.host.num_blocks + ns.host.num_reserved == ns.host.num_slots


def test_pins_are_capped_to_keep_stores_working(make_store):
    store = make_store(num_slots=8, pinned=0.5)
    put(store, [1, 2, 3, 4])
    assert len(pin(store, "p", [1, 2, 3]).slot_ids) == 3
    assert len(pin(store, "q", [1, 2, 3, 4]).slot_ids) == 4  # 1-3 already pinned: no room needed
    put(store, [5, 6])
    assert pin(store, "r", [5, 6]).slot_ids == []  # the cap (4 slots) is reached
    assert len(store.reserve(NS, "w", 4, now=0.0)) == 4  # stores still get slots
    with pytest.raises(ValueError):
        pin(store, "p", [1])


def test_pin_released_during_the_read_leaves_the_block_indexed_unpinned(make_store):
    store = make_store()
    put(store, [1])
    evict_host(store, [1])
    plan = store.begin_pin(KvPinRequest(namespace=NS, owner_id="s", pin_id="p",
                                        block_hashes=[h(1)]), now=0.0)
    read = store.read_pin(plan)
    assert store.release(NS, "s", ["p"], now=0.0) == 1
    reply = store.finish_pin(plan, read)
    ns = store.namespaces[NS]
    assert ns.host.get(h(1)).slot_id == reply.slot_ids[0]
    assert ns.host.num_pinned == 0


def test_silent_owners_lose_pins_and_reservations(make_store):
    store = make_store()
    put(store, [1, 2])
    pin(store, "p", [1, 2], owner="sched")
    store.reserve(NS, "worker", 2, now=0.0)
    store.keepalive("sched", now=5.0)
    assert store.expire_owners(now=12.0) == {"w": (0, 0), "worker": (2, 0)}
    ns = store.namespaces[NS]
    assert ns.host.num_reserved == 0 and ns.host.num_pinned == 2
    assert store.expire_owners(now=16.0) == {"sched": (0, 1)}
    assert ns.host.num_pinned == 0


def test_events_report_both_tiers_with_counting_seq(make_store):
    store = make_store()
    put(store, [1, 2])
    events = store.collect_events(now=1.0)
    assert [(e.tier, e.seq, e.stored_hashes) for e in events] == [
        ("host", 1, [h(1), h(2)]), ("disk", 2, [h(1), h(2)])]
    assert store.collect_events(now=2.0) == []


def test_event_batcher_keeps_the_last_change_and_splits_big_batches():
    batcher = EventBatcher("s", "n")
    batcher.add("ns", "host", stored=[h(1), h(2)], removed=[h(1)])
    batcher.add("ns", "host", stored=[h(1)])
    batcher.add("ns", "host", removed=[h(2)])
    (event,) = batcher.flush(now=1.0)
    assert (event.stored_hashes, event.removed_hashes, event.seq) == ([h(1)], [h(2)], 1)
    batcher.add("ns", "disk", stored=[h(i) for i in range(MAX_HASHES_PER_EVENT + 1)])
    assert [len(e.stored_hashes) for e in batcher.flush(now=2.0)] == [MAX_HASHES_PER_EVENT, 1]
    assert batcher.seq == 3


def test_owner_clock_and_rate_meter():
    clock = OwnerClock(timeout_s=2.0)
    clock.touch("a", 0.0)
    clock.touch("b", 1.5)
    assert clock.expire(2.5) == ["a"] and "b" in clock and len(clock) == 1
    meter = RateMeter(decay=0.5)
    assert meter.bytes_per_s == 0.0
    meter.record(1000, 1.0)
    meter.record(3000, 1.0)
    assert meter.bytes_per_s == pytest.approx((500 + 3000) / 1.5)


def test_host_slots_fit_the_shared_memory():
    assert num_host_slots(1 << 30, 1 << 20, None) == 1024
    assert num_host_slots(1 << 30, 1 << 20, 100 << 20) == 90
    assert num_host_slots(1 << 10, 1 << 20, None) == 0
    with pytest.raises(ValueError):
        slot_nbytes_of(LAYOUT, 0)
