"""A stored response rebuilt from its messages in the response store (response_store.py),
in stream order: the events every gateway gives for it, numbered the same way, and its
body. Pure: no I/O.

The events are a function of the stored messages alone: each stored output is one delta
(nothing merged by timing, as a live stream merges what its client has not read), item
and call ids come from the response id, and the first gateway serves its own client
through this same replay. So a client that reconnects to any gateway with the last
``sequence_number`` it got (``starting_after``) receives exactly the rest.

What the records say (shared/response_messages.py): the start (how to rebuild the
request's choice), a move to another replica (only the newest attempt's outputs count
after it), a failure, a cancel. A scheduler's 503 output is not an end: the gateway that
took the request moves it (a mark follows) while it lives.
"""

from __future__ import annotations

import itertools
from typing import Any

import msgspec

from services.gateway import protocol
from services.gateway.choices import ChatChoice
from services.gateway.generation import Generation, chunk_event, error_event
from services.gateway.migration import RETRYABLE_STATUS
from services.gateway.responses import plan_response
from services.gateway.responses_output import ResponseOutput
from services.gateway.responses_schema import parse_request
from services.gateway.tool_calls import plan_tools
from services.gateway.streams import RequestStream, apply_output
from shared.detokenizer import IncrementalDetokenizer, TokenBytes
from shared.errors import FlotillaError
from shared.messages import ErrorInfo, OutputBatch, decode
from shared.response_messages import CANCELLED_CODE, ResponseMark, ResponseRecord, ResponseStart

_json = msgspec.json.Decoder()


def call_ids(request_id: str):
    """Tool-call ids from the request's id, in order: the same in every replay."""
    counter = itertools.count()
    return lambda: f"call_{request_id[:16]}{next(counter)}"


class StoredReplay:
    """One stored request's events and body, fed its stored messages in order. The kinds
    (a Responses response, a chat completion) say how a delta, the end, a failure and a
    cancel look."""

    def __init__(self, start: ResponseStart, decoder, token_bytes: TokenBytes) -> None:
        self.start = start
        self.token_bytes = token_bytes
        self.stream = RequestStream(start.request_id, IncrementalDetokenizer(
            decoder, start.prompt_tail, start.stop))
        self.attempt = start.request_id  # the attempt whose outputs count
        self.status = "in_progress"
        self.error: ErrorInfo | None = None

    @property
    def finished(self) -> bool:
        return self.status != "in_progress"

    @property
    def sequence_number(self) -> int:
        """The next event's number (events made so far)."""
        raise NotImplementedError

    def after(self, made: list[bytes], starting_after: int) -> list[bytes]:
        """Of the events just made, those numbered after ``starting_after`` (what a client
        that has that one and all before it still needs)."""
        first = self.sequence_number - len(made)
        return made[max(0, starting_after + 1 - first):]

    def feed(self, kind: str, data: bytes) -> list[bytes]:
        """The events one stored message makes (``kind``: "out" or "rec")."""
        if self.finished:
            return []
        if kind == "out":
            return self._outputs(decode(data, OutputBatch))
        record = decode(data, ResponseRecord)
        return self._mark(record) if isinstance(record, ResponseMark) else []

    def _outputs(self, batch: OutputBatch) -> list[bytes]:
        events: list[bytes] = []
        for output in batch.outputs:
            if self.finished or not self._counts(output.request_id):
                continue  # after the end, or a stale attempt's (it moved)
            if output.error is not None:
                if output.error.status != RETRYABLE_STATUS:  # would fail wherever it ran
                    events += self._fail(output.error)
                continue  # 503: its gateway moves it (a "migrated" mark comes)
            if not self.stream.has_output:
                self.stream.has_output = True
                self.stream.num_cached_tokens = output.num_cached_tokens
            apply_output(self.stream, output, self.token_bytes)
            delta = self.stream.take()
            if delta is not None:
                events += self.on_delta(delta)
            if self.stream.finished:
                self.status = "incomplete" if delta and delta.finish_reason == "length" \
                    else "completed"
                events += self.on_finish()
        return events

    def _counts(self, request_id: str) -> bool:
        """Whether an output of ``request_id`` counts: the current attempt's, or a later
        one's (its "migrated" mark was lost, say in a NATS outage: it moves on to that)."""
        number, current = attempt_number(self.start.request_id, request_id), \
            attempt_number(self.start.request_id, self.attempt)
        if number is not None and number > current:
            self.attempt = request_id
        return request_id == self.attempt

    def _mark(self, mark: ResponseMark) -> list[bytes]:
        if mark.event == "migrated":
            self.attempt = mark.request_id
            return []
        if mark.event == "cancelled":
            self.status = "cancelled"
            return self.on_cancel()
        return self._fail(mark.error or ErrorInfo(status=500, message="the response failed"))

    def _fail(self, error: ErrorInfo) -> list[bytes]:
        self.status, self.error = "failed", error
        return self.failed(FlotillaError.from_info(error))

    # the kind's events
    def opening(self) -> list[bytes]:
        raise NotImplementedError

    def on_delta(self, delta) -> list[bytes]:
        raise NotImplementedError

    def on_finish(self) -> list[bytes]:
        raise NotImplementedError

    def on_cancel(self) -> list[bytes]:
        raise NotImplementedError

    def failed(self, error: FlotillaError) -> list[bytes]:
        """The events that end a stream with ``error`` (also a reader's own idle timeout)."""
        raise NotImplementedError

    def body(self) -> dict[str, Any]:
        raise NotImplementedError


class ResponseReplay(StoredReplay):
    """A /v1/responses response: OpenAI's events, each with its ``sequence_number``."""

    def __init__(self, start: ResponseStart, decoder, token_bytes: TokenBytes) -> None:
        super().__init__(start, decoder, token_bytes)
        req = parse_request(_json.decode(start.body), accept_unknown_fields=True)
        plan = plan_response(req, store_available=True)
        choice = ChatChoice(0, plan.num_logprobs, plan.tool_plan, call_ids(start.request_id))
        generation = Generation("responses", start.response_id, start.model, [choice],
                                [self.stream], start.num_prompt_tokens, 1,
                                created=start.created)
        self.output = ResponseOutput(generation, _json.decode(start.echo))

    @property
    def sequence_number(self) -> int:
        return self.output.sequence_number

    def opening(self) -> list[bytes]:
        """response.created and response.in_progress (numbers 0 and 1)."""
        return self.output.start()

    def on_delta(self, delta) -> list[bytes]:
        return self.output.on_delta(delta)

    def on_finish(self) -> list[bytes]:
        return self.output.finish()

    def on_cancel(self) -> list[bytes]:
        return [self.output.event("error", code=CANCELLED_CODE,
                                  message="the response was cancelled", param=None)]

    def failed(self, error: FlotillaError) -> list[bytes]:
        return self.output.failed(error)

    def body(self) -> dict[str, Any]:
        """The response object as its messages so far make it."""
        body = self.output.body(self.status)
        if self.error is not None:
            body["error"] = {"code": self.error.code or "server_error",
                             "message": self.error.message}
        return body


class ChatReplay(StoredReplay):
    """A stored chat completion: its SSE chunks, each with an ``id:`` (its number, what a
    client's ``Last-Event-ID`` names), ending ``data: [DONE]``."""

    def __init__(self, start: ResponseStart, decoder, token_bytes: TokenBytes) -> None:
        super().__init__(start, decoder, token_bytes)
        req = protocol.parse_request(protocol.ChatCompletionRequest, _json.decode(start.body),
                                     accept_unknown_fields=True)
        tool_plan = plan_tools(*req.tools_and_choice(), req.parallel_tool_calls)
        self.choice = ChatChoice(0, req.num_logprobs, tool_plan, call_ids(start.request_id))
        # the gathered body's (its parser reads the whole text at the end, as gather's does)
        self.gathered = ChatChoice(0, req.num_logprobs, tool_plan, call_ids(start.request_id))
        self.generation = Generation("chat", start.response_id, start.model, [self.choice],
                                     [self.stream], start.num_prompt_tokens, 1,
                                     req.include_usage, req.continuous_usage,
                                     created=start.created)
        self._num_events = 0

    @property
    def sequence_number(self) -> int:
        return self._num_events

    def _numbered(self, events: list[bytes]) -> list[bytes]:
        first, self._num_events = self._num_events, self._num_events + len(events)
        return [b"id: %d\n" % (first + i) + event for i, event in enumerate(events)]

    def opening(self) -> list[bytes]:
        return self._numbered([chunk_event(self.generation, [self.choice.first_entry()])])

    def on_delta(self, delta) -> list[bytes]:
        self.gathered.record(delta)
        return self._numbered([chunk_event(self.generation, [entry])
                               for entry in self.choice.on_delta(delta)])

    def on_finish(self) -> list[bytes]:
        tail = [chunk_event(self.generation, [], self.generation.usage())] \
            if self.generation.include_usage else []
        return self._numbered([*tail, b"data: [DONE]\n\n"])

    def on_cancel(self) -> list[bytes]:
        return self.failed(FlotillaError("the completion was cancelled", code=CANCELLED_CODE,
                                         status=499))

    def failed(self, error: FlotillaError) -> list[bytes]:
        return self._numbered([error_event(error)])

    def body(self) -> dict[str, Any]:
        """The chat completion object as its messages so far make it."""
        entry = {**self.gathered.final(), "index": 0}
        body = {"id": self.start.response_id, "object": "chat.completion",
                "created": self.start.created, "model": self.start.model, "choices": [entry],
                "usage": self.generation.usage(), "status": self.status}
        if self.error is not None:
            body["error"] = FlotillaError.from_info(self.error).openai_body()["error"]
        return body


def attempt_number(request_id: str, attempt_id: str) -> int | None:
    """0 for the request's first attempt, k for its k-th move (migration.py names it
    ``{id}-m{k}``); None for an id not of this request."""
    if attempt_id == request_id:
        return 0
    suffix = attempt_id.removeprefix(request_id + "-m")
    return int(suffix) if suffix != attempt_id and suffix.isdigit() else None


def replay_of(start: ResponseStart, decoder, token_bytes: TokenBytes) -> StoredReplay:
    """The replay for a stored request of this kind."""
    return (ChatReplay if start.kind == "chat" else ResponseReplay)(start, decoder, token_bytes)


def first_record(data: bytes) -> ResponseStart:
    """The response's first stored message, which its gateway wrote before submitting."""
    record = decode(data, ResponseRecord)
    if not isinstance(record, ResponseStart):
        raise FlotillaError("the stored response has no start record")
    return record
