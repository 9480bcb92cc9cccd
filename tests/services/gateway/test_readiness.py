"""The gateway's view of its replicas, driven by stats events alone (no bus): a replica
with work that stops finishing steps is not ready after the stall timeout, routing avoids
it, and a restarted scheduler replaces the old one."""

from __future__ import annotations

import asyncio

import pytest

from services.gateway import service as gateway_service
from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.gateway.service import GatewayService
from shared.messages import GenerateRequest, SamplingParams
from shared.scheduler_stats import SchedulerStats


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture()
def clock(monkeypatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(gateway_service.time, "monotonic", clock)
    return clock


def stats(scheduler_id: str, replica_id: str, num_steps: int, num_running: int = 1) -> SchedulerStats:
    return SchedulerStats(scheduler_id=scheduler_id, replica_id=replica_id, timestamp=0.0,
                          num_running=num_running, num_waiting=0, num_steps=num_steps,
                          worker_ready=True)


def gateway() -> GatewayService:
    config = GatewayConfig(stall_timeout_s=10.0, heartbeat_timeout_s=5.0)
    return GatewayService(config, bus=None, metrics=GatewayMetrics(), tokenizer=_NoTokenizer())


class _NoTokenizer:
    all_special_ids: list[int] = []
    clean_up_tokenization_spaces = False


def feed(service: GatewayService, event: SchedulerStats) -> None:
    asyncio.run(service._on_stats(event))


def test_a_replica_that_stops_stepping_with_work_is_not_ready(clock):
    service = gateway()
    for second in range(8):  # stepping: ready
        clock.now += 1
        feed(service, stats("a", "0", num_steps=second))
        feed(service, stats("b", "1", num_steps=0, num_running=0))  # idle: never stalled
    assert all(service.is_ready(s) for s in service.live_schedulers())
    for _ in range(12):  # 'a' keeps its heartbeat but finishes no step
        clock.now += 1
        feed(service, stats("a", "0", num_steps=7))
        feed(service, stats("b", "1", num_steps=0, num_running=0))
    ready = {s.scheduler_id: service.is_ready(s) for s in service.live_schedulers()}
    assert ready == {"a": False, "b": True}
    assert service._route(GenerateRequest(request_id="r", prompt_token_ids=[1, 2],
                                          sampling=SamplingParams(),
                                          output_subject="o")).scheduler_id == "b"
    stalled = service._newly_stalled()
    assert list(stalled) == ["a"] and stalled["a"].status == 503
    assert service._newly_stalled() == {}  # acted on once per stall
    clock.now += 1
    feed(service, stats("a", "0", num_steps=8))  # it stepped again
    assert service.is_ready(service.replicas.stats("a"))


def test_a_restarted_scheduler_replaces_the_old_one(clock):
    service = gateway()
    feed(service, stats("old", "0", num_steps=3))
    clock.now += 1
    feed(service, stats("new", "0", num_steps=0, num_running=0))
    assert [s.scheduler_id for s in service.live_schedulers()] == ["new"]
