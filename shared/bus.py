"""A thin typed layer over nats-py: msgpack-encoded msgspec messages, errors carried
across as a reply header, OpenTelemetry trace context in NATS headers (a span per handled
message only where spans are exported: shared/tracing.py).

Only each service's edge modules use this module (its ``service.py`` and the named bus
clients beside it; tests/test_nats_edges.py lists them); core logic never sees NATS.

Losing NATS (docs/ARCHITECTURE.md, "Failure handling"): nats-py reconnects forever and
replays the subscriptions; the Bus logs ``nats_disconnected`` / ``nats_reconnected``,
fails every request waiting for a reply the moment the link drops (core NATS keeps
nothing: a reply due during the outage is gone) and refuses to send while it is down,
so no wait outlives the link. A connection nats-py closes for good (a server error)
ends the process with EXIT_NATS_LOST, so a supervisor restarts it.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import SpanKind

from shared.errors import FlotillaError, InvalidRequest, ServiceUnavailable
from shared.messages import ErrorInfo, decode, encode
from shared.tracing import inject_headers, message_span

ERROR_HEADER = "Flotilla-Error"
EXIT_NATS_LOST = 75  # EX_TEMPFAIL: the NATS connection was closed for good; restart me
RECONNECT_WAIT_S = 0.5  # between reconnect attempts
PING_INTERVAL_S = 5  # a link dead without a TCP reset is found after ~3 of these
MAX_OUTSTANDING_PINGS = 2

log = structlog.get_logger()

Req = TypeVar("Req")
Rep = TypeVar("Rep")

_error_encoder = msgspec.json.Encoder()
_error_decoder = msgspec.json.Decoder(ErrorInfo)
_SEND_ERRORS = (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                nats.errors.ConnectionDrainingError, nats.errors.OutboundBufferLimitError)


class Bus:
    """One NATS connection. ``on_lost`` runs once if nats-py closes it for good (not
    on ``close()``); by default the process exits with EXIT_NATS_LOST."""

    def __init__(self, url: str = "", name: str = "",
                 on_lost: Callable[[], None] | None = None) -> None:
        self.url = url
        self.name = name
        self._nc: Client | None = None
        self._on_lost = on_lost or _exit_process
        self._subscriptions: dict[tuple[str, str], list[Subscription]] = {}
        self._handler_tasks: set[asyncio.Task] = set()  # concurrent serve handlers running
        self._listeners: list[Callable[[bool], None]] = []
        self._link_up = False
        self._lost_link: asyncio.Future = asyncio.get_running_loop().create_future()
        self._closing = False
        self.lost_for_good = False  # nats-py closed the connection; nothing will come back
        self.num_disconnects = 0  # bumped each time the link drops: anything in flight may be gone
        self.connected_at = 0.0  # monotonic time the link last came up
        self._down_since = 0.0

    @classmethod
    async def connect(cls, url: str, name: str, *, timeout_s: float = 30.0,
                      on_lost: Callable[[], None] | None = None) -> "Bus":
        """Connect, retrying until ``timeout_s`` (NATS may still be starting);
        once connected, reconnect forever."""
        bus = cls(url, name, on_lost)
        deadline = time.monotonic() + timeout_s
        while True:
            nc = Client()
            try:
                await nc.connect(
                    url, name=name, connect_timeout=2, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=RECONNECT_WAIT_S,
                    ping_interval=PING_INTERVAL_S, max_outstanding_pings=MAX_OUTSTANDING_PINGS,
                    disconnected_cb=bus._callback(nc, bus._on_disconnected),
                    reconnected_cb=bus._callback(nc, bus._on_reconnected),
                    closed_cb=bus._callback(nc, bus._on_closed),
                    error_cb=bus._on_error)
                break
            except (OSError, nats.errors.Error, asyncio.TimeoutError) as exc:
                if time.monotonic() > deadline:
                    raise ServiceUnavailable(f"cannot reach NATS at {url}: {exc}") from exc
                await asyncio.sleep(0.2)
        bus._nc = nc
        bus._link_up, bus.connected_at = True, time.monotonic()
        return bus

    # ------------------------------------------------------------ connection state
    @property
    def is_connected(self) -> bool:
        return self._nc is not None and self._link_up and self._nc.is_connected

    @property
    def is_closed(self) -> bool:
        return self._nc is None or self._nc.is_closed

    def add_listener(self, listener: Callable[[bool], None]) -> None:
        """``listener(False)`` when the link drops, ``listener(True)`` when it is back
        (subscriptions replayed). Called on the bus's event loop; must not block."""
        self._listeners.append(listener)

    async def wait_connected(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.is_connected and not self.lost_for_good:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return self.is_connected

    def exit_if_lost(self) -> None:
        """After the service stopped: exit non-zero if it stopped because NATS was lost."""
        if self.lost_for_good:
            raise SystemExit(EXIT_NATS_LOST)

    def _callback(self, nc: Client, handler: Callable[[], None]) -> Callable[[], Awaitable[None]]:
        async def callback() -> None:
            if self._nc is nc:  # not an earlier attempt of connect()
                handler()
        return callback

    def _on_disconnected(self) -> None:
        self._link_down("disconnected")

    def _link_down(self, why: str) -> None:
        if not self._link_up:
            return
        self._link_up = False
        self.num_disconnects += 1
        self._down_since = time.monotonic()
        lost, self._lost_link = self._lost_link, asyncio.get_running_loop().create_future()
        lost.set_result(None)  # every request waiting for a reply fails now
        if not self._closing:
            log.warning("nats_disconnected", name=self.name, url=self.url, reason=why)
        self._notify(False)

    def _on_reconnected(self) -> None:
        if self._closing or self._link_up:
            return
        self._link_up, self.connected_at = True, time.monotonic()
        log.info("nats_reconnected", name=self.name, url=self.url,
                 down_s=round(self.connected_at - self._down_since, 2))
        self._notify(True)

    def _on_closed(self) -> None:
        self._link_down("closed")
        if self._closing:
            return
        self.lost_for_good = True
        error = self._nc.last_error if self._nc is not None else None
        log.error("nats_closed", name=self.name, url=self.url,
                  error=repr(error) if error else None)
        self._on_lost()

    async def _on_error(self, exc: Exception) -> None:
        # nats-py reports each failed reconnect attempt here: one line, no traceback
        log.debug("nats_error", name=self.name, error=repr(exc))

    def _notify(self, up: bool) -> None:
        for listener in list(self._listeners):
            try:
                listener(up)
            except Exception:  # noqa: BLE001 - a listener must not break the others
                log.exception("bus_listener_failed")

    def _check_link(self, subject: str) -> None:
        if self._nc is not None and not self._nc.is_connected:
            self._link_down("noticed on send")  # before nats-py's callback runs
        if not self.is_connected:
            raise ServiceUnavailable(f"not connected to NATS (cannot send on {subject}); "
                                     "reconnecting")

    async def close(self, timeout_s: float = 2.0) -> None:
        """Drain (finish in-flight handlers), but never wait long: NATS may be gone."""
        self._closing = True
        if self._nc is None or self._nc.is_closed:
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
        nobody serves the subject, the reply does not come in time, or the link to NATS
        is down or drops before the reply comes; and the remote FlotillaError when the
        handler failed."""
        self._check_link(subject)
        lost = self._lost_link
        call = asyncio.ensure_future(
            self._nc.request(subject, encode(message), timeout=timeout, headers=inject_headers()))
        try:
            await asyncio.wait((call, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not call.done():
                call.cancel()
        if not call.done() or call.cancelled():
            raise ServiceUnavailable(f"lost the connection to NATS while waiting for a reply "
                                     f"on {subject}")
        try:
            reply = call.result()
        except nats.errors.NoRespondersError as exc:
            raise ServiceUnavailable(f"no service is answering on {subject}") from exc
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
            raise ServiceUnavailable(f"no reply on {subject} within {timeout:g}s") from exc
        except _SEND_ERRORS as exc:
            raise ServiceUnavailable(f"NATS connection unavailable: {exc!r}") from exc
        if reply.headers and ERROR_HEADER in reply.headers:
            raise FlotillaError.from_info(_error_decoder.decode(reply.headers[ERROR_HEADER]))
        return decode(reply.data, reply_type)

    async def publish(self, subject: str, message: Any) -> None:
        """Send an event. Raises ServiceUnavailable while the link to NATS is down (it
        is not buffered for later: core NATS could not promise its delivery anyway)."""
        self._check_link(subject)
        try:
            await self._nc.publish(subject, encode(message), headers=inject_headers())
        except _SEND_ERRORS as exc:
            raise ServiceUnavailable(f"NATS connection unavailable: {exc!r}") from exc

    def jetstream(self, timeout_s: float = 5.0):
        """nats-py's JetStream context on this connection (the gateway's response store:
        services/gateway/response_store.py); its calls raise nats-py's errors."""
        self._check_link("JetStream")
        return self._nc.jetstream(timeout=timeout_s)

    async def flush(self, timeout_s: float = 2.0) -> None:
        """Return once NATS has processed everything sent before the call: subscriptions
        (they answer from now on) and messages. nats-py's own ``flush`` cannot promise it:
        its PING goes to the socket ahead of the commands still queued for its flusher task
        (nats-py 2.16), so its PONG may come before a SUB sent earlier is read (seen: a
        request right after a flushed subscribe answered "no responders"). A message to a
        fresh inbox of ours, queued behind those commands, comes back only after them.
        Raises ServiceUnavailable when the link is down or NATS does not answer in time."""
        self._check_link("a flush")
        arrived = asyncio.get_running_loop().create_future()

        async def on_barrier(_: Msg) -> None:
            if not arrived.done():
                arrived.set_result(None)

        try:
            inbox = self._nc.new_inbox()
            sub = await self._nc.subscribe(inbox, cb=on_barrier)
            try:
                await self._nc.publish(inbox, b"")
                await asyncio.wait_for(arrived, timeout_s)
            finally:
                try:
                    await sub.unsubscribe()
                except (nats.errors.Error, *_SEND_ERRORS):
                    pass  # the link dropped: the subscription went with it
        except asyncio.TimeoutError as exc:
            raise ServiceUnavailable(f"NATS did not confirm a flush within {timeout_s:g}s") from exc
        except _SEND_ERRORS as exc:
            raise ServiceUnavailable(f"NATS connection unavailable: {exc!r}") from exc

    # ------------------------------------------------------------ server side
    async def serve(self, subject: str, request_type: type[Req],
                    handler: Callable[[Req], Awaitable[Any]], *, queue: str | None = None,
                    concurrent: bool = False) -> None:
        """Answer requests on ``subject`` with ``handler``'s reply. Errors become an
        ErrorInfo header on an empty reply, so the caller raises them. Requests are handled
        one at a time, in order; with ``concurrent`` each starts in order as soon as it
        comes, in its own task (up to its first await), without waiting for the one before."""

        async def on_message(msg: Msg) -> None:
            if concurrent:
                task = asyncio.create_task(answer(msg))
                self._handler_tasks.add(task)
                task.add_done_callback(self._handler_tasks.discard)
            else:
                await answer(msg)

        async def answer(msg: Msg) -> None:
            with message_span(subject, msg.headers, SpanKind.SERVER):
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
                if not msg.reply:
                    return
                try:
                    await self._nc.publish(msg.reply, body, headers=headers)
                except _SEND_ERRORS:  # the link dropped meanwhile: the caller fails on its own
                    log.info("reply_dropped", subject=subject, reason="NATS link down")

        await self._subscribe(subject, queue, on_message)

    async def subscribe(self, subject: str, message_type: type[Req],
                        handler: Callable[[Req], Awaitable[None]], *, queue: str | None = None) -> None:
        """Receive published messages in order; a failing handler is logged, not fatal."""

        async def on_message(msg: Msg) -> None:
            with message_span(subject, msg.headers, SpanKind.CONSUMER):
                try:
                    await handler(decode(msg.data, message_type))
                except Exception:  # noqa: BLE001
                    log.exception("subscriber_failed", subject=subject)

        await self._subscribe(subject, queue, on_message)

    async def _subscribe(self, subject: str, queue: str | None, cb) -> None:
        sub = await self._nc.subscribe(subject, queue=queue or "", cb=cb)
        self._subscriptions.setdefault((subject, queue or ""), []).append(sub)

    async def unsubscribe(self, subject: str, *, queue: str | None = None) -> None:
        """Stop receiving on ``subject`` (as subscribed with ``queue``): a request to it
        goes to the other members of the queue group, or gets "no responders"."""
        for sub in self._subscriptions.pop((subject, queue or ""), []):
            try:
                await sub.unsubscribe()
            except (nats.errors.Error, *_SEND_ERRORS) as exc:
                log.info("unsubscribe_failed", subject=subject, error=repr(exc))


def _error_headers(exc: FlotillaError) -> dict[str, str]:
    return {ERROR_HEADER: _error_encoder.encode(exc.to_info()).decode()}


def _exit_process() -> None:
    """The default when NATS is gone for good: exit non-zero, so a supervisor restarts
    the process instead of it sitting there connected to nothing."""
    log.error("exiting", reason="the NATS connection was closed for good", code=EXIT_NATS_LOST)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_NATS_LOST)
