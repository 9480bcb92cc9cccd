"""Stored and background responses (docs/openai-api.md): ``POST /v1/responses`` with
``store`` or ``background`` true, ``GET /v1/responses/{id}`` (the body, or with
``stream=true`` its events after ``starting_after``), ``POST /v1/responses/{id}/cancel``.

A stored request's start is written to the response store (response_store.py) before it
is submitted; the scheduler's outputs for it go to the store too. The gateway that took
it runs it to its end apart from any client (a background task: the client may leave,
and migration still works while this gateway lives), and every client, its own included,
reads the response from the store (response_replay.py). So any gateway answers for any
stored response, and a gateway's death loses none: the scheduler keeps going.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import AsyncIterator

import msgspec
import structlog
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from services.gateway.openapi import json_responses
from services.gateway.response_models import ChatCompletion, ChatCompletionChunk
from services.gateway.response_replay import (ResponseReplay, StoredReplay, first_record,
                                              replay_of)
from services.gateway.response_store import StoredMessages
from services.gateway.responses_schema import ResponseObject, openapi_responses
from services.gateway.service import GatewayService
from services.gateway.streams import RequestStream
from shared.detokenizer import NUM_PROMPT_CONTEXT_TOKENS
from shared.errors import FlotillaError, InvalidRequest
from shared.messages import ImageInput, SamplingParams
from shared.response_messages import CANCELLED_CODE, ResponseMark, ResponseStart

log = structlog.get_logger()
router = APIRouter()
_PREFIXES = {"responses": "resp_", "chat": "chatcmpl-"}  # a stored id: prefix + 32 hex digits
_json = msgspec.json.Encoder()


class StoredSubmission(msgspec.Struct, frozen=True, kw_only=True):
    """A Responses request ready to run, and what its replays need."""

    kind: str  # "responses" or "chat"
    body: dict  # the request's JSON, as received
    echo: dict
    prompt_ids: list[int]
    sampling: SamplingParams
    model: str
    lora_name: str = ""
    session: str | None = None
    stop: list[str] = []
    priority: int = 0
    cache_salt: str | None = None
    images: list[ImageInput] = []
    stream: bool = False
    background: bool = False


async def create_stored(service: GatewayService, sub: StoredSubmission, drain) -> Response:
    """Run a stored request: record its start, submit it, keep it running apart from the
    client (``drain(stream)``: the deltas it reads to the end), answer from the store."""
    request_id = uuid.uuid4().hex
    start = ResponseStart(
        kind=sub.kind, response_id=_PREFIXES[sub.kind] + request_id, request_id=request_id,
        model=sub.model, created=int(time.time()), body=_json.encode(sub.body),
        echo=_json.encode(sub.echo), prompt_tail=sub.prompt_ids[-NUM_PROMPT_CONTEXT_TOKENS:],
        stop=sub.stop, num_prompt_tokens=len(sub.prompt_ids), background=sub.background)
    gateway_id = service.config.instance_id
    await service.store.record(gateway_id, request_id, start)
    try:
        _, streams = await service.submit(
            sub.prompt_ids, sub.sampling, sub.stop, priority=sub.priority,
            cache_salt=sub.cache_salt, session=sub.session, lora_name=sub.lora_name,
            images=list(sub.images), stored_id=request_id)
    except FlotillaError as exc:
        await service.store.mark(gateway_id, request_id,
                                 ResponseMark(event="failed", error=exc.to_info()))
        raise
    streams[0].wake_at_end = True  # read by no client: woken once, at its end
    service.store.run_in_background(_run_to_end(service, streams[0], drain(streams[0])),
                                    streams[0])
    if sub.stream:
        messages = await _open(service, request_id, start.response_id)
        return StreamingResponse(replay_events(service, messages, -1),
                                 media_type="text/event-stream")
    if sub.background:
        return JSONResponse(ResponseReplay(start, service.decoder, service.token_bytes)
                            .output.body("queued"))
    replay, _ = await read_stored(service, request_id, start.response_id, wait=True)
    return JSONResponse(_answer(replay))


def _answer(replay: StoredReplay) -> dict:
    """A stored request's body for its own POST: a chat completion has no status."""
    body = replay.body()
    if replay.start.kind == "chat":
        body.pop("status", None)
    return body


async def _run_to_end(service: GatewayService, stream: RequestStream,
                      deltas: AsyncIterator) -> None:
    """Read a stored request's deltas to its end; a failure is written to the store (its
    replays end with it), a cancel is there already."""
    error = None
    async for _, delta in deltas:
        error = delta.error or error
    if error is not None and error.code != CANCELLED_CODE:
        await service.store.mark(service.config.instance_id, stream.stored_id,
                                 ResponseMark(event="failed", error=error))


# ---------------------------------------------------------------- reading the store
def _request_id(response_id: str, kind: str) -> str:
    match = re.fullmatch(re.escape(_PREFIXES[kind]) + "([0-9a-f]{32})", response_id)
    if match is None:
        raise _not_found(response_id)
    return match.group(1)


def _not_found(response_id: str) -> FlotillaError:
    return InvalidRequest(f"No stored response or completion with id '{response_id}' (they "
                          "are kept for --response-retention-s after they start)",
                          status=404, param="response_id", code="response_not_found")


async def _open(service: GatewayService, request_id: str, response_id: str) -> StoredMessages:
    if not service.store.enabled:
        raise InvalidRequest("this deployment keeps no responses (no NATS JetStream, or "
                             "--response-retention-s 0)", status=404, param="response_id",
                             code="response_not_found")
    messages = await service.store.open(request_id)
    if messages is None:
        raise _not_found(response_id)
    return messages


async def read_stored(service: GatewayService, request_id: str, response_id: str, wait: bool
                      ) -> tuple[StoredReplay, str]:
    """The response as stored now (``wait``: once it has ended), and the gateway that
    took it."""
    messages = await _open(service, request_id, response_id)
    try:
        first = await messages.next()
        replay = _replay(first.data, response_id, service)
        pending = first.num_pending
        while not replay.finished and (wait or pending):
            message = await messages.next()
            replay.feed(message.kind, message.data)
            pending = message.num_pending
        return replay, first.gateway_id
    finally:
        await messages.close()


async def replay_events(service: GatewayService, messages: StoredMessages,
                        starting_after: int, response_id: str = "") -> AsyncIterator[bytes]:
    """A stored response's events numbered after ``starting_after``, as they are stored,
    to its end (or a 503 error event when none comes for the idle timeout)."""
    try:
        replay = None
        first = await messages.next()
        start = first_record(first.data)
        if response_id and start.response_id != response_id:  # (the other kind's id)
            raise _not_found(response_id)
        replay = replay_of(start, service.decoder, service.token_bytes)
        made = replay.opening()
        while True:
            fresh = replay.after(made, starting_after)
            if fresh:
                yield b"".join(fresh)
            if replay.finished:
                return
            message = await messages.next()
            made = replay.feed(message.kind, message.data)
    except FlotillaError as exc:  # the store went away, or the response went quiet
        if replay is not None:
            yield b"".join(replay.failed(exc))
        else:
            yield b"data: " + _json.encode(exc.openai_body()) + b"\n\n"
    finally:
        await messages.close()


def _replay(data: bytes, response_id: str, service: GatewayService) -> StoredReplay:
    """The replay of a stored request found under ``response_id`` (of the route's kind:
    a chat completion's id does not name a response)."""
    start = first_record(data)
    if start.response_id != response_id:
        raise _not_found(response_id)
    return replay_of(start, service.decoder, service.token_bytes)


# ---------------------------------------------------------------- routes
@router.get("/v1/responses/{response_id}", response_model=None, responses=openapi_responses())
async def get_response(response_id: str, request: Request) -> Response:
    """The stored response; with ``stream=true``, its events after ``starting_after``
    (replayed from the store, then live until it ends)."""
    return await _get(request, response_id, "responses",
                      request.query_params.get("starting_after"), "starting_after")


@router.get("/v1/chat/completions/{completion_id}", response_model=None,
            responses=json_responses(ChatCompletion, stream=ChatCompletionChunk))
async def get_chat_completion(completion_id: str, request: Request) -> Response:
    """A stored chat completion (``store: true``); with ``stream=true``, its chunks after
    the one whose ``id:`` the ``Last-Event-ID`` header names (all without it)."""
    return await _get(request, completion_id, "chat", request.headers.get("last-event-id"),
                      "Last-Event-ID")


async def _get(request: Request, response_id: str, kind: str, starting_after: str | None,
               param: str) -> Response:
    service: GatewayService = request.app.state.service
    request_id = _request_id(response_id, kind)
    if not _flag(request.query_params.get("stream", "false"), "stream"):
        replay, _ = await read_stored(service, request_id, response_id, wait=False)
        return JSONResponse(replay.body())
    after = _starting_after(starting_after, param)
    messages = await _open(service, request_id, response_id)
    return StreamingResponse(replay_events(service, messages, after, response_id),
                             media_type="text/event-stream")


@router.post("/v1/responses/{response_id}/cancel", response_model=None,
             responses=json_responses(ResponseObject))
async def cancel_response(response_id: str, request: Request) -> Response:
    """Cancel a stored response still running (at most one more step runs): its record
    says cancelled, every replica aborts it, its gateway ends it. Cancelling a cancelled
    one returns it again; a finished one is a 400."""
    service: GatewayService = request.app.state.service
    request_id = _request_id(response_id, "responses")
    replay, gateway_id = await read_stored(service, request_id, response_id, wait=False)
    if replay.status == "cancelled":
        return JSONResponse(replay.body())
    if replay.finished:
        raise InvalidRequest(f"Cannot cancel a response that is already {replay.status}",
                             param="response_id", code="response_not_cancellable")
    await service.store.record(gateway_id, request_id,
                               ResponseMark(event="cancelled", request_id=request_id))
    max_attempts = service.config.migration_limit
    await service.store.abort_everywhere(
        [stats.scheduler_id for stats in service.live_schedulers()],
        [request_id] + [f"{request_id}-m{attempt}" for attempt in range(1, max_attempts + 1)])
    replay.status = "cancelled"
    log.info("response_cancelled", request_id=request_id, gateway_id=gateway_id)
    return JSONResponse(replay.body())


def _flag(value: str, param: str) -> bool:
    if value not in ("true", "false"):
        raise InvalidRequest(f"{param} must be true or false", param=param, code="invalid_value")
    return value == "true"


def _starting_after(value: str | None, param: str) -> int:
    if value is None:
        return -1
    if not value.isdigit():
        raise InvalidRequest(f"{param} must be a non-negative integer (an event's number)",
                             param=param, code="invalid_value")
    return int(value)

