"""Stored responses in NATS JetStream: the gateway's bus client for them (docs/openai-api.md).

One stream, ``{ns}_responses``, keeps every message under ``{ns}.v1.resp.>`` for the
retention (``--response-retention-s``, JetStream's max_age): the outputs the schedulers
publish for a stored request (its ``output_subject`` is ``...resp.{gateway}.{id}.out``, so
the publishers are unchanged: the stream captures core publishes) and the gateways'
records beside them (``....rec``, acknowledged writes). Any gateway replays one response
from its first message with an ordered consumer filtered on ``...resp.*.{id}.*`` and
follows it live; response_replay.py (pure) turns the messages into the response's events.

Without JetStream (a nats-server started without -js) the store is off: the gateway
serves as before and refuses store/background with a 400.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import structlog
from nats.js.api import DeliverPolicy, DiscardPolicy, StorageType, StreamConfig

from shared.bus import Bus
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import (AbortRequest, Empty, ErrorInfo, GenerateRequest, OutputBatch,
                             encode)
from shared.response_messages import CANCELLED_CODE, ResponseMark, ResponseRecord
from shared.subjects import Subjects

log = structlog.get_logger()
SETUP_TIMEOUT_S = 5.0
SETUP_RETRY_S = 5.0  # while NATS has no JetStream (yet)
CANCELLED = ErrorInfo(status=499, message="the response was cancelled", code=CANCELLED_CODE)


@dataclass(frozen=True)
class StoredMessage:
    kind: str  # "out" (an OutputBatch from a scheduler) or "rec" (a ResponseRecord)
    data: bytes
    gateway_id: str  # the gateway that took the request (its subject's token)
    num_pending: int  # messages of this response stored after this one, when it was sent


class StoredMessages:
    """One response's messages, the first one first, then live as they are stored."""

    def __init__(self, subscription, idle_timeout_s: float) -> None:
        self._sub = subscription
        self.idle_timeout_s = idle_timeout_s

    async def next(self, timeout_s: float | None = None) -> StoredMessage:
        """The next message; ServiceUnavailable when none comes within the idle timeout."""
        timeout_s = self.idle_timeout_s if timeout_s is None else timeout_s
        try:
            msg = await self._sub.next_msg(timeout=timeout_s)
        except (nats.errors.TimeoutError, asyncio.TimeoutError) as exc:
            raise ServiceUnavailable(f"the response got no output for {timeout_s:g}s (its "
                                     "replica may have died with its gateway)") from exc
        tokens = msg.subject.split(".")
        return StoredMessage(tokens[-1], msg.data, tokens[-3], msg.metadata.num_pending)

    async def close(self) -> None:
        try:
            await self._sub.unsubscribe()
        except (nats.errors.Error, nats.js.errors.Error):
            pass  # the link dropped: the consumer goes with its inactivity


class ResponseStore:
    def __init__(self, bus: Bus, subjects: Subjects, retention_s: float, num_replicas: int,
                 idle_timeout_s: float) -> None:
        self.bus, self.subjects = bus, subjects
        self.retention_s, self.num_replicas = retention_s, num_replicas
        self.idle_timeout_s = idle_timeout_s
        self.enabled = False
        self._js = None
        self._runs: dict[asyncio.Task, object] = {}  # stored requests run to their end
        self._retry: asyncio.Task | None = None  # setting the stream up again, while it fails
        self._followed: set[str] = set()

    def run_in_background(self, coro, stream) -> None:
        """Run ``coro`` (reading ``stream`` to its end) apart from any client."""
        task = asyncio.create_task(coro)
        self._runs[task] = stream
        task.add_done_callback(lambda done: self._runs.pop(done, None))

    def stop(self) -> None:
        """The gateway stops: its stored requests run on at their schedulers (marked
        finished here, so nothing aborts them); any gateway serves them from the store."""
        for task, stream in list(self._runs.items()):
            stream.finished = True
            task.cancel()
        if self._retry is not None:
            self._retry.cancel()

    async def start(self, on_ready: Callable[[], Awaitable[None]]) -> bool:
        """Create (or update to our retention) the responses stream, run ``on_ready`` (the
        gateway subscribes), then take stored requests. False when the retention is 0, or
        NATS has no JetStream yet: then it is tried again every SETUP_RETRY_S (a NATS
        cluster electing its JetStream leader; a server without -js stays without)."""
        if self.retention_s <= 0:
            return False
        if await self._set_up(on_ready, log_failure=True):
            return True
        self._retry = asyncio.create_task(self._retry_set_up(on_ready))
        return False

    async def _retry_set_up(self, on_ready) -> None:
        while not await self._set_up(on_ready, log_failure=False):
            await asyncio.sleep(SETUP_RETRY_S)

    async def _set_up(self, on_ready, log_failure: bool) -> bool:
        config = StreamConfig(
            name=self.subjects.response_stream, subjects=[self.subjects.response_stream_subjects],
            max_age=self.retention_s, storage=StorageType.FILE, num_replicas=self.num_replicas,
            discard=DiscardPolicy.OLD, allow_direct=True)
        try:
            self._js = self.bus.jetstream(timeout_s=SETUP_TIMEOUT_S)
            try:
                await self._js.add_stream(config)
            except nats.js.errors.BadRequestError:  # there, with other settings: ours win
                await self._js.update_stream(config)
            await on_ready()
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError,
                ServiceUnavailable) as exc:
            if log_failure:
                log.warning("response_store_off", reason=repr(exc), retry_s=SETUP_RETRY_S,
                            hint="run nats-server with JetStream (-js) for stored responses")
            return False
        self.enabled = True
        log.info("response_store_on", stream=config.name, retention_s=self.retention_s,
                 replicas=self.num_replicas)
        return True

    async def record(self, gateway_id: str, request_id: str, record: ResponseRecord) -> None:
        """Append a record, acknowledged by JetStream (ServiceUnavailable if it is not)."""
        try:
            await self._js.publish(self.subjects.response_records(gateway_id, request_id),
                                   encode(record), timeout=SETUP_TIMEOUT_S)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            raise ServiceUnavailable(f"the response store did not take a record: {exc!r}",
                                     code="response_store_unavailable") from exc

    async def follow(self, gateway_id: str, on_outputs, on_cancel) -> None:
        """Hear this gateway's stored requests live: their outputs (``on_outputs``, as the
        gateway's own outputs subject), and cancels from any gateway (``on_cancel(id)``)."""
        async def on_record(record: ResponseRecord) -> None:
            if isinstance(record, ResponseMark) and record.event == "cancelled":
                on_cancel(record.request_id)

        for kind, message_type, handler in (("out", OutputBatch, on_outputs),
                                            ("rec", ResponseRecord, on_record)):
            subject = self.subjects.gateway_response_outputs(gateway_id, kind)
            if subject not in self._followed:  # (once, though a set-up is tried again)
                await self.bus.subscribe(subject, message_type, handler)
                self._followed.add(subject)

    async def mark(self, gateway_id: str, request_id: str, mark: ResponseMark) -> None:
        """A record the stream should have but whose loss breaks nothing at once (a move,
        a failure): logged, not raised, when the store does not take it."""
        try:
            await self.record(gateway_id, request_id, mark)
        except ServiceUnavailable as exc:
            log.warning("response_mark_lost", request_id=request_id, event=mark.event,
                        error=exc.message)

    async def moved(self, gateway_id: str, stored_id: str, request: GenerateRequest) -> None:
        """A stored request moved to another replica as ``request`` (its new attempt)."""
        await self.mark(gateway_id, stored_id, ResponseMark(
            event="migrated", request_id=request.request_id,
            num_output_tokens=len(request.output_token_ids)))

    async def abort_everywhere(self, scheduler_ids: list[str], request_ids: list[str]) -> None:
        """Abort these at every one of these schedulers (a cancel, from any gateway: the one
        that submitted it may be gone, so which replica runs it is not known here)."""
        async def abort(scheduler_id: str) -> None:
            try:
                await self.bus.request(self.subjects.scheduler_abort(scheduler_id),
                                       AbortRequest(request_ids=request_ids), Empty,
                                       timeout=SETUP_TIMEOUT_S)
            except FlotillaError as exc:
                log.warning("abort_failed", request_ids=request_ids, error=exc.message)

        await asyncio.gather(*(abort(scheduler_id) for scheduler_id in scheduler_ids))

    async def exists(self, request_id: str) -> bool:
        """Whether the stream holds messages of this response (it is gone after the
        retention)."""
        try:
            info = await self._js.stream_info(self.subjects.response_stream,
                                              subjects_filter=self.subjects.response_all(request_id))
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            raise ServiceUnavailable(f"the response store is unavailable: {exc!r}",
                                     code="response_store_unavailable") from exc
        return bool(info.state.subjects)

    async def open(self, request_id: str) -> StoredMessages | None:
        """Its messages from the first (None: no such response, or expired)."""
        if not await self.exists(request_id):
            return None
        try:
            sub = await self._js.subscribe(
                self.subjects.response_all(request_id), stream=self.subjects.response_stream,
                ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        except (nats.errors.Error, nats.js.errors.Error, asyncio.TimeoutError) as exc:
            raise ServiceUnavailable(f"the response store is unavailable: {exc!r}",
                                     code="response_store_unavailable") from exc
        return StoredMessages(sub, self.idle_timeout_s)
