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
    server = uvicorn.Server(uvicorn.Config(
        create_app(config, service), host=config.host, port=config.port, log_level="warning",
        access_log=False, timeout_graceful_shutdown=config.shutdown_timeout_s))
    freeze_startup_objects()
    await server.serve()


if __name__ == "__main__":
    main()
