"""The host tier's bookkeeping, step by step (no arena, no NATS)."""

from __future__ import annotations

import pytest

from services.kvstore.host_tier import HostTier


def h(i: int) -> bytes:
    return i.to_bytes(32, "little")


def tier(num_slots: int = 4, max_pinned: int = 4, max_reserved: int = 4) -> HostTier:
    return HostTier(num_slots, max_pinned=max_pinned, max_reserved=max_reserved)


def fill(host: HostTier, owner: str, hashes: list[int]) -> list[int]:
    slots = host.reserve(owner, len(hashes))
    assert len(slots) == len(hashes)
    host.commit(owner, [(h(i), s, [i]) for i, s in zip(hashes, slots)])
    return slots


def test_reserve_commit_index_and_events():
    host = tier()
    slots = host.reserve("w", 2)
    assert slots == [0, 1] and host.num_reserved == 2 and host.num_free == 2
    stored = host.commit("w", [(h(1), 0, [1, 2]), (h(2), 1, [3, 4])])
    assert stored == [(h(1), 0, [1, 2]), (h(2), 1, [3, 4])]
    assert host.get(h(1)).token_ids == (1, 2) and host.get(h(2)).slot_id == 1
    assert host.num_reserved == 0 and host.num_blocks == 2
    assert host.changes.take() == ([h(1), h(2)], [])
    assert host.changes.take() == ([], [])


def test_commit_of_a_held_hash_frees_the_new_slot():
    host = tier()
    fill(host, "w", [1])
    slot = host.reserve("w", 1)[0]
    assert host.commit("w", [(h(1), slot, [1])]) == []
    assert host.num_blocks == 1 and host.num_free == 3


def test_commit_ignores_slots_the_owner_does_not_hold_and_frees_returned_ones():
    host = tier()
    mine = host.reserve("a", 2)
    theirs = host.reserve("b", 1)
    assert host.commit("a", [(h(1), theirs[0], [1])], returned_slot_ids=[mine[1], 99]) == []
    assert host.get(h(1)) is None
    assert host.reserved_by("a") == {mine[0]} and host.reserved_by("b") == {theirs[0]}
    assert host.num_free == 2


def test_lru_eviction_skips_pinned_reserved_and_held_slots():
    host = tier(num_slots=4)
    fill(host, "w", [1, 2, 3, 4])
    host.touch(h(1))  # LRU order now 2, 3, 4, 1
    host.pin("p", "s", host.get(h(2)).slot_id)
    host.hold(host.get(h(3)).slot_id)
    assert host.reserve("w", 1) == [3]  # block 4 (slot 3): the oldest neither pinned nor held
    assert host.get(h(4)) is None
    assert host.changes.take()[1] == [h(4)]
    assert host.reserve("w", 1) == [0]  # then block 1 (slot 0); 2 pinned, 3 held
    assert host.reserve("w", 1) == []  # nothing left to evict
    host.unhold(2)
    assert host.reserve("w", 1) == [2]


def test_reservations_are_capped():
    host = tier(num_slots=8, max_reserved=3)
    assert len(host.reserve("a", 2)) == 2
    assert len(host.reserve("b", 5)) == 1
    assert host.reserve("a", 1) == []
    host.commit("a", [], returned_slot_ids=sorted(host.reserved_by("a")))
    assert len(host.reserve("b", 5)) == 2


def test_pins_count_per_slot_and_release_only_by_the_owner():
    host = tier()
    slots = fill(host, "w", [1, 2])
    host.pin("p1", "s", slots[0])
    host.pin("p2", "s", slots[0])
    host.pin("p2", "s", slots[1])
    assert host.num_pinned == 2 and host.pin_room() == 2
    assert host.release(["p2"], owner_id="other") == 0
    assert host.release(["p2"], owner_id="s") == 1
    assert host.is_pinned(slots[0]) and not host.is_pinned(slots[1])
    assert host.release(["p1", "gone"]) == 1 and host.num_pinned == 0


def test_pin_room_keeps_stores_working():
    host = tier(num_slots=4, max_pinned=2)
    slots = fill(host, "w", [1, 2, 3, 4])
    host.pin("p", "s", slots[0])
    host.pin("p", "s", slots[1])
    assert host.pin_room() == 0
    assert host.reserve("w", 2) == [slots[2], slots[3]]  # the unpinned half evicts


def test_drop_owner_frees_reservations_and_pins():
    host = tier()
    slots = fill(host, "w", [1])
    host.reserve("w", 2)
    host.pin("p", "s", slots[0])
    assert host.drop_owner("w") == (2, 0)
    assert host.drop_owner("s") == (0, 1)
    assert host.num_free == 3 and host.num_pinned == 0 and host.num_reserved == 0


def test_loading_slot_indexed_or_moved_or_freed():
    host = tier()
    loading = host.take_slot()
    host.pin("p", "s", loading)
    assert host.finish_load("p", h(7), loading, [7]) == loading
    assert host.get(h(7)).slot_id == loading and host.pinned_slots("p") == [loading]
    # a second load of the same block (indexed meanwhile): the pin moves, the slot is freed
    other = host.take_slot()
    host.pin("q", "s", other)
    assert host.finish_load("q", h(7), other, [7]) == loading
    assert host.pinned_slots("q") == [loading] and not host.is_pinned(other)
    free_before = host.num_free
    failed = host.take_slot()
    host.pin("r", "s", failed)
    host.fail_load("r", failed)
    assert host.num_free == free_before and not host.has_pin("r")


def test_free_slot_refuses_an_indexed_slot():
    host = tier()
    slots = fill(host, "w", [1])
    with pytest.raises(ValueError):
        host.free_slot(slots[0])
