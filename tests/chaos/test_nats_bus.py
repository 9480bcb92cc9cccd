"""The bus when NATS goes away: a real nats-server killed (kill -9) and started again on
the same port, and a stand-in server that closes the connection for good.

Requests waiting for a reply fail at once with a clear 503 (not at their timeout), sends
are refused while the link is down, the subscriptions come back with the server, and a
connection closed for good ends a service's process with EXIT_NATS_LOST."""

from __future__ import annotations

import asyncio
import json
import sys
import time

import pytest
import structlog

from cli.stack import free_port
from shared.bus import EXIT_NATS_LOST, Bus
from shared.errors import ServiceUnavailable
from tests.nats_server import NatsServer
from shared.messages import Empty, HealthReply

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


@pytest.fixture
def nats_server(tmp_path):
    server = NatsServer(free_port(), tmp_path / "nats.log")
    server.start()
    yield server
    server.stop()


async def eventually(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.05)
    return condition()


async def request_reaching_its_handler(client_bus: Bus, arrived: asyncio.Event) -> asyncio.Task:
    """A request to test.slow that its handler has received (so it waits for a reply)."""
    waiting = asyncio.create_task(client_bus.request("test.slow", Empty(), Empty, timeout=60))
    await asyncio.wait_for(arrived.wait(), 5)
    assert not waiting.done()
    return waiting


async def test_nats_killed_fails_waits_at_once_and_the_bus_comes_back_with_it(nats_server):
    server_bus = await Bus.connect(nats_server.url, name="server")
    client_bus = await Bus.connect(nats_server.url, name="client")
    seen: list[bool] = []
    client_bus.add_listener(seen.append)

    arrived = asyncio.Event()

    async def slow(_: Empty) -> Empty:
        arrived.set()
        await asyncio.sleep(60)
        return Empty()

    async def health(_: Empty) -> HealthReply:
        return HealthReply(service="test", instance_id="a")

    await server_bus.serve("test.slow", Empty, slow)
    await server_bus.serve("test.health", Empty, health)
    await server_bus.flush()
    try:
        with structlog.testing.capture_logs() as logs:
            waiting = await request_reaching_its_handler(client_bus, arrived)
            nats_server.kill()
            killed_at = time.monotonic()
            with pytest.raises(ServiceUnavailable, match="lost the connection to NATS"):
                await asyncio.wait_for(waiting, 5)
            assert time.monotonic() - killed_at < 2, "the wait outlived the link"
            assert not client_bus.is_connected and seen == [False]
            assert client_bus.num_disconnects == 1
            with pytest.raises(ServiceUnavailable, match="not connected to NATS"):
                await client_bus.publish("test.event", Empty())
            with pytest.raises(ServiceUnavailable, match="not connected to NATS"):
                await client_bus.request("test.health", Empty(), HealthReply, timeout=5)

            await asyncio.sleep(2)
            nats_server.start()
            back_at = time.monotonic()
            assert await eventually(lambda: client_bus.is_connected and server_bus.is_connected, 5)
            assert seen == [False, True]
            # the subscription was replayed on the new server: the handler answers again
            reply = await client_bus.request("test.health", Empty(), HealthReply, timeout=2)
            assert reply.instance_id == "a"
            assert time.monotonic() - back_at < 5
        events = [entry["event"] for entry in logs]
        assert events.count("nats_disconnected") == 2 and events.count("nats_reconnected") == 2
    finally:
        await client_bus.close()
        await server_bus.close()
    assert not client_bus.lost_for_good  # closing it ourselves is not losing it


# ------------------------------------------------------------ closed for good
class ClosingServer:
    """Speaks just enough of the NATS protocol to accept a client, then sends an error
    that makes nats-py close the connection for good (no reconnect)."""

    def __init__(self, close_after_s: float) -> None:
        self.close_after_s = close_after_s
        self.port = 0
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> "ClosingServer":
        self._server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *_) -> None:
        self._server.close()

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "stand-in", "version": "2.10.0", "proto": 1, "headers": True,
                "max_payload": 1048576, "host": "127.0.0.1", "port": self.port}
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        closing = asyncio.get_running_loop().time() + self.close_after_s
        try:
            while True:
                left = closing - asyncio.get_running_loop().time()
                try:
                    line = await asyncio.wait_for(reader.readline(), max(left, 0.01))
                except asyncio.TimeoutError:
                    writer.write(b"-ERR 'Authorization Violation'\r\n")
                    await writer.drain()
                    return
                if not line:
                    return
                if line.startswith(b"PING"):
                    writer.write(b"PONG\r\n")
                    await writer.drain()
                elif line.startswith((b"PUB", b"HPUB")):
                    await reader.readline()  # the payload
        finally:
            writer.close()


async def test_a_connection_closed_for_good_calls_on_lost():
    lost = asyncio.Event()
    async with ClosingServer(close_after_s=0.5) as server:
        bus = await Bus.connect(server.url, name="doomed", on_lost=lost.set)
        await asyncio.wait_for(lost.wait(), 5)
        assert bus.lost_for_good and not bus.is_connected
        with pytest.raises(SystemExit) as exited:
            bus.exit_if_lost()
        assert exited.value.code == EXIT_NATS_LOST
        await bus.close()


async def test_a_service_whose_nats_connection_is_closed_for_good_exits_non_zero(tmp_path):
    """The scheduler (the quickest service to start) must not sit connected to nothing."""
    async with ClosingServer(close_after_s=3.0) as server:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "services.scheduler", "--nats-url", server.url,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        try:
            _, stderr = await asyncio.wait_for(process.communicate(), 60)
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()
    text = stderr.decode()
    assert process.returncode == EXIT_NATS_LOST, text
    assert "nats_closed" in text
