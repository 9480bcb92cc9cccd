"""Several gateway processes on one port (``flotilla serve --gateway-workers N``): each binds
the port with SO_REUSEPORT, the kernel spreads new connections between them, and one that
stops leaves the port served by the others. Over real sockets, uvicorn in front of the
stand-in service (one per gateway, as each process has its own)."""

from __future__ import annotations

import asyncio
import socket

import httpx
import pytest
import uvicorn

from cli.main import build_parser, serve_options
from cli.stack import Stack
from services.gateway.__main__ import server_config, shared_port_socket
from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from shared.config import ConfigError
from tests.services.gateway.fake_service import MODEL, FakeService
from tests.services.gateway.test_keep_alive import free_port

BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 2}


def test_a_port_bound_to_share_takes_a_second_socket_and_a_plain_one_does_not():
    config = GatewayConfig(host="127.0.0.1", port=free_port(), reuse_port=True)
    with shared_port_socket(config) as first, shared_port_socket(config) as second:
        first.listen()
        second.listen()
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", config.port))


async def two_gateways_then_one() -> tuple[list[int], int]:
    """Two servers on one shared port; 40 requests on fresh connections, then the first
    server stops and 10 more go. -> (requests each service saw, answers after the stop)."""
    config = GatewayConfig(host="127.0.0.1", port=free_port(), reuse_port=True)
    services = [FakeService(), FakeService()]
    servers = [uvicorn.Server(server_config(config, create_app(config, service)))
               for service in services]
    serving = [asyncio.create_task(server.serve(sockets=[shared_port_socket(config)]))
               for server in servers]
    url = f"http://127.0.0.1:{config.port}/v1/completions"

    async def one_request() -> int:  # a new connection each time: the kernel picks again
        async with httpx.AsyncClient(timeout=5) as client:
            return (await client.post(url, json=BODY)).status_code

    try:
        async with asyncio.timeout(10):
            while not all(server.started for server in servers):
                await asyncio.sleep(0.01)
        assert [await one_request() for _ in range(40)] == [200] * 40
        seen = [len(service.submitted) for service in services]
        servers[0].should_exit = True
        await asyncio.wait_for(serving[0], 10)
        after = [await one_request() for _ in range(10)]
        return seen, after.count(200)
    finally:
        for server in servers:
            server.should_exit = True
        await asyncio.wait_for(asyncio.gather(*serving, return_exceptions=True), 10)


def test_connections_spread_over_the_gateways_and_one_stopping_leaves_the_rest_serving():
    seen, answered_after_stop = asyncio.run(two_gateways_then_one())
    assert sum(seen) == 40 and min(seen) > 0, seen  # all 40 on one: odds 2^-39
    assert answered_after_stop == 10


def test_serve_starts_that_many_gateways_on_one_port():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--gateway-workers", "3"])
    stack = Stack(serve_options(args))
    stack.nats_url = "nats://127.0.0.1:1"
    gateways = [name for name in stack.service_names() if name.startswith("gateway")]
    assert gateways == ["gateway", "gateway-1", "gateway-2"]
    for name in gateways:
        command = stack.service_command(name)
        assert command[2] == "services.gateway" and "--reuse-port" in command
        assert command[command.index("--port") + 1] == "8000"
        # one metrics folder for all (their figures summed); one counts the shared figures
        assert stack.service_env(name)["PROMETHEUS_MULTIPROC_DIR"] == str(stack.metrics_dir())
        assert ("--no-fleet-metrics" in command) == (name != "gateway")
    folder = stack.metrics_dir()
    assert folder.is_dir()
    stack.stop()  # (a start after it begins with a new, empty one)
    assert not folder.exists() and stack.metrics_dir() != folder
    stack.stop()
    one = Stack(serve_options(build_parser().parse_args(["serve", "--device", "cpu"])))
    one.nats_url = "nats://127.0.0.1:1"
    assert "--reuse-port" not in one.service_command("gateway")
    assert "PROMETHEUS_MULTIPROC_DIR" not in one.service_env("gateway")
    with pytest.raises(ConfigError, match="--gateway-workers must be at least 1, not 0"):
        serve_options(build_parser().parse_args(["serve", "--device", "cpu",
                                                 "--gateway-workers", "0"]))
