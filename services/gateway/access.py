"""The API key check and the per-request count, as pure ASGI middleware (no task or
stream per response chunk), and the one way the gateway answers an error."""

from __future__ import annotations

import json
import secrets

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.metrics import GatewayMetrics
from shared.errors import FlotillaError, Unauthorized

RETRY_AFTER_S = 1  # what a 429 tells the client to wait before trying again
_PROTECTED_PATHS = ("/tokenize", "/detokenize")


def error_headers(exc: FlotillaError) -> dict[str, str]:
    return {"Retry-After": str(RETRY_AFTER_S)} if exc.status == 429 else {}


def error_response(exc: FlotillaError) -> JSONResponse:
    return JSONResponse(status_code=exc.status, content=exc.openai_body(),
                        headers=error_headers(exc))


class AuthAndCount:
    """Refuse /v1/* and /tokenize without the bearer key (when one is set); count every
    response by path and status; count 429s as rejected requests."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: GatewayMetrics) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        if self.expected is not None and (path.startswith("/v1/") or path in _PROTECTED_PATHS):
            auth = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(auth, self.expected):
                await self._reject(send, Unauthorized("Incorrect API key provided",
                                                      code="invalid_api_key"))
                self.metrics.requests.labels(path, "401").inc()
                return
        metrics = self.metrics

        async def counting_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = message["status"]
                metrics.requests.labels(path, str(status)).inc()
                if status == 429:
                    metrics.rejected.labels("queue_full").inc()
            await send(message)

        await self.app(scope, receive, counting_send)

    async def _reject(self, send: Send, error: FlotillaError) -> None:
        body = json.dumps(error.openai_body()).encode()
        await send({"type": "http.response.start", "status": error.status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
