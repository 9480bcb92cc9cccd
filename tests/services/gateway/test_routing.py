"""The routing policy, pure: the kv cost puts a prompt where its prefix is (GPU, or the
node's host/disk tiers, as a leading run only) unless queued work outweighs it, the
saturation valve turns a hot prefix away from a loaded replica, sessions stick, and
least-loaded and round-robin ignore the cache."""

from __future__ import annotations

import pytest

from services.gateway import routing
from services.gateway.block_index import BlockIndex
from services.gateway.routing import (
    CACHE, LOAD, SATURATED, SESSION, TURN, PendingPrefill, Replica, Router, RoutingParams,
)
from shared.messages import SchedulerBlockEvent
from shared.scheduler_stats import RoutingStats, SchedulerStats
from shared.kv_messages import KvBlockEvent
from shared.prefix_hash import extra_keys, image_keys, usable_block_hashes

BLOCK_SIZE = 4
PROMPT = list(range(1000, 1000 + 16 * BLOCK_SIZE + 1))  # 16 usable blocks
HASHES = usable_block_hashes(PROMPT, BLOCK_SIZE, extra_keys("m"))


def stats(scheduler_id: str, *, running: int = 0, waiting: int = 0, queued: int = 0,
          node: str = "", prefill: float = 0.0, host: float = 0.0, replica_id: str = "",
          **fields) -> SchedulerStats:
    return SchedulerStats(
        scheduler_id=scheduler_id, replica_id=replica_id or scheduler_id, timestamp=0.0,
        num_running=running, num_waiting=waiting, routing=RoutingStats(
            block_size=BLOCK_SIZE, model_name="m", kv_node_id=node,
            kv_namespace="ns" if node else "", num_queued_prefill_tokens=queued,
            prefill_tokens_per_s=prefill, host_load_bytes_per_s=host, block_bytes=1000,
            **fields))


def dear_streams(scheduler_id: str, **fields) -> SchedulerStats:
    """Stats of a replica that measured one more stream at 16 prompt tokens a step."""
    return stats(scheduler_id, decode_seq_cost_tokens=16.0, **fields)


def holds(index: BlockIndex, scheduler_id: str, hashes: list[bytes], seq: int = 1) -> None:
    index.on_scheduler_event(SchedulerBlockEvent(scheduler_id=scheduler_id, replica_id="0",
                                                 seq=seq, stored_hashes=hashes), now=0.0)


def node_holds(index: BlockIndex, node: str, tier: str, hashes: list[bytes], seq: int = 1) -> None:
    index.on_kv_event(KvBlockEvent(store_id=f"store-{node}", node_id=node, namespace="ns",
                                   seq=seq, tier=tier, stored_hashes=hashes))


def router(index: BlockIndex | None = None, **params) -> Router:
    return Router(RoutingParams(**params), index if index is not None else BlockIndex())


def test_the_replica_holding_the_prefix_is_cheapest():
    index = BlockIndex()
    holds(index, "a", HASHES)
    decision = router(index).choose([Replica(stats("b")), Replica(stats("a"))], PROMPT)
    assert (decision.scheduler_id, decision.reason) == ("a", CACHE)
    assert decision.hit_tokens == {"gpu": 16 * BLOCK_SIZE}
    assert decision.num_compute_tokens == 1


def test_an_image_prompt_is_priced_by_its_image_keyed_blocks():
    """The scheduler keys the block of an image's first placeholder by the image (and the
    blocks after it through their parents): routing prices the same keys."""
    images = image_keys([(2 * BLOCK_SIZE + 1, b"\x07" * 16)])
    index = BlockIndex()
    holds(index, "a", usable_block_hashes(PROMPT, BLOCK_SIZE, extra_keys("m"), images))
    holds(index, "b", HASHES)  # the same tokens behind other pixels: its first 2 blocks only
    decision = router(index).choose([Replica(stats("b")), Replica(stats("a"))], PROMPT,
                                    images=images)
    assert (decision.scheduler_id, decision.hit_tokens) == ("a", {"gpu": 16 * BLOCK_SIZE})
    estimates = router(index).estimates([Replica(stats("b"))], PROMPT, None, images=images)
    assert estimates["b"].num_hit_tokens == 2 * BLOCK_SIZE


def test_hits_count_only_as_a_leading_run():
    index = BlockIndex()
    holds(index, "a", HASHES[1:])  # everything but the first block: no prefix hit at all
    holds(index, "b", HASHES[:2])
    decision = router(index).choose([Replica(stats("a")), Replica(stats("b"))], PROMPT)
    assert (decision.scheduler_id, decision.hit_tokens) == ("b", {"gpu": 2 * BLOCK_SIZE})


def test_queued_prefill_outweighs_a_small_hit():
    index = BlockIndex()
    holds(index, "a", HASHES[:2])
    replicas = [Replica(stats("a", queued=5000)), Replica(stats("b"))]
    decision = router(index).choose(replicas, PROMPT)
    assert (decision.scheduler_id, decision.reason) == ("b", LOAD)
    # the gateway's own count of prompt tokens sent counts too (a burst between stats)
    replicas = [Replica(stats("a")), Replica(stats("b"), num_sent=1, num_sent_prefill_tokens=5000)]
    assert router(index).choose(replicas, PROMPT).scheduler_id == "a"


def test_running_decodes_add_load():
    replicas = [Replica(stats("a", running=6)), Replica(stats("b", running=2))]
    decision = router().choose(replicas, PROMPT)
    assert (decision.scheduler_id, decision.reason) == ("b", LOAD)


def test_host_and_disk_hits_count_for_every_replica_of_the_node():
    index = BlockIndex()
    holds(index, "a", HASHES[:2])
    node_holds(index, "n1", "host", HASHES[2:6])
    node_holds(index, "n1", "disk", HASHES[:10], seq=2)
    node_holds(index, "n2", "host", HASHES, seq=1)  # another node: not a's nor b's
    replicas = [Replica(stats("a", node="n1")), Replica(stats("b", node="n1")),
                Replica(stats("c", node="n3"))]
    estimates = router(index).estimates(replicas, PROMPT, None)
    assert estimates["a"].hit_tokens == {"gpu": 8, "host": 16, "disk": 16}  # GPU run, then the tiers
    assert estimates["b"].hit_tokens == {"host": 16, "disk": 24}  # the node's run from block 0
    assert estimates["c"].hit_tokens == {}
    decision = router(index).choose(replicas, PROMPT)
    assert (decision.scheduler_id, decision.reason) == ("a", CACHE)


def test_a_tier_hit_slower_to_load_than_to_compute_is_no_hit():
    index = BlockIndex()
    node_holds(index, "n1", "host", HASHES)
    slow = [Replica(stats("a", node="n1", prefill=1000.0, host=100.0)), Replica(stats("b"))]
    assert router(index).estimates(slow, PROMPT, None)["a"].hit_tokens == {}
    fast = [Replica(stats("a", node="n1", prefill=1000.0, host=1e9)), Replica(stats("b"))]
    assert router(index).estimates(fast, PROMPT, None)["a"].hit_tokens == {"host": 64}


def test_a_speed_not_measured_is_the_mean_of_the_measured():
    replicas = [Replica(stats("a", prefill=500.0)), Replica(stats("b", prefill=1500.0)),
                Replica(stats("c"))]
    estimates = router().estimates(replicas, PROMPT, None)
    assert estimates["c"].seconds == pytest.approx(len(PROMPT) / 1000.0)
    assert estimates["a"].seconds == pytest.approx(len(PROMPT) / 500.0)


def test_a_short_cached_prefix_on_a_busier_replica_loses_to_an_idle_one():
    """The low-diversity case: every prompt shares a short prefix. A hit saves its tokens
    once; one more request on the holder shares each of this one's steps."""
    index = BlockIndex()
    holds(index, "a", HASHES)
    tied = [Replica(stats("a", running=1)), Replica(stats("b", running=1))]
    decision = router(index).choose(tied, PROMPT, max_tokens=32)
    assert (decision.scheduler_id, decision.reason) == ("a", CACHE)  # equal load: the hit
    busier = [Replica(stats("a", running=2)), Replica(stats("b", running=1))]
    decision = router(index).choose(busier, PROMPT, max_tokens=32)
    assert (decision.scheduler_id, decision.reason) == ("b", LOAD)
    # a burst sees its own requests before any stats do (and their queued prefill is
    # only the tokens left after their hits: that made the holder look cheap before)
    burst = [Replica(stats("a"), num_sent=1, num_sent_prefill_tokens=1), Replica(stats("b"))]
    assert router(index).choose(burst, PROMPT, max_tokens=32).scheduler_id == "b"


def test_without_a_cache_advantage_kv_is_least_loaded():
    """Equal hits everywhere (a shared prefix every replica holds): the least loaded one,
    even where a stale queued-prefill figure makes a busier one look cheaper."""
    index = BlockIndex()
    holds(index, "a", HASHES)
    holds(index, "b", HASHES)
    replicas = [Replica(stats("a", running=1, queued=5000)), Replica(stats("b", running=2))]
    assert router(index, saturation_margin=4).estimates(replicas, PROMPT, None, 1)["b"].seconds \
        < router(index).estimates(replicas, PROMPT, None, 1)["a"].seconds
    decision = router(index, saturation_margin=4).choose(replicas, PROMPT, max_tokens=1)
    assert (decision.scheduler_id, decision.reason) == ("a", LOAD)


def test_load_is_priced_over_each_of_the_requests_steps():
    replicas = [Replica(stats("a", running=3, prefill=1000.0)),
                Replica(stats("b", prefill=1000.0))]
    estimates = router().estimates(replicas, PROMPT, None, output_tokens=10)
    assert estimates["a"].seconds - estimates["b"].seconds == pytest.approx(
        3 * routing.DECODE_COST_TOKENS * (1 + 10) / 1000.0)


def test_the_expected_output_is_max_tokens_or_the_mean_of_finished_requests():
    index = BlockIndex()
    holds(index, "a", HASHES)  # 64 tokens of hits against one more request on a
    replicas = [Replica(stats("a", running=1)), Replica(stats("b"))]
    route = router(index, saturation_margin=4)  # the cost alone decides
    assert route.choose(replicas, PROMPT, max_tokens=1).scheduler_id == "a"  # 1 x 16 x 2 < 64
    assert route.choose(replicas, PROMPT).scheduler_id == "b"  # 128 until requests end
    assert route.choose(replicas, PROMPT, max_tokens=4096).scheduler_id == "b"
    for _ in range(200):
        route.observe_output(1)
    assert route.mean_output_tokens == pytest.approx(1.0, abs=0.01)
    assert route.choose(replicas, PROMPT, max_tokens=4096).scheduler_id == "a"


def test_load_counts_our_requests_now_and_the_rest_from_stats():
    # one of our three requests there ended since the stats: its slot is free now
    assert Replica(stats("a", running=3), num_sent=2, num_sent_at_stats=3).load == 2
    # two requests of another gateway, and one more of ours since
    assert Replica(stats("a", running=5), num_sent=4, num_sent_at_stats=3).load == 6
    # not known when the stats came: the larger figure
    assert Replica(stats("a", running=5), num_sent=4).load == 5
    # least-loaded keeps its figure from before kv (the baseline kv is measured against)
    ended = [Replica(stats("a", running=2), num_sent=1, num_sent_at_stats=2),
             Replica(stats("b", running=1), num_sent=1, num_sent_at_stats=1)]
    assert ended[0].baseline_load == 2
    assert router(policy="least-loaded").choose(ended, PROMPT).scheduler_id == "b"
    assert router().choose(ended, PROMPT).scheduler_id == "a"


def test_the_saturation_threshold_follows_the_fleets_mean_load():
    def threshold(loads, **params):
        return router(**params).saturation_threshold([Replica(stats(str(i), waiting=n))
                                                      for i, n in enumerate(loads)])
    assert threshold([1, 0, 0]) == 1  # few in flight: one request of imbalance counts
    assert threshold([3, 2, 1]) == 1
    assert threshold([8, 8, 8]) == 4  # 24 in flight: half the mean
    assert threshold([100, 100, 100], saturation_margin=8) == 50
    assert threshold([2, 2, 2], saturation_margin=8) == 8
    assert threshold([0, 0], saturation_margin=0, saturation_ratio=0.0) == 1  # least is open


def test_the_saturation_valve_turns_a_hot_prefix_away():
    index = BlockIndex()
    holds(index, "a", HASHES)
    # a short answer: one more stream costs 16 x 2 = 32 tokens (the replicas measured 16),
    # so the 64 hit tokens are worth 2 requests: with few in flight (T = 1) the holder may
    # run 1 + 1 + 2 ahead
    stats = dear_streams
    one_more = [Replica(stats("a", waiting=1)), Replica(stats("b"))]
    decision = router(index).choose(one_more, PROMPT, max_tokens=1)
    assert (decision.scheduler_id, decision.reason) == ("a", CACHE)
    three_more = [Replica(stats("a", waiting=3)), Replica(stats("b", queued=100))]
    assert router(index).choose(three_more, PROMPT, max_tokens=1).scheduler_id == "a"
    four_more = [Replica(stats("a", waiting=4)), Replica(stats("b", queued=100))]
    decision = router(index).choose(four_more, PROMPT, max_tokens=1)
    assert (decision.scheduler_id, decision.reason) == ("b", SATURATED)
    assert router(index, saturation_margin=2).choose(four_more, PROMPT,
                                                     max_tokens=1).scheduler_id == "a"
    # the gateway's own count of requests sent counts as load
    assert router(index).choose([Replica(stats("a"), num_sent=4),
                                 Replica(stats("b", queued=100))],
                                PROMPT, max_tokens=1).scheduler_id == "b"
    # 30 in flight: the holder may run 5 + 1 + 2 ahead (T = half the mean of 10), not 8
    def fleet(holder_load):
        others = (30 - holder_load) // 2
        return [Replica(stats("a", waiting=holder_load)),
                Replica(stats("b", waiting=others, queued=5000)),
                Replica(stats("c", waiting=30 - holder_load - others, queued=5000))]
    assert router(index).choose(fleet(14), PROMPT, max_tokens=1).scheduler_id == "a"
    decision = router(index).choose(fleet(15), PROMPT, max_tokens=1)
    assert decision.scheduler_id != "a" and decision.reason == SATURATED


def test_a_short_hit_buys_a_holder_no_extra_request():
    """The valve's slack is what the hit over the least loaded replica's is worth: one
    block (4 tokens) against 32 a stream is worth none, so the holder closes at T + 1."""
    index = BlockIndex()
    holds(index, "a", HASHES[:1])
    two_more = [Replica(stats("a", waiting=2)), Replica(stats("b", queued=100))]
    decision = router(index).choose(two_more, PROMPT, max_tokens=1)
    assert (decision.scheduler_id, decision.reason) == ("b", SATURATED)
    holds(index, "b", HASHES[:1])  # the least loaded holds as much: no slack either
    holds(index, "a", HASHES[1:], seq=2)
    assert router(index).choose(two_more, PROMPT, max_tokens=1).scheduler_id == "a"


def test_a_measured_decode_cost_prices_load():
    """Replicas that measured one more stream's cost per step use it (the fleet's mean
    for those that did not): cheap streams let a busier holder win, dear ones do not."""
    index = BlockIndex()
    holds(index, "a", HASHES)
    # a 24-token answer: at the default 4 a stream costs 100 tokens, outweighing the hit (64)
    def fleet(cost):
        return [Replica(stats("a", waiting=1, decode_seq_cost_tokens=cost)),
                Replica(stats("b", decode_seq_cost_tokens=cost))]
    assert router(index).choose(fleet(0.0), PROMPT, max_tokens=24).scheduler_id == "b"
    assert router(index).choose(fleet(2.0), PROMPT, max_tokens=24).scheduler_id == "a"
    assert router(index).choose(fleet(30.0), PROMPT, max_tokens=24).scheduler_id == "b"
    assert Router.decode_cost_tokens(fleet(0.0)) == routing.DECODE_COST_TOKENS
    # one figure for the fleet: the median, a replica that measured none counting the default
    mixed = [Replica(stats("a", decode_seq_cost_tokens=2.0)), Replica(stats("b"))]
    assert Router.decode_cost_tokens(mixed) == (2.0 + routing.DECODE_COST_TOKENS) / 2


def test_one_replicas_outlying_decode_cost_prices_nobody():
    """A slope from a few dozen steps is noisy: one replica reading 40 tokens a stream
    (the others 2) neither prices its own load nor the fleet's; the median does."""
    index = BlockIndex()
    holds(index, "a", HASHES)
    replicas = [Replica(stats("a", waiting=1, decode_seq_cost_tokens=40.0)),
                Replica(stats("b", decode_seq_cost_tokens=2.0)),
                Replica(stats("c", decode_seq_cost_tokens=2.0))]
    assert Router.decode_cost_tokens(replicas) == 2.0
    decision = router(index).choose(replicas, PROMPT, max_tokens=24)
    assert (decision.scheduler_id, decision.reason) == ("a", CACHE)
    # the same outlier on an idle replica does not make the holder dear either
    replicas = [Replica(stats("a", waiting=1, decode_seq_cost_tokens=2.0)),
                Replica(stats("b", decode_seq_cost_tokens=40.0)),
                Replica(stats("c", decode_seq_cost_tokens=2.0))]
    assert router(index).choose(replicas, PROMPT, max_tokens=24).scheduler_id == "a"


def test_a_session_leaves_a_replica_one_request_busier_at_low_concurrency():
    """6 conversations on 3 replicas placed 3/2/1: a turn coming back to the busiest
    finds it 2 to the least loaded's 1 (its own turn has ended) and moves; placed 2/2/2
    it finds 1 and stays."""
    index = BlockIndex()
    route = router(index)
    route.sessions.put(("", "u1"), "a", now=0.0)
    holds(index, "a", HASHES)
    uneven = [Replica(stats("a"), num_sent=2, num_sent_at_stats=3),  # stats still show it
              Replica(stats("b"), num_sent=2, num_sent_at_stats=2),
              Replica(stats("c"), num_sent=1, num_sent_at_stats=1)]
    decision = route.choose(uneven, PROMPT, session="u1", now=1.0, max_tokens=24)
    assert (decision.scheduler_id, decision.reason) == ("c", SATURATED)
    route.sessions.put(("", "u1"), "a", now=2.0)
    even = [Replica(stats("a"), num_sent=1, num_sent_at_stats=2),
            Replica(stats("b"), num_sent=2, num_sent_at_stats=2),
            Replica(stats("c"), num_sent=2, num_sent_at_stats=2)]
    decision = route.choose(even, PROMPT, session="u1", now=3.0, max_tokens=24)
    assert (decision.scheduler_id, decision.reason) == ("a", SESSION)


def test_a_session_stays_by_what_its_cached_history_is_worth():
    """A session leaves its replica at T + W: with a short answer (32 tokens a stream)
    its 64 cached tokens are worth 2 requests of imbalance, so at T = 1 it stays while its
    replica runs 1 or 2 more than the least loaded, and leaves at 3."""
    stats = dear_streams  # measured 16 tokens a stream
    index = BlockIndex()
    holds(index, "a", HASHES)
    route = router(index)
    for extra, expected in ((1, ("a", SESSION)), (2, ("a", SESSION)), (3, ("b", SATURATED))):
        route.sessions.put(("", "u1"), "a", now=0.0)
        replicas = [Replica(stats("a", waiting=extra)), Replica(stats("b"))]
        decision = route.choose(replicas, PROMPT, session="u1", now=1.0, max_tokens=1)
        assert (decision.scheduler_id, decision.reason) == expected, extra


def test_a_session_sticks_until_its_replica_saturates_or_goes():
    index = BlockIndex()
    route = router(index)
    first = route.choose([Replica(stats("a")), Replica(stats("b"))], PROMPT, session="u1", now=0.0)
    other = "b" if first.scheduler_id == "a" else "a"
    holds(index, other, HASHES)  # the other one now holds the prefix: the session still sticks
    again = route.choose([Replica(stats("a")), Replica(stats("b"))], PROMPT, session="u1", now=1.0)
    assert (again.scheduler_id, again.reason) == (first.scheduler_id, SESSION)
    # another tenant's session of the same name is its own
    assert route.choose([Replica(stats("a")), Replica(stats("b"))], PROMPT, session="u1",
                        cache_salt="t2", now=1.0).reason != SESSION
    loaded = {first.scheduler_id: 20, other: 0}
    moved = route.choose([Replica(stats(s, running=n)) for s, n in loaded.items()], PROMPT,
                         session="u1", now=2.0)
    assert (moved.scheduler_id, moved.reason) == (other, SATURATED)
    # it went there last: it sticks there now; a replica that is not ready is left
    back = route.choose([Replica(stats(first.scheduler_id)), Replica(stats(other))], PROMPT,
                        session="u1", now=3.0)
    assert (back.scheduler_id, back.reason) == (other, SESSION)
    alone = route.choose([Replica(stats(first.scheduler_id)), Replica(stats("c"))], PROMPT,
                         session="u1", now=4.0)
    assert alone.reason != SESSION


def test_sessions_expire_and_are_bounded():
    sessions = routing.Sessions(max_sessions=2, ttl_s=10.0)
    sessions.put(("", "u1"), "a", now=0.0)
    sessions.put(("", "u2"), "b", now=1.0)
    assert sessions.get(("", "u1"), now=9.0) == "a"
    sessions.put(("", "u3"), "c", now=2.0)  # u2 is the least recently used
    assert sessions.get(("", "u2"), now=2.0) is None and len(sessions) == 2
    assert sessions.get(("t", "u1"), now=2.0) is None  # per tenant
    assert sessions.get(("", "u3"), now=12.0) is None  # expired


def test_cache_blind_policies_ignore_the_index_and_hash_nothing(monkeypatch):
    index = BlockIndex()
    holds(index, "a", HASHES)
    replicas = [Replica(stats("a", running=1)), Replica(stats("b"))]
    calls = []
    monkeypatch.setattr(routing, "usable_block_hashes",
                        lambda *args: calls.append(args) or HASHES)
    decision = router(index, policy="least-loaded").choose(replicas, PROMPT, session="u1")
    assert (decision.scheduler_id, decision.reason, decision.policy) == ("b", LOAD, "least-loaded")
    turns = router(index, policy="round-robin")
    chosen = [turns.choose(replicas, PROMPT).scheduler_id for _ in range(4)]
    assert chosen == ["a", "b", "a", "b"] and turns.choose(replicas, PROMPT).reason == TURN
    assert router(index).choose(replicas[:1], PROMPT).reason == LOAD  # one replica: no hashing
    assert calls == []
    router(index).choose(replicas, PROMPT)
    assert len(calls) == 1  # kv with two ready replicas: hashed once per block size and model


def test_pending_prefill_counts_until_the_first_output():
    pending = PendingPrefill()
    pending.add("r1", "a", 100)
    pending.add("r2", "a", 50)
    assert pending.of("a") == 150 and pending.of("b") == 0
    pending.done("r1")
    pending.done("r1")  # twice: counted once
    assert pending.of("a") == 50
    pending.done("r2")
    assert pending.of("a") == 0


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing"):
        router(policy="random")
