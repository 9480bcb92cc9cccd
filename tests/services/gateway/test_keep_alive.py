"""The gateway's idle keep-alive, over a real socket (uvicorn in front of the stand-in
service): a connection idle for less than ``http_keep_alive_s`` is reused, one idle for
longer is closed by the gateway. The default outlasts the idle expiry of httpx (and so of
the OpenAI SDK): with equal timeouts a client can send on a connection in the same instant
the gateway closes it, and gets a ReadError that it does not retry (a POST)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn

from services.gateway.__main__ import server_config
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from tests.services.gateway.fake_service import FakeService


def test_the_default_keep_alive_outlasts_the_clients_idle_expiry():
    httpx_default_expiry = httpx.Limits().keepalive_expiry
    assert GatewayConfig().http_keep_alive_s >= 2 * httpx_default_expiry
    assert server_config(GatewayConfig(), app=None).timeout_keep_alive == \
        GatewayConfig().http_keep_alive_s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def idle_connection_reused(keep_alive_s: float, idle_s: float) -> bool:
    """Two requests on one client, ``idle_s`` apart: whether the second went on the
    first's connection (the same local port)."""
    config = GatewayConfig(host="127.0.0.1", port=free_port(), http_keep_alive_s=keep_alive_s)
    server = uvicorn.Server(server_config(config, create_app(config, FakeService())))
    serving = asyncio.create_task(server.serve())
    try:
        async with asyncio.timeout(10):
            while not server.started:
                await asyncio.sleep(0.01)
        ports = []

        async def note_port(response: httpx.Response) -> None:
            ports.append(response.extensions["network_stream"].get_extra_info("client_addr")[1])

        limits = httpx.Limits(keepalive_expiry=60)  # the gateway closes first, if anyone
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{config.port}", limits=limits,
                                     timeout=5, event_hooks={"response": [note_port]}) as client:
            assert (await client.get("/health")).status_code == 200
            await asyncio.sleep(idle_s)
            assert (await client.get("/health")).status_code == 200
        return ports[0] == ports[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(serving, 10)


@pytest.mark.parametrize(("keep_alive_s", "idle_s", "reused"), [(5.0, 0.5, True),
                                                                  (0.2, 0.8, False)])
def test_an_idle_connection_is_kept_for_the_keep_alive_and_closed_after(keep_alive_s, idle_s,
                                                                        reused):
    assert asyncio.run(idle_connection_reused(keep_alive_s, idle_s)) is reused
