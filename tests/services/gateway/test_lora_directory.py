"""The gateway's view of the fleet's LoRA adapters (services/gateway/lora_directory.py),
pure: the newer of a replica's stats and its load replies wins, requests go only to
replicas with their adapter, and a replica that (re)joins is given what its peers serve."""

from __future__ import annotations

from services.gateway.lora_directory import LoraDirectory, adapters_to_replay
from shared.lora_adapters import LoraRef


def ref(name: str, version: str = "0") -> LoraRef:
    return LoraRef(name=name, path=f"/adapters/{name}", content_hash=version * 16)


def test_a_newer_report_wins_and_an_older_one_changes_nothing():
    directory = LoraDirectory()
    directory.observe("s1", 2.0, [ref("a"), ref("b")])
    directory.observe("s1", 1.0, [ref("a")])  # (stats sent before the load's reply)
    assert set(directory.adapters(["s1"])) == {"a", "b"}
    directory.observe("s2", 3.0, [ref("a", "1")])
    assert directory.adapters(["s1", "s2"])["a"].content_hash == "1" * 16  # (the newest)
    assert directory.holders("b", ["s1", "s2"]) == {"s1"}
    assert directory.adapters(["s2"]).keys() == {"a"}  # (s1 not live: not counted)


def test_a_joined_replica_gets_what_its_peers_serve_and_lacks():
    peers = {"a": ref("a"), "b": ref("b"), "c": ref("c")}
    assert adapters_to_replay([ref("a")], peers) == [ref("b"), ref("c")]
    assert adapters_to_replay([ref("a"), ref("b"), ref("c")], peers) == []
    assert adapters_to_replay([], {}) == []  # (unloaded everywhere: not brought back)


def test_a_restarted_replica_of_a_fleet_of_one_gets_back_what_it_served():
    directory = LoraDirectory()
    directory.observe("s1", 1.0, [ref("start"), ref("late"), ref("gone")], "r0")
    directory.observe("s1", 2.0, [ref("start"), ref("late")], "r0")  # gone: unloaded
    directory.observe("s2", 3.0, [ref("start")], "r0")  # restarted: --lora-modules only
    lost = directory.take_lost("r0")
    assert set(lost) == {"start", "late"} and directory.take_lost("r0") == {}
    assert adapters_to_replay([ref("start")], lost) == [ref("late")]
    directory.observe("s3", 4.0, [ref("start")], "r0")  # restarted again before any replay
    directory.unloaded("start")  # (an unload while it was down reaches no memory of it)
    assert set(directory.take_lost("r0")) == set()  # s2 had only "start", now unloaded
