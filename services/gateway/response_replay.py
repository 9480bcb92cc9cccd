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

from services.gateway.choices import ChatChoice
from services.gateway.generation import Generation
from services.gateway.migration import RETRYABLE_STATUS
from services.gateway.responses import plan_response
from services.gateway.responses_output import ResponseOutput
from services.gateway.responses_schema import parse_request
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


class ResponseReplay:
    """One response's events and body, fed its stored messages in order."""

    def __init__(self, start: ResponseStart, decoder, token_bytes: TokenBytes) -> None:
        req = parse_request(_json.decode(start.body), accept_unknown_fields=True)
        plan = plan_response(req, store_available=True)
        self.start = start
        self.token_bytes = token_bytes
        self.stream = RequestStream(start.request_id, IncrementalDetokenizer(
            decoder, start.prompt_tail, start.stop))
        choice = ChatChoice(0, plan.num_logprobs, plan.tool_plan, call_ids(start.request_id))
        generation = Generation("responses", start.response_id, start.model, [choice],
                                [self.stream], start.num_prompt_tokens, 1,
                                created=start.created)
        self.output = ResponseOutput(generation, _json.decode(start.echo))
        self.attempt = start.request_id  # the attempt whose outputs count
        self.status = "in_progress"
        self.error: ErrorInfo | None = None
        self.num_output_tokens = 0

    @property
    def finished(self) -> bool:
        return self.status != "in_progress"

    @property
    def sequence_number(self) -> int:
        """The next event's number (events made so far)."""
        return self.output.sequence_number

    def after(self, made: list[bytes], starting_after: int) -> list[bytes]:
        """Of the events just made, those numbered after ``starting_after`` (what a client
        that has that one and all before it still needs)."""
        first = self.sequence_number - len(made)
        return made[max(0, starting_after + 1 - first):]

    def opening(self) -> list[bytes]:
        """response.created and response.in_progress (numbers 0 and 1)."""
        return self.output.start()

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
            if output.request_id != self.attempt or self.finished:
                continue  # a stale attempt's (it moved), or after the end
            if output.error is not None:
                if output.error.status != RETRYABLE_STATUS:  # would fail wherever it ran
                    events += self._fail(output.error)
                continue  # 503: its gateway moves it (a "migrated" mark comes)
            if not self.stream.has_output:
                self.stream.has_output = True
                self.stream.num_cached_tokens = output.num_cached_tokens
            apply_output(self.stream, output, self.token_bytes)
            self.num_output_tokens = len(self.stream.output_token_ids)
            delta = self.stream.take()
            if delta is not None:
                events += self.output.on_delta(delta)
            if self.stream.finished:
                events += self.output.finish()
                self.status = "incomplete" if delta and delta.finish_reason == "length" \
                    else "completed"
        return events

    def _mark(self, mark: ResponseMark) -> list[bytes]:
        if mark.event == "migrated":
            self.attempt = mark.request_id
            return []
        if mark.event == "cancelled":
            self.status = "cancelled"
            return [self.output.event("error", code=CANCELLED_CODE,
                                      message="the response was cancelled", param=None)]
        return self._fail(mark.error or ErrorInfo(message="the response failed"))

    def _fail(self, error: ErrorInfo) -> list[bytes]:
        self.status, self.error = "failed", error
        return self.output.failed(FlotillaError.from_info(error))

    def body(self) -> dict[str, Any]:
        """The response object as its messages so far make it."""
        if self.status in ("completed", "incomplete"):
            return self.output.body(self.status)
        body = self.output.body(self.status)
        if self.error is not None:
            body["error"] = {"code": self.error.code or "server_error",
                             "message": self.error.message}
        return body


def first_record(data: bytes) -> ResponseStart:
    """The response's first stored message, which its gateway wrote before submitting."""
    record = decode(data, ResponseRecord)
    if not isinstance(record, ResponseStart):
        raise FlotillaError("the stored response has no start record")
    return record
