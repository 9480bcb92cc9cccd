"""structlog setup: one call per process; JSON in production, console for humans."""

from __future__ import annotations

import logging
import sys

import structlog


def setup_logging(service: str, *, level: str = "info", json: bool = False) -> structlog.BoundLogger:
    numeric_level = logging.getLevelName(level.upper())
    if not isinstance(numeric_level, int):
        numeric_level = logging.INFO
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric_level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    # Libraries that log through stdlib logging go to stderr at WARNING and above.
    logging.basicConfig(stream=sys.stderr, level=max(numeric_level, logging.WARNING))
    return structlog.get_logger().bind(service=service)
