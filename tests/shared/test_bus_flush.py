"""``Bus.flush`` over a real nats-server: it returns only once NATS has read what the bus
sent before it. nats-py's own flush writes its PING ahead of the commands still queued for
its flusher task, so its PONG could come back before a subscription made just before it
was registered: a request at once then got "no responders" (10 of 150 tries on a loaded
2-core machine; CI failed on it)."""

from __future__ import annotations

import asyncio

import pytest

from shared.bus import Bus
from shared.errors import ServiceUnavailable
from shared.messages import Empty, HealthReply

pytestmark = pytest.mark.integration


async def health(_: Empty) -> HealthReply:
    return HealthReply(service="test", instance_id="a")


async def test_a_flush_does_not_return_before_an_earlier_subscribe_has_left(nats_url,
                                                                           monkeypatch):
    server_bus = await Bus.connect(nats_url, name="server")
    client_bus = await Bus.connect(nats_url, name="client")
    try:
        # the subscribe stays queued in nats-py (its flusher is never kicked), as it may for
        # a moment on a busy machine
        kick = server_bus._nc._flush_pending
        monkeypatch.setattr(server_bus._nc, "_flush_pending", lambda *_, **__: asyncio.sleep(0))
        await server_bus.serve("test.health", Empty, health)
        with pytest.raises(ServiceUnavailable, match="did not confirm a flush"):
            await server_bus.flush(timeout_s=0.5)
        with pytest.raises(ServiceUnavailable, match="no service is answering"):
            await client_bus.request("test.health", Empty(), HealthReply, timeout=2)
        # once the queue can leave, the flush returns and the subscription answers at once
        monkeypatch.setattr(server_bus._nc, "_flush_pending", kick)
        await server_bus.flush()
        reply = await client_bus.request("test.health", Empty(), HealthReply, timeout=2)
        assert reply.instance_id == "a"
    finally:
        await client_bus.close()
        await server_bus.close()


async def test_a_flush_on_a_bus_without_a_link_fails_at_once(nats_url):
    bus = await Bus.connect(nats_url, name="lonely")
    await bus.close()
    with pytest.raises(ServiceUnavailable):
        await bus.flush(timeout_s=5)
