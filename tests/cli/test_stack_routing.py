"""``flotilla serve --routing`` reaches the gateway; left out, the gateway's default (kv)."""

from __future__ import annotations

import pytest

from cli.main import build_parser, serve_options
from cli.stack import Stack
from services.gateway.config import GatewayConfig
from shared.config import load_config
from tests.cli.test_stack_kvstore import command, value


@pytest.mark.parametrize("routing", ["kv", "least-loaded", "round-robin"])
def test_serve_passes_the_routing_policy_to_the_gateway(routing):
    args = build_parser().parse_args(["serve", "--device", "cpu", "--replicas", "3",
                                      "--routing", routing])
    gateway = command(Stack(serve_options(args)), "gateway")
    flags = gateway[gateway.index("services.gateway") + 1:]
    assert load_config(GatewayConfig, flags, environ={}).routing == routing
    # a value the gateway takes by default is not repeated on its command line
    assert value(gateway, "--routing") == (None if routing == "kv" else routing)


def test_the_default_is_the_gateways():
    args = build_parser().parse_args(["serve", "--device", "cpu"])
    assert "--routing" not in command(Stack(serve_options(args)), "gateway")
    assert GatewayConfig().routing == "kv"
    with pytest.raises(ValueError, match="routing"):
        GatewayConfig(routing="random")


def test_an_unknown_policy_is_refused_by_serve():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--routing", "random"])
