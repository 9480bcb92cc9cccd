"""A thin typed layer over nats-py: msgpack-encoded msgspec messages, errors carried
across as a reply header, OpenTelemetry trace context in NATS headers.

Only each service's ``service.py`` uses this module; core logic never sees NATS.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import SpanKind

from shared.errors import FlotillaError, InvalidRequest, ServiceUnavailable
from shared.messages import ErrorInfo, decode, encode
from shared.tracing import extract_context, inject_headers, tracer

ERROR_HEADER = "Flotilla-Error"

log = structlog.get_logger()

Req = TypeVar("Req")
Rep = TypeVar("Rep")

_error_encoder = msgspec.json.Encoder()
_error_decoder = msgspec.json.Decoder(ErrorInfo)


class Bus:
    def __init__(self, nc: Client) -> None:
        self._nc = nc
        self._subscriptions: list[Subscription] = []

    @classmethod
    async def connect(cls, url: str, name: str, *, timeout_s: float = 30.0) -> "Bus":
        """Connect, retrying until ``timeout_s`` (NATS may still be starting);
        once connected, reconnect forever."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                nc = await nats.connect(
                    url, name=name, connect_timeout=2, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=0.5,
                )
                return cls(nc)
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"cannot reach NATS at {url}: {exc}") from exc
                await asyncio.sleep(0.2)

    @property
    def is_connected(self) -> bool:
        return self._nc.is_connected

    async def close(self, timeout_s: float = 2.0) -> None:
        """Drain (finish in-flight handlers), but never wait long: NATS may be gone."""
        if self._nc.is_closed:
            return
        try:
            await asyncio.wait_for(self._nc.drain(), timeout_s)
        except (nats.errors.Error, asyncio.TimeoutError):
            pass
        if not self._nc.is_closed:
            await self._nc.close()

    # ------------------------------------------------------------ client side
    async def request(self, subject: str, message: Any, reply_type: type[Rep], *,
                      timeout: float = 5.0) -> Rep:
        """Send a request; return the decoded reply. Raises ServiceUnavailable when
        nobody serves the subject or the reply does not come in time, and the remote
        FlotillaError when the handler failed."""
        headers = inject_headers()
        try:
            reply = await self._nc.request(subject, encode(message), timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError as exc:
            raise ServiceUnavailable(f"no service is answering on {subject}") from exc
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
            raise ServiceUnavailable(f"no reply on {subject} within {timeout:g}s") from exc
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                nats.errors.OutboundBufferLimitError) as exc:
            raise ServiceUnavailable(f"NATS connection unavailable: {exc}") from exc
        if reply.headers and ERROR_HEADER in reply.headers:
            raise FlotillaError.from_info(_error_decoder.decode(reply.headers[ERROR_HEADER]))
        return decode(reply.data, reply_type)

    async def publish(self, subject: str, message: Any) -> None:
        await self._nc.publish(subject, encode(message), headers=inject_headers())

    async def flush(self) -> None:
        await self._nc.flush()

    # ------------------------------------------------------------ server side
    async def serve(self, subject: str, request_type: type[Req],
                    handler: Callable[[Req], Awaitable[Any]], *, queue: str | None = None) -> None:
        """Answer requests on ``subject`` with ``handler``'s reply. Errors become an
        ErrorInfo header on an empty reply, so the caller raises them."""

        async def on_message(msg: Msg) -> None:
            with tracer.start_as_current_span(subject, context=extract_context(msg.headers),
                                              kind=SpanKind.SERVER):
                headers: dict[str, str] | None = None
                body = b""
                try:
                    reply = await handler(decode(msg.data, request_type))
                    body = encode(reply)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    headers = _error_headers(InvalidRequest(f"malformed {request_type.__name__}: {exc}"))
                except FlotillaError as exc:
                    headers = _error_headers(exc)
                except Exception as exc:  # noqa: BLE001 - every failure must reach the caller
                    log.exception("handler_failed", subject=subject)
                    headers = _error_headers(FlotillaError(f"{type(exc).__name__}: {exc}"))
                if msg.reply:
                    await self._nc.publish(msg.reply, body, headers=headers)

        self._subscriptions.append(await self._nc.subscribe(subject, queue=queue or "", cb=on_message))

    async def subscribe(self, subject: str, message_type: type[Req],
                        handler: Callable[[Req], Awaitable[None]], *, queue: str | None = None) -> None:
        """Receive published messages in order; a failing handler is logged, not fatal."""

        async def on_message(msg: Msg) -> None:
            with tracer.start_as_current_span(subject, context=extract_context(msg.headers),
                                              kind=SpanKind.CONSUMER):
                try:
                    await handler(decode(msg.data, message_type))
                except Exception:  # noqa: BLE001
                    log.exception("subscriber_failed", subject=subject)

        self._subscriptions.append(await self._nc.subscribe(subject, queue=queue or "", cb=on_message))


def _error_headers(exc: FlotillaError) -> dict[str, str]:
    return {ERROR_HEADER: _error_encoder.encode(exc.to_info()).decode()}
