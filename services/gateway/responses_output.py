"""A /v1/responses generation to the client: output items built from the chat choice's
fragments (text, tool calls), as OpenAI's stream events or one gathered response object.

One ``ResponseOutput`` per response holds its output items; each step returns the events
it made (already encoded, so an event shows an item as it was then). The gathered body is
the same builder with its events dropped, so a streamed and a gathered response agree.
The body's schema (for /openapi.json) is in responses_schema.py.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import structlog

from services.gateway.choices import ChatChoice
from services.gateway.generation import Generation, OutputShape
from services.gateway.streams import Delta
from shared.errors import FlotillaError

log = structlog.get_logger()
_json = msgspec.json.Encoder()


def _item_id(prefix: str, response_id: str, output_index: int) -> str:
    """An output item's id, made from its response's and its place: a replay of a stored
    response (response_replay.py) names its items as the first telling did."""
    return f"{prefix}{response_id.removeprefix('resp_')}_{output_index}"


class ResponseOutput:
    """The output items of one response and the stream events that build them."""

    def __init__(self, generation: Generation, echo: dict[str, Any]) -> None:
        self.generation = generation
        self.choice: ChatChoice = generation.choices[0]
        self.echo = echo  # request fields a response repeats (instructions, tools, ...)
        self.created_at = generation.created
        self.items: list[dict[str, Any]] = []
        self.sequence_number = 0
        self._message: int | None = None  # output index of the message being written
        self._calls: dict[int, int] = {}  # chat tool-call index -> output index
        self._open_calls: list[int] = []

    # ------------------------------------------------------------------ events
    def event(self, type_: str, **fields: Any) -> bytes:
        fields = {"type": type_, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + type_.encode() + b"\ndata: " + _json.encode(fields) + b"\n\n"

    def start(self) -> list[bytes]:
        body = self.body("in_progress")
        return [self.event("response.created", response=body),
                self.event("response.in_progress", response=body)]

    def on_delta(self, delta: Delta) -> list[bytes]:
        events: list[bytes] = []
        for entry in self.choice.on_delta(delta):
            fragment = entry["delta"]
            if "content" in fragment:
                logprobs = entry["logprobs"]["content"] if entry["logprobs"] else []
                if fragment["content"] or logprobs:  # (chat's empty chunks: no event here)
                    events += self._text(fragment["content"], logprobs)
            for call in fragment.get("tool_calls", ()):
                events += self._call(call)
        return events

    def finish(self) -> list[bytes]:
        """Close what is open and end with response.completed (or .incomplete)."""
        status = "incomplete" if self.choice.finish_reason == "length" else "completed"
        events = self._close_calls(status) + self._close_message(status)
        if not self.items:  # nothing written: an empty message, as the gathered body has
            events += self._open_message() + self._close_message(status)
        return events + [self.event(f"response.{status}", response=self.body(status))]

    def failed(self, error: FlotillaError) -> list[bytes]:
        body = self.body("failed")
        body["error"] = {"code": "rate_limit_exceeded" if error.status == 429 else "server_error",
                         "message": error.message}
        return [self.event("error", code=error.code or error.type, message=error.message,
                           param=error.param),
                self.event("response.failed", response=body)]

    # ------------------------------------------------------------------ items
    def _open_message(self) -> list[bytes]:
        self._message = len(self.items)
        item = {"id": _item_id("msg_", self.generation.response_id, self._message),
                "type": "message", "status": "in_progress", "role": "assistant", "content": []}
        self.items.append(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = [self.event("response.output_item.added", output_index=self._message,
                             item=item),
                  self.event("response.content_part.added", item_id=item["id"],
                             output_index=self._message, content_index=0, part=part)]
        item["content"].append(part)
        return events

    def _text(self, text: str, logprobs: list[dict]) -> list[bytes]:
        events = self._close_calls("completed")
        if self._message is None:
            events += self._open_message()
        item = self.items[self._message]
        part = item["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        return events + [self.event("response.output_text.delta", item_id=item["id"],
                                    output_index=self._message, content_index=0, delta=text,
                                    logprobs=logprobs)]

    def _close_message(self, status: str) -> list[bytes]:
        if self._message is None:
            return []
        index, self._message = self._message, None
        item = self.items[index]
        part = item["content"][0]
        item["status"] = status
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self.event("response.output_text.done", **where, text=part["text"],
                           logprobs=part["logprobs"]),
                self.event("response.content_part.done", **where, part=part),
                self.event("response.output_item.done", output_index=index, item=item)]

    def _call(self, call: dict[str, Any]) -> list[bytes]:
        """A chat tool-call fragment: a new call (id and name) or more of its arguments."""
        events: list[bytes] = []
        if "id" in call:
            events += self._close_message("completed")
            index = self._calls[call["index"]] = len(self.items)
            item = {"id": _item_id("fc_", self.generation.response_id, index),
                    "type": "function_call", "status": "in_progress", "call_id": call["id"],
                    "name": call["function"]["name"], "arguments": ""}
            self.items.append(item)
            self._open_calls.append(index)
            events.append(self.event("response.output_item.added", output_index=index,
                                     item=item))
        arguments = call.get("function", {}).get("arguments", "")
        if arguments:
            index = self._calls[call["index"]]
            item = self.items[index]
            item["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta",
                                     item_id=item["id"], output_index=index, delta=arguments))
        return events

    def _close_calls(self, status: str) -> list[bytes]:
        events = []
        for index in self._open_calls:
            item = self.items[index]
            item["status"] = status
            events += [self.event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=index, name=item["name"],
                                  arguments=item["arguments"]),
                       self.event("response.output_item.done", output_index=index, item=item)]
        self._open_calls = []
        return events

    # ------------------------------------------------------------------ body
    def body(self, status: str) -> dict[str, Any]:
        """The response object as it stands (``status``: in_progress, completed, ...)."""
        finished = status in ("completed", "incomplete")
        return {
            "id": self.generation.response_id, "object": "response",
            "created_at": self.created_at, "status": status,
            "completed_at": int(time.time()) if finished else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete" else None,
            "model": self.generation.model, "output": self.items if finished else [],
            **self.echo,
            "usage": self.usage() if finished else None,
        }

    def usage(self) -> dict[str, Any]:
        usage = self.generation.usage()
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {
                    "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                    "cache_write_tokens": 0},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": usage["total_tokens"]}


def responses_shape(echo: dict[str, Any]) -> OutputShape:
    """How a /v1/responses generation reaches its client (``echo``: the request fields a
    response repeats)."""

    async def events(generation: Generation,
                     deltas: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[bytes]:
        output = ResponseOutput(generation, echo)
        yield b"".join(output.start())
        try:
            async for _, delta in deltas:
                if delta.error is not None:
                    yield b"".join(output.failed(FlotillaError.from_info(delta.error)))
                    return  # failed ends the stream
                made = output.on_delta(delta)
                if made:
                    yield b"".join(made)
        except FlotillaError as exc:
            yield b"".join(output.failed(exc))
            return
        except Exception as exc:  # noqa: BLE001 - a stream never ends silently
            log.exception("stream_failed", response_id=generation.response_id)
            yield b"".join(output.failed(FlotillaError(
                f"the stream failed: {type(exc).__name__}: {exc}")))
            return
        yield b"".join(output.finish())

    async def gather(generation: Generation,
                     deltas: AsyncIterator[tuple[int, Delta]]) -> dict[str, Any]:
        output = ResponseOutput(generation, echo)
        async for _, delta in deltas:
            if delta.error is not None:
                raise FlotillaError.from_info(delta.error)
            output.on_delta(delta)
        output.finish()
        status = "incomplete" if output.choice.finish_reason == "length" else "completed"
        return output.body(status)

    return OutputShape(events, gather)
