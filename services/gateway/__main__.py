"""python -m services.gateway: serve the OpenAI API with uvicorn."""

from __future__ import annotations

import structlog
import uvicorn

from services.gateway.app import create_app
from services.gateway.config import GatewayConfig
from shared.config import load_config
from shared.logging import setup_logging
from shared.runtime import freeze_startup_objects, run_event_loop
from shared.tracing import setup_tracing


def main(argv=None) -> None:
    config = load_config(GatewayConfig, argv)
    setup_logging("gateway", level=config.log_level, json=config.log_json)
    setup_tracing("gateway", config.otel_exporter)
    structlog.contextvars.bind_contextvars(service="gateway", instance=config.instance_id)
    server = uvicorn.Server(uvicorn.Config(
        create_app(config), host=config.host, port=config.port, log_level="warning",
        access_log=False, timeout_graceful_shutdown=config.shutdown_timeout_s))
    freeze_startup_objects()
    run_event_loop(server.serve())  # uvicorn handles SIGINT/SIGTERM


if __name__ == "__main__":
    main()
