"""python -m services.gateway: serve the OpenAI API with uvicorn."""

from __future__ import annotations

import socket

import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from services.gateway.service import GatewayService
from shared.runtime import freeze_startup_objects, run_event_loop, setup_process


def main(argv=None) -> None:
    config = setup_process("gateway", GatewayConfig, argv)
    run_event_loop(serve(config))


async def serve(config: GatewayConfig) -> None:
    """Load the tokenizer and connect to NATS, then serve until SIGINT/SIGTERM (uvicorn
    handles them; the app's lifespan starts and stops the service)."""
    service = await GatewayService.connect(config)
    server = uvicorn.Server(server_config(config, create_app(config, service)))
    freeze_startup_objects()
    await server.serve(sockets=[shared_port_socket(config)] if config.reuse_port else None)


def server_config(config: GatewayConfig, app) -> uvicorn.Config:
    """uvicorn's settings from the gateway's config (one place, tested)."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          access_log=False, timeout_graceful_shutdown=config.shutdown_timeout,
                          timeout_keep_alive=config.http_keep_alive_s)


def shared_port_socket(config: GatewayConfig) -> socket.socket:
    """The API port bound with SO_REUSEPORT: every gateway process binds its own socket to it
    and the kernel hands each new connection to one of them, so they serve one port side by
    side and one that exits takes only its own connections with it. Bound only once the
    service is connected: no connection reaches a gateway that cannot answer."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.host, config.port))
    return sock


if __name__ == "__main__":
    main()
