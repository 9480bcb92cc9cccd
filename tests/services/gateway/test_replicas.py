"""ReplicaTable: the gateway's record of each scheduler, driven by stats and submits
with an explicit clock (no bus, no service)."""

from __future__ import annotations

import msgspec

from services.gateway.replicas import ReplicaTable, Stall
from shared.scheduler_stats import SchedulerStats


def stats(scheduler_id: str, replica_id: str = "0", num_steps: int = 0, num_running: int = 0,
          worker_ready: bool = True) -> SchedulerStats:
    return SchedulerStats(scheduler_id=scheduler_id, replica_id=replica_id, timestamp=0.0,
                          num_running=num_running, num_waiting=0, num_steps=num_steps,
                          worker_ready=worker_ready)


def table() -> ReplicaTable:
    return ReplicaTable(heartbeat_timeout_s=5.0, stall_timeout_s=10.0)


def test_a_scheduler_is_live_until_its_heartbeat_times_out():
    replicas = table()
    assert replicas.live(0.0) == []
    assert replicas.heard(stats("a"), now=100.0) == []
    assert [s.scheduler_id for s in replicas.live(104.5)] == ["a"]
    assert replicas.silent(104.5) == [] and replicas.silent_s("a", 104.5) == 4.5
    assert replicas.live(105.0) == []
    assert replicas.silent(105.1) == ["a"]
    assert replicas.silent_s("never-heard", 105.1) == 0.0


def test_a_new_scheduler_for_a_replica_replaces_the_old_one_once():
    replicas = table()
    replicas.heard(stats("old", "0"), now=1.0)
    replicas.heard(stats("other", "1"), now=1.0)
    replicas.submitted("old", 2, now=1.5)
    assert replicas.heard(stats("new", "0"), now=2.0) == ["old"]
    assert replicas.heard(stats("new", "0"), now=2.5) == []  # known already: nothing new
    assert sorted(s.scheduler_id for s in replicas.live(3.0)) == ["new", "other"]
    assert replicas.silent(100.0) == ["other", "new"]  # the old one has no heartbeat left
    old = replicas.record("old")
    assert old.num_outstanding == 2  # its requests still count down as they move
    replicas.add_outstanding("old", -2)
    assert old.num_outstanding == 0


def test_outstanding_requests_are_counted_and_remembered_at_each_stats():
    replicas = table()
    replicas.submitted("a", 3, now=1.0)  # the submit's reply came before any stats
    assert replicas.silent_s("a", 2.0) == 1.0  # counts as heard from at the submit
    assert replicas.live(2.0) == []  # but has no stats to route by
    replicas.heard(stats("a"), now=2.0)
    replicas.add_outstanding("a", -1)
    record = replicas.record("a")
    assert (record.num_outstanding, record.num_outstanding_at_stats) == (2, 3)
    replicas.heard(stats("a"), now=2.5)
    assert record.num_outstanding_at_stats == 2


def test_a_replica_with_work_that_stops_stepping_stalls_once():
    replicas = table()
    replicas.heard(stats("a", num_steps=1, num_running=1), now=0.0)
    replicas.heard(stats("idle", "1", num_steps=0), now=0.0)
    replicas.heard(stats("a", num_steps=1, num_running=1), now=9.0)  # alive, no new step
    assert replicas.seconds_since_step("a", 9.0) == 9.0
    assert replicas.is_ready(replicas.stats("a"), 9.0)
    assert not replicas.is_ready(replicas.stats("a"), 10.5)
    assert replicas.seconds_since_step("idle", 10.5) == 0.0  # no work: never stalled
    assert replicas.newly_stalled(10.5) == [Stall("a", "0", 10.5)]
    assert replicas.newly_stalled(11.0) == []  # acted on once per stall
    replicas.heard(stats("a", num_steps=2, num_running=1), now=12.0)  # it stepped again
    assert replicas.is_ready(replicas.stats("a"), 12.0)
    assert replicas.newly_stalled(30.0) == [Stall("a", "0", 18.0)]  # a second stall


def test_work_after_an_idle_spell_is_not_stuck_at_once():
    # Session 21 saw a request moved 12 s after it came to a replica idle for a minute:
    # the stall clock had counted from the replica's last step, before the idle spell.
    replicas = table()
    replicas.heard(stats("a", num_steps=5), now=0.0)
    replicas.heard(stats("a", num_steps=5), now=60.0)  # idle all along
    replicas.heard(stats("a", num_steps=5, num_running=1), now=60.5)  # work, no step yet
    assert replicas.seconds_since_step("a", 61.0) == 1.0
    assert replicas.newly_stalled(61.0) == []
    assert replicas.newly_stalled(71.0) == [Stall("a", "0", 11.0)]  # a real stall still is


def test_a_replica_without_its_worker_is_not_ready():
    replicas = table()
    replicas.heard(stats("a", worker_ready=False), now=0.0)
    assert not replicas.is_ready(replicas.stats("a"), 0.0)


def test_a_dropped_scheduler_is_not_live_until_its_stats_come_again():
    replicas = table()
    replicas.heard(stats("a"), now=0.0)
    replicas.drop_stats("a")
    replicas.drop_stats("unknown")  # nothing to drop: no error
    assert replicas.live(1.0) == [] and replicas.stats("a") is None
    assert replicas.heard(msgspec.structs.replace(stats("a"), num_running=1), now=2.0) == []
    assert [s.num_running for s in replicas.live(2.0)] == [1]


def test_live_schedulers_are_listed_in_the_order_their_stats_came():
    replicas = table()
    replicas.submitted("b", 1, now=0.0)  # known before its stats
    replicas.heard(stats("a", "0"), now=0.0)
    replicas.heard(stats("b", "1"), now=0.0)
    replicas.heard(stats("c", "2"), now=0.0)
    replicas.drop_stats("a")
    replicas.heard(stats("a", "0"), now=1.0)  # back: after the others
    assert [s.scheduler_id for s in replicas.live(1.0)] == ["b", "c", "a"]
    assert replicas.record("b").num_outstanding == 1  # kept through the move
