"""python -m services.gateway: serve the OpenAI API with uvicorn."""

from __future__ import annotations

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
    await server.serve()


def server_config(config: GatewayConfig, app) -> uvicorn.Config:
    """uvicorn's settings from the gateway's config (one place, tested)."""
    return uvicorn.Config(app, host=config.host, port=config.port, log_level="warning",
                          access_log=False, timeout_graceful_shutdown=config.shutdown_timeout_s,
                          timeout_keep_alive=config.http_keep_alive_s)


if __name__ == "__main__":
    main()
