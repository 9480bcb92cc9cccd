"""Gateway configuration."""

from __future__ import annotations

from shared.config import ServiceConfig


class GatewayConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla gateway: the OpenAI-compatible HTTP API."""

    host: str = "0.0.0.0"
    port: int = 8000
    api_key: str = ""  # when set, /v1/* and /tokenize need "Authorization: Bearer <key>"
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 5.0  # bus calls to the tokenizer and scheduler
    heartbeat_timeout_s: float = 5.0  # a scheduler silent this long has failed its requests
    health_timeout_s: float = 1.0

    __help__ = {
        "host": "address to listen on",
        "port": "HTTP port",
        "api_key": "require this bearer token on the API",
        "max_body_bytes": "largest request body accepted (413 above)",
        "request_timeout_s": "timeout for calls to the tokenizer and scheduler",
        "heartbeat_timeout_s": "fail a request whose scheduler has been silent this long",
        "health_timeout_s": "timeout of each service's health check",
    }
