"""One streaming request to an OpenAI-compatible server, timed chunk by chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import httpx

from cli.bench.datasets import BenchRequest
from cli.bench.metrics import RequestRecord

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
_MAX_REASON_CHARS = 200


@dataclass(frozen=True)
class RequestSettings:
    model: str
    endpoint: str = "completions"  # a key of ENDPOINTS
    temperature: float = 0.0
    ignore_eos: bool = False
    extra_body: dict = field(default_factory=dict)  # merged into every request body


def request_body(request: BenchRequest, settings: RequestSettings) -> dict:
    body = {"model": settings.model, "max_tokens": request.output_len,
            "temperature": settings.temperature, "stream": True,
            "stream_options": {"include_usage": True}}
    if settings.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
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


def _reason(message: str) -> str:
    return message if len(message) <= _MAX_REASON_CHARS else message[:_MAX_REASON_CHARS] + "..."


def _error_message(body: bytes) -> str:
    try:
        error = json.loads(body).get("error")
        return error.get("message", str(error)) if isinstance(error, dict) else str(error)
    except (ValueError, AttributeError):
        return body.decode("utf-8", errors="replace").strip()


class _StreamReader:
    """Folds SSE lines into a RequestRecord."""

    def __init__(self, record: RequestRecord, sent_at: float) -> None:
        self.record = record
        self.sent_at = sent_at
        self.last_completion_tokens = 0

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
        if chunk_text(payload):
            self.record.chunk_times_s.append(now - self.sent_at)
            self._count_chunk_tokens(usage)
        if usage:
            self.record.num_prompt_tokens = usage.get("prompt_tokens")
            self.record.num_output_tokens = usage.get("completion_tokens")
        return True

    def _count_chunk_tokens(self, usage: dict | None) -> None:
        # Servers with continuous usage stats say how many tokens each chunk carried.
        if usage and usage.get("completion_tokens") is not None:
            if self.record.chunk_num_tokens is None:
                self.record.chunk_num_tokens = [1] * (len(self.record.chunk_times_s) - 1)
            self.record.chunk_num_tokens.append(usage["completion_tokens"]
                                                - self.last_completion_tokens)
            self.last_completion_tokens = usage["completion_tokens"]
        elif self.record.chunk_num_tokens is not None:
            self.record.chunk_num_tokens.append(1)


async def send(client: httpx.AsyncClient, request: BenchRequest, settings: RequestSettings,
               run_started: float) -> RequestRecord:
    """Send one request and time it; never raises for a failed request (the record's
    ``error`` says why)."""
    record = RequestRecord(prompt_len=request.prompt_len, output_len=request.output_len)
    sent_at = time.perf_counter()
    record.start_s = sent_at - run_started
    reader = _StreamReader(record, sent_at)
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
    except (httpx.HTTPError, ValueError) as exc:
        record.error = _reason(f"{type(exc).__name__}: {exc}")
    record.e2e_s = time.perf_counter() - sent_at
    if record.error is None and not record.chunk_times_s:
        record.error = "no text received"
    return record
