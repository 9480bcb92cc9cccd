"""One streaming request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from dataclasses import dataclass, field

import httpx

from cli.bench.datasets import BenchRequest
from cli.bench.metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# Which chunks time TTFT and ITL. "text": those with text, what a reader sees. "tokens":
# those that carried tokens, text or not (vLLM's client's rule); two engines whose random
# weights emit different shares of ids that decode to nothing compare only this way.
TIMED_CHUNKS = ("text", "tokens")
_MAX_REASON_CHARS = 200


@dataclass(frozen=True)
class RequestSettings:
    model: str
    endpoint: str = "completions"  # a key of ENDPOINTS
    temperature: float = 0.0
    ignore_eos: bool = False
    per_chunk_usage: bool = False  # ask for the usage on every chunk (continuous_usage_stats)
    timed_chunks: str = "text"  # a key of TIMED_CHUNKS
    extra_body: dict = field(default_factory=dict)  # merged into every request body


def request_body(request: BenchRequest, settings: RequestSettings) -> dict:
    body = {"model": request.model or settings.model, "max_tokens": request.output_len,
            "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if settings.per_chunk_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if settings.endpoint == "chat":
        body["messages"] = (list(request.messages) if request.messages is not None
                            else [{"role": "user", "content": request.prompt}])
    else:
        body["prompt"] = request.prompt
    if request.user is not None:
        body["user"] = request.user
    if settings.ignore_eos:
        body["ignore_eos"] = True  # an extension (vLLM, SGLang, flotilla); OpenAI rejects it
    return {**body, **settings.extra_body}


def chunk_text(payload: dict) -> str:
    choices = payload.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "delta" in choice:
        return (choice["delta"] or {}).get("content") or ""
    return choice.get("text") or ""


def _opens_a_message(payload: dict) -> bool:
    """A chat stream's first chunk: the assistant's role, no content, no token."""
    delta = payload["choices"][0].get("delta") or {}
    return "role" in delta and not delta.get("content")


def _reason(message: str) -> str:
    return message if len(message) <= _MAX_REASON_CHARS else message[:_MAX_REASON_CHARS] + "..."


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        return error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return body.decode("utf-8", errors="replace").strip()


class _Timeline:
    """Arrival times of one kind of chunk, and the tokens each carried when the server
    sends per-chunk usage (vLLM's continuous usage stats)."""

    def __init__(self) -> None:
        self.times_s: list[float] = []
        self.num_tokens: list[int] | None = None
        self.last_completion_tokens = 0

    def add(self, at_s: float, usage: dict | None) -> None:
        self.times_s.append(at_s)
        if usage and usage.get("completion_tokens") is not None:
            if self.num_tokens is None:
                self.num_tokens = [1] * (len(self.times_s) - 1)
            self.num_tokens.append(usage["completion_tokens"] - self.last_completion_tokens)
            self.last_completion_tokens = usage["completion_tokens"]
        elif self.num_tokens is not None:
            self.num_tokens.append(1)

    def carries_tokens(self, usage: dict | None) -> bool:
        """False only for a chunk whose per-chunk usage counts no tokens since the last."""
        return (not usage or usage.get("completion_tokens") is None
                or usage["completion_tokens"] > self.last_completion_tokens)


class _StreamReader:
    """Folds SSE lines into a RequestRecord.

    Chunks that carry text are timed (TTFT, ITL), or with ``timed_chunks="tokens"`` those
    that carry tokens: every chunk with a choice, less those whose per-chunk usage says
    they added none. A stream none of whose chunks carries text but whose usage counts
    output tokens (a random-weight model's ids can decode to nothing) is timed by its
    chunks that carry a choice, text or not; failing those, by the chunk that brought the
    usage."""

    def __init__(self, record: RequestRecord, sent_at: float, keep_text: bool = False,
                 timed_chunks: str = "text") -> None:
        self.record = record
        self.timed_chunks = timed_chunks
        self.sent_at = sent_at
        self.text = _Timeline()
        self.choices = _Timeline()
        self.usage_at_s: float | None = None
        self.text_parts: list[str] | None = [] if keep_text else None

    def feed(self, line: str, now: float) -> bool:
        """Handle one line; False once the stream says it is done."""
        if not line.startswith("data:"):
            return True
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return False
        payload = json.loads(data)
        if not isinstance(payload, dict):
            return True
        if payload.get("error"):
            error = payload["error"]
            message = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            self.record.error = _reason(f"stream error: {message}")
            return False
        usage = payload.get("usage")
        at_s = now - self.sent_at
        if payload.get("choices"):
            if not _opens_a_message(payload) and self.choices.carries_tokens(usage):
                self.choices.add(at_s, usage)
            if text := chunk_text(payload):
                self.text.add(at_s, usage)
                if self.text_parts is not None:
                    self.text_parts.append(text)
        if usage:
            self.record.num_prompt_tokens = usage.get("prompt_tokens")
            self.record.num_output_tokens = usage.get("completion_tokens")
            details = usage.get("prompt_tokens_details") or {}
            self.record.num_cached_tokens = details.get("cached_tokens")
            if self.usage_at_s is None and usage.get("completion_tokens"):
                self.usage_at_s = at_s
        return True

    def finish(self) -> None:
        """Pick the timed chunks; a stream with neither text nor usage tokens failed."""
        record = self.record
        if self.text_parts is not None:
            record.output_text = "".join(self.text_parts)
        timed = self.text if self.timed_chunks == "text" else self.choices
        if timed.times_s:
            record.chunk_times_s, record.chunk_num_tokens = timed.times_s, timed.num_tokens
            record.text = bool(self.text.times_s)
        elif record.num_output_tokens:
            record.text = False
            if self.choices.times_s:
                record.chunk_times_s = self.choices.times_s
                record.chunk_num_tokens = self.choices.num_tokens
            else:
                record.chunk_times_s = [self.usage_at_s]
        elif record.error is None:
            record.error = "no output: no text and no usage tokens received"


class ClientPool:
    """httpx.AsyncClient's ``stream`` over several clients taken in turn. One client's
    connection pool slows down with hundreds of open connections, which made the client,
    not the server, the bottleneck of 1,000 concurrent requests: 1,000 POSTs of 1,024
    token ids to a no-op server took 7 s through one client and 1.5 s through 32."""

    def __init__(self, clients: list[httpx.AsyncClient]) -> None:
        self.clients = clients
        self.timeout = clients[0].timeout
        self._turn = itertools.cycle(clients)

    def stream(self, method: str, url: str, **kwargs):
        return next(self._turn).stream(method, url, **kwargs)

    async def __aenter__(self) -> ClientPool:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await asyncio.gather(*(client.aclose() for client in self.clients))


HttpClient = httpx.AsyncClient | ClientPool


async def send(client: HttpClient, request: BenchRequest, settings: RequestSettings,
               run_started: float, record: RequestRecord | None = None,
               keep_text: bool = False) -> RequestRecord:
    """Send one request and time it into ``record`` (a new one if not given); never raises
    for a failed request (the record's ``error`` says why). The client's read timeout is a
    stall timeout: no bytes for that long fails the request. ``keep_text`` keeps the
    generated text in ``record.output_text`` (a chat's next turn sends it back)."""
    if record is None:
        record = new_record(request)
    sent_at = time.perf_counter()
    record.start_s = sent_at - run_started
    reader = _StreamReader(record, sent_at, keep_text, settings.timed_chunks)
    try:
        async with client.stream("POST", ENDPOINTS[settings.endpoint],
                                 json=request_body(request, settings)) as response:
            if response.status_code != 200:
                message = _error_message(await response.aread())
                record.error = _reason(f"HTTP {response.status_code}: {message}")
            else:
                async for line in response.aiter_lines():
                    if not reader.feed(line, time.perf_counter()):
                        break
    except httpx.ReadTimeout:
        record.error = f"stalled: no data for {client.timeout.read:g} s (--request-timeout)"
    except (httpx.HTTPError, ValueError) as exc:
        record.error = _reason(f"{type(exc).__name__}: {exc}")
    finally:  # also when cancelled at a deadline: the record keeps what arrived
        record.e2e_s = time.perf_counter() - sent_at
        reader.finish()
    return record


def new_record(request: BenchRequest) -> RequestRecord:
    return RequestRecord(prompt_len=request.prompt_len, output_len=request.output_len)


def is_connection_error(error: str | None) -> bool:
    """An HTTP error status, a connection that failed or broke, or a stall: the server
    could not be reached or refused the request (a wrong URL, model or key)."""
    return error is not None and not error.startswith(("stream error:", "no output:"))
