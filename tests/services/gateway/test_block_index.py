"""The gateway's block index driven by events alone: leading runs only, per-scheduler
seq (a gap or a late join asks for a snapshot, events meanwhile held and applied on
top), a dropped or restarted scheduler's entries gone for good, and the kvstore's host
and disk tiers per node (a restart or a gap drops them)."""

from __future__ import annotations

from services.gateway.block_index import SNAPSHOT_RETRY_S, BlockIndex, block_key
from shared.messages import KvBlockEvent, SchedulerBlockEvent


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


def test_a_restarted_kvstore_or_a_gap_drops_the_nodes_entries():
    index = BlockIndex()
    assert index.on_kv_event(kv_event(5, "host", stored=[1])) == ""  # joined late: fine
    assert index.on_kv_event(kv_event(6, "host", stored=[2])) == ""
    assert index.tier_run("n1", "ns", keys(1, 2), 0) == ["host", "host"]
    assert index.on_kv_event(kv_event(9, "host", stored=[3])) == "gap"  # 7, 8 missed
    assert index.tier_run("n1", "ns", keys(1, 2), 0) == []
    assert index.tier_run("n1", "ns", keys(3), 0) == ["host"]
    assert index.on_kv_event(kv_event(1, "disk", stored=[4], store_id="k2")) == "restart"
    assert index.tier_run("n1", "ns", keys(3), 0) == []
    assert index.tier_run("n1", "ns", keys(4), 0) == ["disk"]
    assert index.on_kv_event(kv_event(1, "disk", stored=[4], store_id="k2")) == ""  # a repeat
    assert index.num_tier_blocks() == 1


def test_block_keys_are_each_hashs_block_key():
    import os

    from services.gateway.block_index import block_key, block_keys

    hashes = [os.urandom(32) for _ in range(1_023)]
    assert block_keys(hashes) == [block_key(h) for h in hashes]
    assert block_keys(iter(hashes[:3])) == [block_key(h) for h in hashes[:3]]
    odd_sizes = [b"\x01" * 9, b"\x02" * 40]
    assert block_keys(odd_sizes) == [block_key(h) for h in odd_sizes]
    assert block_keys([]) == []
