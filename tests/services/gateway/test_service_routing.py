"""The gateway's routing with its view of the replicas, driven by stats and block events
(no bus): kv sends a prompt to the replica holding its prefix, and no request is routed by
the blocks of a scheduler that restarted (a new instance for its replica) or went silent."""

from __future__ import annotations

import asyncio

import msgspec

from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.service import GatewayService
from shared.messages import GenerateRequest, SamplingParams, SchedulerBlockEvent
from shared.prefix_hash import extra_keys, usable_block_hashes
from shared.scheduler_stats import RoutingStats
from tests.services.gateway.test_readiness import _NoTokenizer, clock, stats  # noqa: F401

PROMPT = list(range(500, 500 + 20 * 16 + 3))
HASHES = usable_block_hashes(PROMPT, 16, extra_keys("m"))
ROUTING = RoutingStats(block_size=16, model_name="m")


def gateway(routing: str = "kv") -> GatewayService:
    return GatewayService(GatewayConfig(heartbeat_timeout_s=5.0, routing=routing), bus=None,
                          metrics=GatewayMetrics(), tokenizer=_NoTokenizer())


def heard(service: GatewayService, scheduler_id: str, replica_id: str, num_steps: int = 0) -> None:
    event = msgspec.structs.replace(stats(scheduler_id, replica_id, num_steps, num_running=0),
                                    routing=ROUTING)
    asyncio.run(service._on_stats(event))


def holds(service: GatewayService, scheduler_id: str) -> None:
    service.index.on_scheduler_event(SchedulerBlockEvent(
        scheduler_id=scheduler_id, replica_id="", seq=1, stored_hashes=HASHES), now=0.0)


def request() -> GenerateRequest:
    return GenerateRequest(request_id="r", prompt_token_ids=PROMPT, sampling=SamplingParams(),
                           output_subject="o")


def decisions(service: GatewayService, reason: str) -> float:
    return service.metrics.routing_decisions.labels("kv", reason)._value.get()


def test_kv_routes_to_the_holder_and_counts_the_decision(clock):
    service = gateway()
    heard(service, "a", "0")
    heard(service, "b", "1")
    holds(service, "b")
    decision = service._route(request())
    assert (decision.scheduler_id, decision.reason) == ("b", "cache")
    assert decisions(service, "cache") == 1
    assert service.metrics.routing_hit_tokens.labels("gpu")._value.get() == len(HASHES) * 16
    assert service._route(request(), avoid="b").scheduler_id == "a"  # moving off it


def test_a_restarted_replica_is_not_routed_to_by_its_old_blocks(clock):
    service = gateway()
    heard(service, "a", "0")
    heard(service, "b", "1")
    holds(service, "a")
    assert service._route(request()).scheduler_id == "a"
    clock.now += 1
    heard(service, "a2", "0")  # replica 0 restarted: a new scheduler, an empty cache
    decision = service._route(request())
    assert decision.reason == "load" and decision.hit_tokens == {}
    holds(service, "a")  # a late event of the old instance changes nothing
    assert service._route(request()).hit_tokens == {}


def test_a_silent_scheduler_loses_its_entries(clock):
    service = gateway()
    heard(service, "a", "0")
    holds(service, "a")
    clock.now += 6
    heard(service, "b", "1")
    service._forget_silent_caches(clock.now)
    assert service.index.gpu_prefix_blocks(["a"], [0]) == {"a": 0}
    assert service.index.num_gpu_blocks() == 0


def test_cache_blind_routing_keeps_no_index_feed(clock):
    service = gateway("least-loaded")
    assert service.blocks is None
    heard(service, "a", "0")
    heard(service, "b", "1")
    assert service._route(request()).policy == "least-loaded"


def test_a_request_of_ours_that_ended_frees_its_slot_before_the_stats_do(clock):
    """Stats are half a second old: a session's next turn must not find its replica a
    request busier than it is (the valve would move it for nothing)."""
    service = gateway()  # kv, nothing cached: its least loaded
    busy = msgspec.structs.replace(stats("b", "1", 0, num_running=1), routing=ROUTING)
    asyncio.run(service._on_stats(busy))  # another gateway's request
    service.replicas.record("a").num_outstanding = 1
    asyncio.run(service._on_stats(msgspec.structs.replace(busy, scheduler_id="a",
                                                          replica_id="0")))  # ours, in stats
    assert service._route(request()).scheduler_id == "b"  # 1 each: the first in the list
    service.replicas.record("a").num_outstanding = 0  # ours ended; the stats still show it
    assert service._route(request()).scheduler_id == "a"
