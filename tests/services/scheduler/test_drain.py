"""The scheduler service's drain (SIGTERM) and its handling of a lost NATS link, driven
through a stand-in bus (no NATS) whose worker is the policy tests' FakeWorker."""

from __future__ import annotations

import asyncio
import time

import pytest

from services.scheduler import outbox
from services.scheduler.config import SchedulerConfig
from services.scheduler.service import SchedulerService
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import Empty, HealthReply, OutputBatch, StepPlan, WorkerInfo
from shared.scheduler_stats import SchedulerStats
from shared.subjects import Subjects
from tests.services.scheduler.test_scheduler import (
    BLOCK_SIZE, EOS, FakeWorker, expected_tokens, request,
)

NUM_BLOCKS = 256
SUBJECTS = Subjects()


class FakeBus:
    """What SchedulerService uses of shared.bus.Bus. Requests to the worker's subjects
    are answered by a FakeWorker (a fresh one per attach, as a real worker resets);
    ``drop_link()`` / ``restore_link()`` play a NATS outage."""

    def __init__(self, step_s: float = 0.005) -> None:
        self.step_s = step_s
        self.worker = FakeWorker(NUM_BLOCKS)
        self.num_attaches = 0
        self.handlers: dict[tuple[str, str], object] = {}
        self.published: list[tuple[str, object]] = []
        self.listeners = []
        self.connected = True
        self.num_disconnects = 0
        self.connected_at = time.monotonic()
        self.lost_for_good = False

    @property
    def is_connected(self) -> bool:
        return self.connected

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def drop_link(self) -> None:
        self.connected = False
        self.num_disconnects += 1
        for listener in self.listeners:
            listener(False)

    def restore_link(self) -> None:
        self.connected, self.connected_at = True, time.monotonic()
        for listener in self.listeners:
            listener(True)

    async def serve(self, subject, request_type, handler, *, queue=None, concurrent=False) -> None:
        self.handlers[(subject, queue or "")] = handler

    async def unsubscribe(self, subject, *, queue=None) -> None:
        self.handlers.pop((subject, queue or ""), None)

    async def publish(self, subject, message) -> None:
        if not self.connected:
            raise ServiceUnavailable("not connected to NATS")
        self.published.append((subject, message))

    async def flush(self) -> None:
        pass

    async def request(self, subject, message, reply_type, *, timeout=5.0):
        if not self.connected:
            raise ServiceUnavailable("not connected to NATS")
        if subject == SUBJECTS.worker_attach("0"):
            self.num_attaches += 1
            self.worker = FakeWorker(NUM_BLOCKS)
            return WorkerInfo(worker_id="w1", replica_id="0", model_name="m",
                              num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, max_model_len=512,
                              eos_token_ids=[EOS], kv_cache_bytes=0, device="cpu",
                              dtype="float32")
        if subject == SUBJECTS.worker_ping("0"):
            return HealthReply(service="worker", instance_id="w1",
                               detail={"nats_disconnects": 0})
        if subject == SUBJECTS.worker_step("0"):
            assert isinstance(message, StepPlan) and message.worker_id == "w1"
            epoch = self.num_disconnects
            await asyncio.sleep(self.step_s)
            if self.num_disconnects != epoch:
                raise ServiceUnavailable("lost the connection to NATS while waiting for a reply")
            return self.worker.execute(message)
        raise ServiceUnavailable(f"no service is answering on {subject}")

    # ---------------------------------------------------------------- what came out
    def outputs(self) -> dict[str, list]:
        by_request: dict[str, list] = {}
        for _, message in self.published:
            if isinstance(message, OutputBatch):
                for output in message.outputs:
                    by_request.setdefault(output.request_id, []).append(output)
        return by_request

    def last_stats(self) -> SchedulerStats:
        return [m for _, m in self.published if isinstance(m, SchedulerStats)][-1]


def make_service(bus: FakeBus, **config) -> SchedulerService:
    config = SchedulerConfig(instance_id="s1", max_num_seqs=8, max_num_batched_tokens=64,
                             stats_interval_s=0.02, **{"shutdown_timeout": 5.0, **config})
    return SchedulerService(config, bus)


async def eventually(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.005)


async def started(bus: FakeBus, **config) -> tuple[SchedulerService, asyncio.Event, asyncio.Task]:
    service = make_service(bus, **config)
    await service.start()
    stop = asyncio.Event()
    run = asyncio.create_task(service.run(stop))
    await eventually(lambda: service.worker_attached)
    return service, stop, run


def finished_well(outputs: list, request_id: str, num_prompt: int, max_tokens: int) -> bool:
    tokens = [t for o in outputs for t in o.new_token_ids]
    return (outputs[-1].finish_reason == "length" and outputs[-1].error is None
            and tokens == expected_tokens(request_id, num_prompt, max_tokens))


async def test_draining_refuses_new_requests_and_finishes_the_held_ones():
    bus = FakeBus()
    service, stop, run = await started(bus)
    held = [request(f"r{i}", 10, 40) for i in range(3)]
    for req in held:
        await service._on_submit(req)
    await eventually(lambda: bus.outputs())  # they are running

    stop.set()
    await eventually(lambda: service.draining)
    with pytest.raises(ServiceUnavailable) as refused:
        await service._on_submit(request("late", 10, 5))
    assert refused.value.code == "draining" and refused.value.status == 503
    queue_submit = (SUBJECTS.scheduler_submit, SUBJECTS.queue_group("scheduler"))
    assert queue_submit not in bus.handlers  # queue-group submits go to other replicas
    assert (SUBJECTS.scheduler_submit_to("s1"), "") in bus.handlers  # still says why not
    health = await service._on_health(Empty())
    assert health.status == "draining" and health.detail["draining"] is True
    await eventually(lambda: not bus.last_stats().worker_ready)  # gateways route around it

    await asyncio.wait_for(run, 5)
    outputs = bus.outputs()
    for req in held:
        assert finished_well(outputs[req.request_id], req.request_id, 10, 40)
    assert "late" not in outputs


async def test_a_drain_past_the_shutdown_timeout_fails_what_is_left_with_a_503():
    bus = FakeBus(step_s=0.01)
    service, stop, run = await started(bus, shutdown_timeout=0.3)
    await service._on_submit(request("long", 10, 400))
    await eventually(lambda: bus.outputs())
    stop.set()
    began = time.monotonic()
    await asyncio.wait_for(run, 5)
    assert time.monotonic() - began < 1.5
    last = bus.outputs()["long"][-1]
    assert last.finish_reason == "error"
    assert last.error.status == 503 and last.error.code == "shutdown"
    assert "shut down" in last.error.message
    assert service.core.requests == {}


async def test_a_drain_with_nothing_held_ends_at_once():
    bus = FakeBus()
    service, stop, run = await started(bus, shutdown_timeout=30)
    stop.set()
    began = time.monotonic()
    await asyncio.wait_for(run, 2)
    assert time.monotonic() - began < 0.5


async def test_a_drain_before_the_worker_attached_ends_at_once():
    bus = FakeBus()
    bus.connected = False  # the worker cannot be reached
    service = make_service(bus)
    stop = asyncio.Event()
    run = asyncio.create_task(service.run(stop))
    await asyncio.sleep(0.1)
    stop.set()
    await asyncio.wait_for(run, 2)
    assert not service.worker_attached


async def test_a_lost_link_fails_running_requests_after_it_is_back_and_reattaches(monkeypatch):
    monkeypatch.setattr(outbox, "REDELIVERY_AFTER_S", (0.05, 0.2))
    bus = FakeBus(step_s=0.01)
    service, stop, run = await started(bus)
    done_before = request("quick", 10, 2)
    await service._on_submit(done_before)
    await eventually(lambda: "quick" in bus.outputs()
                     and bus.outputs()["quick"][-1].finish_reason == "length")
    await service._on_submit(request("long", 10, 400))
    await eventually(lambda: "long" in bus.outputs())
    num_published = len(bus.published)

    bus.drop_link()
    await eventually(lambda: not service.worker_attached)  # the running requests failed
    with pytest.raises(FlotillaError):
        await service._on_submit(request("meanwhile", 10, 5))  # refused, not lost
    await asyncio.sleep(0.1)
    assert len(bus.published) == num_published  # nothing can go out while it is down

    bus.restore_link()
    await eventually(lambda: service.worker_attached)
    assert bus.num_attaches == 2  # the worker's cache was reset
    await eventually(lambda: sum(o.finish_reason == "error" for o in bus.outputs()["long"]) == 2)
    errors = [o for o in bus.outputs()["long"] if o.finish_reason == "error"]
    assert {(e.error.status, e.error.code) for e in errors} == {(503, "nats_unavailable")}
    assert "lost its connection to NATS" in errors[0].error.message
    # the request that had just finished may have lost its last output with the link: a
    # gateway that still waits for it gets the error too (one that had it ignores it)
    assert bus.outputs()["quick"][-1].error.code == "nats_unavailable"

    fresh = request("fresh", 10, 20)
    await service._on_submit(fresh)
    await eventually(lambda: "fresh" in bus.outputs()
                     and bus.outputs()["fresh"][-1].finish_reason is not None)
    assert finished_well(bus.outputs()["fresh"], "fresh", 10, 20)
    stop.set()
    await asyncio.wait_for(run, 5)


async def test_a_lost_link_while_idle_keeps_the_worker_and_its_cache():
    bus = FakeBus()
    service, stop, run = await started(bus)
    core = service.core
    bus.drop_link()
    await asyncio.sleep(0.05)
    bus.restore_link()
    await asyncio.sleep(0.1)
    assert service.core is core and bus.num_attaches == 1
    await service._on_submit(request("after", 10, 5))
    await eventually(lambda: "after" in bus.outputs()
                     and bus.outputs()["after"][-1].finish_reason is not None)
    assert finished_well(bus.outputs()["after"], "after", 10, 5)
    stop.set()
    await asyncio.wait_for(run, 5)


async def test_a_worker_whose_own_link_dropped_mid_step_fails_the_step(monkeypatch):
    """Its step or reply may be lost while the scheduler's link stayed up: the ping that
    shows the worker's disconnect count moved fails the step within about a second."""
    bus = FakeBus()
    service, stop, run = await started(bus)
    worker_link = {"count": 0}
    original = bus.request

    async def request_(subject, message, reply_type, *, timeout=5.0):
        if subject == SUBJECTS.worker_step("0"):
            await asyncio.sleep(60)  # lost: never answered
        if subject == SUBJECTS.worker_ping("0"):
            return HealthReply(service="worker", instance_id="w1",
                               detail={"nats_disconnects": worker_link["count"]})
        return await original(subject, message, reply_type, timeout=timeout)

    monkeypatch.setattr(bus, "request", request_)
    await service._on_submit(request("r", 10, 5))
    await asyncio.sleep(1.2)  # a ping during the step with the count unchanged: waits on
    assert "r" not in bus.outputs()
    worker_link["count"] = 1
    await eventually(lambda: "r" in bus.outputs(), timeout_s=3)
    error = bus.outputs()["r"][-1].error
    assert error.status == 503 and "connection to NATS dropped" in error.message
    monkeypatch.setattr(bus, "request", original)
    stop.set()
    await asyncio.wait_for(run, 5)
