"""A request's choices from the deltas of its sequences to the client: SSE chunks, or one
gathered response (with best_of, the n sequences of highest cumulative logprob).

A completions request may carry a batch of prompts: its choices are grouped by prompt
(``num_per_prompt`` sequences each, in prompt order), and best_of picks within each group.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import structlog

from services.gateway.choices import ChatChoice, CompletionChoice
from services.gateway.streams import Delta, RequestStream
from shared.errors import FlotillaError

_DONE = object()
log = structlog.get_logger()


@dataclass
class Generation:
    kind: str  # "chat", "completions" or "responses"
    response_id: str
    model: str
    choices: list[ChatChoice] | list[CompletionChoice]
    streams: list[RequestStream]  # one per choice, same order
    num_prompt_tokens: int  # over all prompts
    num_returned: int  # n per prompt: fewer than its sequences when best_of asked for more
    include_usage: bool = False
    continuous_usage: bool = False  # every chunk carries the usage so far (include_usage too)
    created: int = field(default_factory=lambda: int(time.time()))
    num_per_prompt: int = 0  # sequences per prompt (0: all the choices are one prompt's)

    def __post_init__(self) -> None:
        self.num_per_prompt = self.num_per_prompt or len(self.choices)

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_object_name(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def usage(self) -> dict:
        num_completion = sum(choice.num_tokens for choice in self.choices)
        num_cached = sum(stream.num_cached_tokens  # each prompt's first sequence
                         for stream in self.streams[::self.num_per_prompt])
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": num_completion,
                "total_tokens": self.num_prompt_tokens + num_completion,
                "prompt_tokens_details": {"cached_tokens": num_cached}}


async def merge_deltas(deltas: list[AsyncIterator[Delta]]) -> AsyncIterator[tuple[int, Delta]]:
    """(choice index, delta) from every sequence as they come; an error in one is raised."""
    if len(deltas) == 1:  # the common case: no tasks
        async for delta in deltas[0]:
            yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, source: AsyncIterator[Delta]) -> None:
        try:
            async for delta in source:
                queue.put_nowait((index, delta))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((index, exc))
        finally:
            queue.put_nowait((index, _DONE))

    tasks = [asyncio.create_task(pump(i, source)) for i, source in enumerate(deltas)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is _DONE:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        for source in deltas:  # release the sequences (abort any still running)
            await source.aclose()


async def gather(generation: Generation, deltas: AsyncIterator[tuple[int, Delta]]) -> dict:
    async for index, delta in deltas:
        if delta.error is not None:
            raise FlotillaError.from_info(delta.error)
        generation.choices[index].record(delta)
    returned = []
    for first in range(0, len(generation.choices), generation.num_per_prompt):
        group = generation.choices[first:first + generation.num_per_prompt]
        if generation.num_returned < len(group):  # best_of
            group = sorted(group, key=lambda c: c.cumulative_logprob,
                           reverse=True)[:generation.num_returned]
        returned += group
    choices = []
    for new_index, choice in enumerate(returned):
        entry = choice.final() if generation.kind == "chat" else \
            choice.final(generation.streams[choice.index].prompt_logprobs)
        entry["index"] = new_index
        choices.append(entry)
    return {"id": generation.response_id, "object": generation.object_name,
            "created": generation.created, "model": generation.model, "choices": choices,
            "usage": generation.usage()}


_json = msgspec.json.Encoder()


def chunk_event(generation: Generation, entries: list[dict], usage: dict | None = None) -> bytes:
    """One SSE chunk of these choice entries (with the usage so far when continuous usage
    is asked; ``usage``: the last chunk's)."""
    chunk = {"id": generation.response_id, "object": generation.chunk_object_name,
             "created": generation.created, "model": generation.model, "choices": entries}
    if generation.include_usage:  # null until the last chunk, unless continuous
        chunk["usage"] = generation.usage() if usage is None and \
            generation.continuous_usage else usage
    return b"data: " + _json.encode(chunk) + b"\n\n"


def error_event(error: FlotillaError) -> bytes:
    """An SSE error event in OpenAI's shape (it ends a stream: no [DONE] after it)."""
    return b"data: " + _json.encode(error.openai_body()) + b"\n\n"


async def stream_events(generation: Generation,
                        deltas: AsyncIterator[tuple[int, Delta]]) -> AsyncIterator[bytes]:
    """Server-sent events: one choice entry per chunk (with the usage so far when
    continuous usage is asked), then usage if asked, then [DONE].
    The events of one delta go out in one write."""
    def event(entries: list[dict], usage: dict | None = None) -> bytes:
        return chunk_event(generation, entries, usage)

    if generation.kind == "chat":
        yield b"".join(event([choice.first_entry()]) for choice in generation.choices)
    started = [generation.kind == "chat"] * len(generation.choices)
    try:
        async for index, delta in deltas:
            if delta.error is not None:
                yield error_event(FlotillaError.from_info(delta.error))
                return  # an error event ends the stream: no [DONE], so it is not a success
            choice = generation.choices[index]
            events = []
            if not started[index]:  # completions echo: the prompt first (its logprobs came now)
                started[index] = True
                entry = choice.first_entry(generation.streams[index].prompt_logprobs)
                if entry is not None:
                    events.append(event([entry]))
            events += [event([entry]) for entry in choice.on_delta(delta)]
            if events:
                yield b"".join(events)
    except FlotillaError as exc:
        yield error_event(exc)
        return
    except Exception as exc:  # noqa: BLE001 - a stream never ends silently
        log.exception("stream_failed", response_id=generation.response_id)
        yield error_event(FlotillaError(f"the stream failed: {type(exc).__name__}: {exc}"))
        return
    tail = [event([], generation.usage())] if generation.include_usage else []
    yield b"".join(tail) + b"data: [DONE]\n\n"


@dataclass(frozen=True)
class OutputShape:
    """How a generation reaches the client: as server-sent events, or gathered into one
    body. Chat and completions use their choices (``CHOICES``); /v1/responses its own."""

    events: Callable[[Generation, AsyncIterator[tuple[int, Delta]]], AsyncIterator[bytes]]
    gather: Callable[[Generation, AsyncIterator[tuple[int, Delta]]], Awaitable[dict]]


CHOICES = OutputShape(stream_events, gather)
