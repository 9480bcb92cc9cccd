"""The gateway's block index driven by events alone: leading runs only, per-scheduler
seq (a gap or a late join asks for a snapshot, events meanwhile held and applied on
top), a dropped or restarted scheduler's entries gone for good, and the kvstore's host
and disk tiers per node (a gap or a late join asks for the kvstore's snapshot, the same
way; a restart drops the old store's entries)."""

from __future__ import annotations

from services.gateway.block_index import SNAPSHOT_RETRY_S, BlockIndex, block_key
from shared.messages import BlockSnapshotPart, SchedulerBlockEvent
from shared.kv_messages import KvBlockEvent


def h(index: int) -> bytes:
    return index.to_bytes(8, "little") + bytes(24)


def keys(*indexes: int) -> list[int]:
    return [block_key(h(i)) for i in indexes]


def event(scheduler_id: str, seq: int, stored=(), removed=()) -> SchedulerBlockEvent:
    return SchedulerBlockEvent(scheduler_id=scheduler_id, replica_id="0", seq=seq,
                               stored_hashes=[h(i) for i in stored],
                               removed_hashes=[h(i) for i in removed])


def kv_event(seq: int, tier: str, stored=(), removed=(), store_id="k1", node="n1",
             namespace="ns") -> KvBlockEvent:
    return KvBlockEvent(store_id=store_id, node_id=node, namespace=namespace, seq=seq, tier=tier,
                        stored_hashes=[h(i) for i in stored], removed_hashes=[h(i) for i in removed])


def test_hits_count_only_as_a_leading_run():
    index = BlockIndex()
    assert not index.on_scheduler_event(event("a", 1, stored=[1, 2, 4]), now=0.0)
    assert not index.on_scheduler_event(event("b", 1, stored=[1, 2, 3, 4]), now=0.0)
    runs = index.gpu_prefix_blocks(["a", "b", "unknown"], keys(1, 2, 3, 4))
    assert runs == {"a": 2, "b": 4, "unknown": 0}
    index.on_scheduler_event(event("b", 2, removed=[1]), now=0.0)  # its first block evicted
    assert index.gpu_prefix_blocks(["a", "b"], keys(1, 2, 3, 4)) == {"a": 2, "b": 0}
    assert index.gpu_prefix_blocks(["a"], []) == {"a": 0}


def test_a_seq_gap_asks_for_a_snapshot_and_events_meanwhile_apply_on_top():
    index = BlockIndex()
    index.on_scheduler_event(event("a", 1, stored=[1, 2]), now=0.0)
    assert index.on_scheduler_event(event("a", 3, stored=[9]), now=1.0)  # 2 was missed
    assert index.gpu_prefix_blocks(["a"], keys(1, 2)) == {"a": 0}  # nothing counted meanwhile
    assert not index.is_synced("a")
    index.on_scheduler_event(event("a", 5, stored=[3]), now=1.1)  # held while fetching
    index.on_scheduler_event(event("a", 4, removed=[2]), now=1.1)  # out of order: sorted
    index.load_snapshot("a", 3, [h(1), h(2), h(9)], now=1.2)  # current after event 3
    assert index.is_synced("a")
    assert index.gpu_prefix_blocks(["a"], keys(1, 2)) == {"a": 1}  # event 4 removed 2
    assert index.gpu_prefix_blocks(["a"], keys(9)) == {"a": 1}
    assert index.gpu_prefix_blocks(["a"], keys(3)) == {"a": 1}  # event 5 stored it
    index.on_scheduler_event(event("a", 6, stored=[2]), now=2.0)  # in step again
    assert index.gpu_prefix_blocks(["a"], keys(1, 2, 3)) == {"a": 3}


def test_a_gap_among_the_held_events_leaves_it_out_of_step():
    index = BlockIndex()
    index.on_scheduler_event(event("a", 1, stored=[1]), now=0.0)
    assert index.on_scheduler_event(event("a", 4, stored=[2]), now=0.0)
    index.on_scheduler_event(event("a", 7, stored=[3]), now=0.0)
    index.load_snapshot("a", 4, [h(1), h(2)], now=0.0)  # 5 and 6 never came
    assert not index.is_synced("a") and index.gpu_prefix_blocks(["a"], keys(1)) == {"a": 0}
    assert index.on_scheduler_event(event("a", 8), now=0.1)  # asks again at once


def test_a_late_joiner_takes_a_snapshot_of_a_scheduler_with_events_out():
    index = BlockIndex()
    assert not index.on_scheduler_stats("fresh", block_event_seq=0, now=0.0)  # nothing out yet
    assert index.is_synced("fresh")
    index.on_scheduler_event(event("fresh", 1, stored=[1]), now=0.0)
    assert index.gpu_prefix_blocks(["fresh"], keys(1)) == {"fresh": 1}
    assert index.on_scheduler_stats("busy", block_event_seq=40, now=0.0)
    assert not index.on_scheduler_stats("busy", block_event_seq=41, now=0.1)  # under way
    index.load_snapshot("busy", 41, [h(5)], now=0.2)
    assert index.gpu_prefix_blocks(["busy"], keys(5)) == {"busy": 1}
    assert not index.on_scheduler_stats("busy", block_event_seq=41, now=0.3)
    # an event past 1 from a scheduler never heard of: joined late, too
    assert index.on_scheduler_event(event("other", 7, stored=[1]), now=0.0)


def test_a_failed_snapshot_leaves_no_entries_and_is_retried_later():
    index = BlockIndex()
    index.on_scheduler_event(event("a", 1, stored=[1]), now=0.0)
    assert index.on_scheduler_event(event("a", 3, stored=[2]), now=10.0)
    index.snapshot_failed("a", now=10.5)
    assert index.gpu_prefix_blocks(["a"], keys(1)) == {"a": 0}  # routing falls back to load
    assert not index.on_scheduler_event(event("a", 4, stored=[3]), now=11.0)
    assert not index.on_scheduler_stats("a", 4, now=11.0)
    assert index.on_scheduler_stats("a", 4, now=10.5 + SNAPSHOT_RETRY_S)
    index.load_snapshot("a", 4, [h(1), h(2), h(3)], now=16.0)
    assert index.gpu_prefix_blocks(["a"], keys(1, 2, 3)) == {"a": 3}


def test_a_dropped_scheduler_keeps_no_entries_and_its_late_events_are_ignored():
    """A replica restarted: its old scheduler id is dropped; the new id (its epoch)
    starts empty, even on the old one's reused bit."""
    index = BlockIndex()
    index.on_scheduler_event(event("old", 1, stored=[1, 2]), now=0.0)
    index.on_scheduler_event(event("other", 1, stored=[1, 2]), now=0.0)
    index.drop_scheduler("old")
    assert not index.on_scheduler_event(event("old", 2, stored=[3]), now=0.1)
    index.on_scheduler_event(event("new", 1, stored=[7]), now=0.2)
    assert index.gpu_prefix_blocks(["old", "new", "other"], keys(1, 2)) == \
        {"old": 0, "new": 0, "other": 2}
    assert index.gpu_prefix_blocks(["new"], keys(7)) == {"new": 1}
    index.drop_scheduler("other")
    assert index.num_gpu_blocks() == 1  # only "new"'s block is left


def test_a_dropped_scheduler_heard_again_is_rebuilt_from_a_snapshot():
    """Dropped for a lost heartbeat, yet alive: its stats ask for a snapshot."""
    index = BlockIndex()
    index.on_scheduler_event(event("a", 1, stored=[1]), now=0.0)
    index.drop_scheduler("a")
    assert index.on_scheduler_stats("a", block_event_seq=1, now=1.0)
    index.load_snapshot("a", 1, [h(1)], now=1.1)
    assert index.gpu_prefix_blocks(["a"], keys(1)) == {"a": 1}


def test_our_own_link_drop_resyncs_every_source():
    index = BlockIndex()
    index.on_scheduler_event(event("a", 1, stored=[1]), now=0.0)
    index.on_kv_event(kv_event(1, "host", stored=[1]))
    index.resync_all()
    assert index.gpu_prefix_blocks(["a"], keys(1)) == {"a": 0}
    assert index.tier_run("n1", "ns", keys(1), 0) == []
    assert index.on_scheduler_stats("a", 1, now=0.0)
    assert index.on_kv_node_seen("n1", now=0.0)  # the kvstore's snapshot too
    # a snapshot under way when the link dropped may miss what was lost: loaded, then asked again
    index.resync_all()
    index.load_kv_snapshot("n1", "k1", "k1", 1, [BlockSnapshotPart(tier="host", namespace="ns",
                                                                   block_hashes=[h(1)])], now=1.0)
    assert not index.is_kv_synced("n1") and index.tier_run("n1", "ns", keys(1), 0) == []
    assert index.on_kv_node_seen("n1", now=1.0)


def test_kvstore_tiers_per_node_host_before_disk_as_a_leading_run():
    index = BlockIndex()
    index.on_kv_event(kv_event(1, "disk", stored=[1, 2, 3, 5]))
    index.on_kv_event(kv_event(2, "host", stored=[2]))
    assert index.tier_run("n1", "ns", keys(1, 2, 3, 4, 5), 0) == ["disk", "host", "disk"]
    assert index.tier_run("n1", "ns", keys(1, 2, 3), 1) == ["host", "disk"]  # after a GPU run
    assert index.tier_run("n1", "other-ns", keys(1), 0) == []
    assert index.tier_run("n2", "ns", keys(1), 0) == []
    index.on_kv_event(kv_event(3, "host", removed=[2]))
    index.on_kv_event(kv_event(4, "disk", removed=[1]))
    assert index.tier_run("n1", "ns", keys(2, 3), 0) == ["disk", "disk"]
    assert index.tier_run("n1", "ns", keys(1, 2), 0) == []


def part(tier: str, *indexes: int, namespace: str = "ns") -> BlockSnapshotPart:
    return BlockSnapshotPart(namespace=namespace, tier=tier, block_hashes=[h(i) for i in indexes])


def test_a_kvstore_gap_empties_the_node_asks_a_snapshot_and_applies_held_events_on_top():
    index = BlockIndex()
    assert index.on_kv_event(kv_event(1, "host", stored=[1]), now=0.0) == ("", False)
    assert index.on_kv_event(kv_event(2, "host", stored=[2]), now=0.0) == ("", False)
    assert index.tier_run("n1", "ns", keys(1, 2), 0) == ["host", "host"]
    assert index.on_kv_event(kv_event(5, "host", stored=[3]), now=0.0) == ("gap", True)  # 3, 4
    assert index.tier_run("n1", "ns", keys(1), 0) == [] and not index.is_kv_synced("n1")
    # held while the snapshot is fetched: one it covers, two after it (one repeated)
    assert index.on_kv_event(kv_event(7, "disk", stored=[9]), now=0.1) == ("", False)
    assert index.on_kv_event(kv_event(6, "host", removed=[2]), now=0.1) == ("", False)
    assert index.on_kv_event(kv_event(7, "disk", stored=[9]), now=0.1) == ("", False)
    assert index.tier_run("n1", "ns", keys(9), 0) == []  # held, not applied yet
    # the state after seq 5: 1, 2, 3 on the host, 1 on disk too, one block in another namespace
    assert index.kv_store_id("n1") == "k1"
    assert index.load_kv_snapshot("n1", "k1", "k1", 5, [
        part("host", 1, 2, 3), part("disk", 1), part("disk", 8, namespace="other")], now=0.2)
    assert index.is_kv_synced("n1")
    assert index.tier_run("n1", "ns", keys(1, 3, 9), 0) == ["host", "host", "disk"]
    assert index.tier_run("n1", "ns", keys(2), 0) == []  # removed by the held seq 6
    assert index.tier_run("n1", "other", keys(8), 0) == ["disk"]
    assert index.on_kv_event(kv_event(8, "host", stored=[4]), now=0.3) == ("", False)
    assert index.tier_run("n1", "ns", keys(4), 0) == ["host"]  # then events, in step


def test_a_late_joiner_asks_the_kvstore_for_a_snapshot_from_an_event_or_a_schedulers_stats():
    index = BlockIndex()
    assert index.on_kv_event(kv_event(5, "host", stored=[1]), now=0.0) == ("late", True)
    assert index.tier_run("n1", "ns", keys(1), 0) == []  # held until the snapshot
    index.load_kv_snapshot("n1", "k1", "k1", 4, [part("host", 7)], now=0.1)
    assert index.tier_run("n1", "ns", keys(7, 1), 0) == ["host", "host"]
    assert not index.on_kv_node_seen("n1", now=0.2)  # known and in step: nothing to ask
    # a node known only from a scheduler's stats (its kvstore quiet since this gateway
    # started): its snapshot names the store, whose later events follow
    assert index.on_kv_node_seen("n2", now=0.0)
    assert not index.on_kv_node_seen("n2", now=0.1)  # under way already
    assert index.kv_store_id("n2") == ""
    held = kv_event(4, "host", stored=[3], store_id="k9", node="n2")
    assert index.on_kv_event(held, now=0.1) == ("", False)
    assert index.load_kv_snapshot("n2", "", "k9", 3, [part("disk", 1, 2)], now=0.2)
    assert index.kv_store_id("n2") == "k9"
    assert index.tier_run("n2", "ns", keys(1, 2, 3), 0) == ["disk", "disk", "host"]


def test_a_failed_kvstore_snapshot_leaves_the_node_empty_and_is_asked_again_later():
    index = BlockIndex()
    index.on_kv_event(kv_event(1, "host", stored=[1]), now=0.0)
    assert index.on_kv_event(kv_event(3, "host", stored=[2]), now=0.0).fetch
    index.kv_snapshot_failed("n1", "k1", now=1.0)
    assert index.tier_run("n1", "ns", keys(1), 0) == [] and not index.is_kv_synced("n1")
    assert index.on_kv_event(kv_event(4, "host", stored=[3]), now=1.1) == ("", False)  # too soon
    assert not index.on_kv_node_seen("n1", now=1.0 + SNAPSHOT_RETRY_S - 0.1)
    assert index.tier_run("n1", "ns", keys(3), 0) == []  # never applied out of step
    assert index.on_kv_node_seen("n1", now=1.0 + SNAPSHOT_RETRY_S)  # stats ask again
    index.load_kv_snapshot("n1", "k1", "k1", 4, [part("host", 1, 2, 3)], now=7.0)
    assert index.tier_run("n1", "ns", keys(1, 2, 3), 0) == ["host"] * 3
    # an unknown node whose kvstore is dead: failed, then a first event waits out the delay
    assert index.on_kv_node_seen("n2", now=0.0)
    index.kv_snapshot_failed("n2", "", now=0.0)
    assert index.on_kv_event(kv_event(2, "host", stored=[1], node="n2"), now=1.0) == ("late", False)
    assert index.on_kv_event(kv_event(3, "host", stored=[1], node="n2"),
                             now=SNAPSHOT_RETRY_S) == ("", True)


def test_a_gap_among_the_held_events_or_too_many_leaves_the_node_out_of_step():
    from services.gateway.block_index import MAX_HELD_EVENTS

    index = BlockIndex()
    assert index.on_kv_event(kv_event(3, "host", stored=[1]), now=0.0).fetch
    index.on_kv_event(kv_event(6, "host", stored=[2]), now=0.0)  # 5 never comes
    index.load_kv_snapshot("n1", "k1", "k1", 3, [part("host", 1)], now=1.0)
    assert index.tier_run("n1", "ns", keys(1), 0) == [] and not index.is_kv_synced("n1")
    assert index.on_kv_event(kv_event(7, "host"), now=1.0).fetch  # asks again at once
    for seq in range(8, 8 + MAX_HELD_EVENTS + 1):
        index.on_kv_event(kv_event(seq, "host", stored=[seq]), now=1.0)
    index.load_kv_snapshot("n1", "k1", "k1", 7, [part("host", 1)], now=2.0)
    assert not index.is_kv_synced("n1") and index.num_tier_blocks() == 0


def test_a_restarted_kvstore_drops_the_old_ones_entries_its_late_events_and_its_snapshot():
    index = BlockIndex()
    index.on_kv_event(kv_event(1, "host", stored=[1]), now=0.0)
    assert index.on_kv_event(kv_event(4, "host", stored=[2]), now=0.0) == ("gap", True)
    assert index.on_kv_event(kv_event(1, "disk", stored=[4], store_id="k2"),
                             now=0.1) == ("restart", False)
    assert index.tier_run("n1", "ns", keys(4), 0) == ["disk"]
    # the old store's snapshot, asked before the restart, comes late: ignored
    assert not index.load_kv_snapshot("n1", "k1", "k1", 4, [part("host", 1, 2, 3)], now=0.2)
    assert index.tier_run("n1", "ns", keys(1), 0) == []
    assert index.on_kv_event(kv_event(5, "host", stored=[1]), now=0.3) == ("", False)  # k1's
    assert index.tier_run("n1", "ns", keys(1), 0) == [] and index.kv_store_id("n1") == "k2"
    assert index.on_kv_event(kv_event(1, "disk", stored=[4], store_id="k2")) == ("", False)
    assert index.num_tier_blocks() == 1
    # a snapshot answered by a newer store than asked (restarted, no event yet) replaces it
    assert index.on_kv_event(kv_event(3, "host", stored=[5], store_id="k2"), now=1.0).fetch
    index.on_kv_event(kv_event(9, "host", stored=[6], store_id="k2"), now=1.0)  # held, k2's
    assert index.load_kv_snapshot("n1", "k2", "k3", 2, [part("host", 7)], now=1.1)
    assert index.kv_store_id("n1") == "k3" and index.is_kv_synced("n1")
    assert index.tier_run("n1", "ns", keys(7), 0) == ["host"]
    assert index.tier_run("n1", "ns", keys(4), 0) == index.tier_run("n1", "ns", keys(6), 0) == []
    assert index.on_kv_event(kv_event(3, "host", stored=[8], store_id="k2"), now=1.2) == ("", False)
    assert index.tier_run("n1", "ns", keys(8), 0) == []


def test_block_keys_are_each_hashs_block_key():
    import os

    from services.gateway.block_index import block_key, block_keys

    hashes = [os.urandom(32) for _ in range(1_023)]
    assert block_keys(hashes) == [block_key(h) for h in hashes]
    assert block_keys(iter(hashes[:3])) == [block_key(h) for h in hashes[:3]]
    odd_sizes = [b"\x01" * 9, b"\x02" * 40]
    assert block_keys(odd_sizes) == [block_key(h) for h in odd_sizes]
    assert block_keys([]) == []
