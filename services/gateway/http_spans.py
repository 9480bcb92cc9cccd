"""The root span of a request's trace: one SERVER span per HTTP request to /v1/*, as pure
ASGI middleware (no task per chunk), around the whole response, streamed ones included.
Every NATS message the route sends meanwhile (encode, submit) carries its ``traceparent``,
so the tokenizer's, scheduler's and worker's spans join its trace (docs/tracing.md). A
client's own ``traceparent`` is honoured (the span is then its child). Installed only
where spans are exported (app.py): with tracing off the app has no such layer."""

from __future__ import annotations

from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.tracing import TRACE_HEADERS, message_span

_TRACE_HEADERS = tuple(name.encode() for name in TRACE_HEADERS)


class HttpSpans:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)  # health probes, scrapes: no trace
            return
        headers = {key.decode(): value.decode("latin-1") for key, value in scope["headers"]
                   if key in _TRACE_HEADERS}
        statuses: list[int] = []

        async def send_noting_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)

        name = f"{scope['method']} {scope['path']}"
        with message_span(name, headers, SpanKind.SERVER) as span:
            span.set_attributes({"http.request.method": scope["method"],
                                 "url.path": scope["path"]})
            await self.app(scope, receive, send_noting_status)
            if statuses:
                span.set_attribute("http.response.status_code", statuses[0])
                if statuses[0] >= 500:
                    span.set_status(Status(StatusCode.ERROR))
