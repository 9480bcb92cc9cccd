"""The response store against a real nats-server: off without JetStream (the gateway
serves on, refusing store/background), on with it; a response's messages replayed from
the first and then live, in order; gone after the retention."""

from __future__ import annotations

import asyncio

import pytest

from cli.stack import free_port
from services.gateway.response_store import ResponseStore
from shared.bus import Bus
from shared.errors import ServiceUnavailable
from shared.messages import OutputBatch, RequestOutput
from shared.response_messages import ResponseMark
from shared.subjects import Subjects
from tests.nats_server import NatsServer

SUBJECTS = Subjects("flotilla")


@pytest.fixture
def jetstream_url(tmp_path):
    server = NatsServer(free_port(), tmp_path / "nats.log", ("-js", "-sd", str(tmp_path / "js")))
    server.start()
    yield server.url
    server.stop()


@pytest.fixture
def nats_url(tmp_path):
    """A nats-server without JetStream."""
    server = NatsServer(free_port(), tmp_path / "nats.log")
    server.start()
    yield server.url
    server.stop()


async def _store(url: str, retention_s: float = 60.0) -> tuple[Bus, ResponseStore]:
    bus = await Bus.connect(url, "test")
    return bus, ResponseStore(bus, SUBJECTS, retention_s, 1, idle_timeout_s=0.5)


async def _nothing() -> None:
    pass


def test_without_jetstream_the_store_is_off(nats_url):
    async def go():
        bus, store = await _store(nats_url)
        try:
            started = await store.start(_nothing)
            store.stop()  # (its retries)
            return started, store.enabled
        finally:
            await bus.close()

    assert asyncio.run(go()) == (False, False)


def test_messages_replay_from_the_first_then_live_and_expire(jetstream_url):
    async def go():
        bus, store = await _store(jetstream_url, retention_s=1.0)
        try:
            assert await store.start(_nothing) and await store.start(_nothing)  # (2 gateways)
            assert await store.open("b" * 32) is None
            await store.record("gw", "a" * 32, ResponseMark(event="migrated", request_id="x"))
            for token_id in range(3):
                await bus.publish(SUBJECTS.response_outputs("gw", "a" * 32), OutputBatch(
                    [RequestOutput(request_id="a" * 32, new_token_ids=[token_id])]))
            await bus.publish(SUBJECTS.response_outputs("gw", "c" * 32), OutputBatch([]))
            messages = await store.open("a" * 32)
            seen = [await messages.next() for _ in range(4)]
            await bus.publish(SUBJECTS.response_outputs("gw", "a" * 32), OutputBatch([]))
            live = await messages.next()
            with pytest.raises(ServiceUnavailable):
                await messages.next()  # (the idle timeout)
            await messages.close()
            await asyncio.sleep(1.5)
            return seen, live, await store.exists("a" * 32)
        finally:
            await bus.close()

    seen, live, exists_later = asyncio.run(go())
    assert [(m.kind, m.gateway_id, m.num_pending) for m in seen] == \
        [("rec", "gw", 3), ("out", "gw", 2), ("out", "gw", 1), ("out", "gw", 0)]
    assert live.kind == "out"
    assert not exists_later
