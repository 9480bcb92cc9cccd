"""The gateway's NATS edge: tokenizes, submits to a scheduler, and turns the token
outputs coming back into text deltas (through the stateless tokenizer service, with
each request's detokenizer state held here).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import structlog

from services.gateway.config import GatewayConfig
from services.gateway.metrics import GatewayMetrics
from services.tokenizer.detokenizer import initial_state
from shared.bus import Bus
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import (
    AbortRequest, DecodeReply, DecodeRequest, DetokenizeReply, DetokenizeRequest, DetokItem,
    DetokResult, DetokState, Empty, EncodeReply, EncodeRequest, ErrorInfo, GenerateRequest,
    HealthReply, OutputBatch, RequestOutput, SamplingParams, SchedulerStats, SubmitReply,
    TokenizerInfo, TokenLogprobs, choice_request_ids,
)
from shared.subjects import Subjects

log = structlog.get_logger()

SERVICES = ("tokenizer", "scheduler", "worker")


@dataclass(frozen=True)
class TokenText:
    """A token as logprobs show it: its text, exact bytes and log-probability."""

    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    chosen: TokenText
    top: tuple[TokenText, ...] = ()


@dataclass(frozen=True)
class Delta:
    """New text for one request, as the client should see it."""

    text: str
    num_new_tokens: int
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked


@dataclass(eq=False)
class RequestStream:
    request_id: str
    stop: list[str]
    state: DetokState
    scheduler_id: str = ""
    queue: asyncio.Queue[Delta] = field(default_factory=asyncio.Queue)
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    has_output: bool = False
    # when the request asked for prompt logprobs: one per prompt token (the first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None


class GatewayService:
    def __init__(self, config: GatewayConfig, bus: Bus, metrics: GatewayMetrics) -> None:
        self.config = config
        self.bus = bus
        self.metrics = metrics
        self.subjects = Subjects(config.namespace)
        self.output_subject = self.subjects.gateway_outputs(config.instance_id)
        self._streams: dict[str, RequestStream] = {}
        self._heartbeats: dict[str, float] = {}  # scheduler id -> monotonic time last heard
        self._schedulers: dict[str, SchedulerStats] = {}  # latest stats of each scheduler
        self._outstanding: dict[str, int] = {}  # scheduler id -> our requests still running
        self._tokenizer_info: TokenizerInfo | None = None
        self._background: set[asyncio.Task] = set()

    async def start(self) -> None:
        await self.bus.subscribe(self.output_subject, OutputBatch, self._on_outputs)
        await self.bus.subscribe(self.subjects.scheduler_stats, SchedulerStats, self._on_stats)

    # ------------------------------------------------------------ tokenizer calls
    async def tokenizer_info(self) -> TokenizerInfo:
        if self._tokenizer_info is None:
            self._tokenizer_info = await self.bus.request(
                self.subjects.tokenizer_info, Empty(), TokenizerInfo,
                timeout=self.config.request_timeout_s)
        return self._tokenizer_info

    async def encode(self, request: EncodeRequest) -> list[int]:
        reply = await self.bus.request(self.subjects.tokenizer_encode, request, EncodeReply,
                                       timeout=self.config.request_timeout_s)
        return reply.token_ids

    async def decode(self, token_ids: list[int]) -> str:
        reply = await self.bus.request(self.subjects.tokenizer_decode,
                                       DecodeRequest(token_ids=token_ids), DecodeReply,
                                       timeout=self.config.request_timeout_s)
        return reply.text

    async def health(self) -> dict[str, dict]:
        async def check(service: str) -> dict:
            try:
                reply = await self.bus.request(self.subjects.health(service), Empty(), HealthReply,
                                               timeout=self.config.health_timeout_s)
                return {"status": reply.status, "instance_id": reply.instance_id, **reply.detail}
            except FlotillaError as exc:
                return {"status": "unavailable", "error": exc.message}

        results = await asyncio.gather(*(check(service) for service in SERVICES))
        return dict(zip(SERVICES, results))

    # ------------------------------------------------------------ generation
    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     stop: list[str], *, priority: int = 0, cache_salt: str | None = None,
                     n: int = 1) -> tuple[str, list[RequestStream]]:
        """Hand a request (n sequences of one prompt) to the least loaded scheduler; returns
        its id and one stream per sequence. Raises if no scheduler accepts it."""
        request_id = uuid.uuid4().hex
        streams = [RequestStream(choice_id, stop, initial_state(prompt_token_ids))
                   for choice_id in choice_request_ids(request_id, n)]
        request = GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            output_subject=self.output_subject, arrival_time=time.time(), priority=priority,
            cache_salt=cache_salt, n=n)
        for stream in streams:
            self._streams[stream.request_id] = stream
        try:
            reply = await self._submit(request)
        except BaseException:
            for stream in streams:
                self._streams.pop(stream.request_id, None)
            raise
        for stream in streams:
            stream.scheduler_id = reply.scheduler_id
        self._heartbeats.setdefault(reply.scheduler_id, time.monotonic())
        self._outstanding[reply.scheduler_id] = self._outstanding.get(reply.scheduler_id, 0) + n
        return request_id, streams

    async def _submit(self, request: GenerateRequest) -> SubmitReply:
        scheduler_id = self._least_loaded_scheduler()
        if scheduler_id is not None:
            # Count it before the reply comes, so a burst of requests spreads out.
            self._outstanding[scheduler_id] = self._outstanding.get(scheduler_id, 0) + 1
            try:
                return await self.bus.request(self.subjects.scheduler_submit_to(scheduler_id),
                                              request, SubmitReply,
                                              timeout=self.config.request_timeout_s)
            except ServiceUnavailable:
                self._schedulers.pop(scheduler_id, None)  # gone: any other will do
            finally:
                self._outstanding[scheduler_id] -= 1
        return await self.bus.request(self.subjects.scheduler_submit, request, SubmitReply,
                                      timeout=self.config.request_timeout_s)

    def live_schedulers(self) -> list[SchedulerStats]:
        now = time.monotonic()
        return [stats for sid, stats in self._schedulers.items()
                if now - self._heartbeats.get(sid, 0.0) < self.config.heartbeat_timeout_s]

    def _least_loaded_scheduler(self) -> str | None:
        """The live scheduler with the least outstanding work: its last stats, or our
        own count of requests sent to it since, whichever is larger."""
        live = [stats for stats in self.live_schedulers() if stats.worker_ready]
        if not live:
            return None
        return min(live, key=lambda st: max(st.num_running + st.num_waiting,
                                             self._outstanding.get(st.scheduler_id, 0))).scheduler_id

    async def deltas(self, stream: RequestStream) -> AsyncIterator[Delta]:
        """Yield a submitted request's text deltas until one carries a finish reason.
        Leaving early (client gone) aborts the request at its scheduler."""
        try:
            while True:
                delta = await self._next_delta(stream)
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self.release(stream)

    def release(self, stream: RequestStream) -> None:
        """Forget a request; abort it if it is still running."""
        if self._streams.pop(stream.request_id, None) is not None and stream.scheduler_id:
            self._outstanding[stream.scheduler_id] -= 1
        if not stream.finished:
            stream.finished = True
            self._spawn(self._abort(stream.scheduler_id, [stream.request_id]))

    async def _next_delta(self, stream: RequestStream) -> Delta:
        while True:
            try:
                return await asyncio.wait_for(stream.queue.get(), timeout=1.0)
            except asyncio.TimeoutError:
                silent_s = time.monotonic() - self._heartbeats.get(stream.scheduler_id, 0.0)
                if silent_s > self.config.heartbeat_timeout_s:
                    stream.finished = True
                    raise ServiceUnavailable(
                        f"the scheduler stopped responding ({silent_s:.0f}s without a heartbeat)")

    async def _abort(self, scheduler_id: str, request_ids: list[str]) -> None:
        try:
            await self.bus.request(self.subjects.scheduler_abort(scheduler_id),
                                   AbortRequest(request_ids=request_ids), Empty,
                                   timeout=self.config.request_timeout_s)
        except FlotillaError as exc:
            log.warning("abort_failed", request_ids=request_ids, error=exc.message)

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ------------------------------------------------------------ inbound events
    async def _on_stats(self, stats: SchedulerStats) -> None:
        self._heartbeats[stats.scheduler_id] = time.monotonic()
        self._schedulers[stats.scheduler_id] = stats
        self.metrics.observe_scheduler(stats)

    async def _on_outputs(self, batch: OutputBatch) -> None:
        """One scheduler step's outputs for this gateway: detokenize them in one call,
        in arrival order (this handler runs for one batch at a time)."""
        items: list[DetokItem] = []
        outputs: dict[str, RequestOutput] = {}
        for output in batch.outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or stream.finished:
                continue  # aborted, or already ended by a stop string
            if not stream.has_output:  # the first output carries the scheduler's figures
                stream.has_output = True
                stream.num_cached_tokens = output.num_cached_tokens
                self.metrics.queue_time.observe(output.queue_time_s)
            if output.error is not None:
                stream.finished = True
                stream.queue.put_nowait(Delta("", 0, "error", output.error))
                continue
            outputs[output.request_id] = output
            items.append(DetokItem(output.request_id, output.new_token_ids, stream.state,
                                   stream.stop, output.finish_reason is not None, True,
                                   _logprob_token_ids(output)))
        if not items:
            return
        try:
            results = await self._detokenize(items)
        except ServiceUnavailable as exc:
            for item in items:
                stream = self._streams.get(item.request_id)
                if stream is not None:
                    stream.finished = True
                    stream.queue.put_nowait(Delta("", 0, "error", exc.to_info()))
            return
        for item, result in zip(items, results):
            stream = self._streams.get(item.request_id)
            if stream is None:
                continue
            stream.state = result.state
            output = outputs[item.request_id]
            logprobs, prompt_logprobs = _named_logprobs(output, result)
            if prompt_logprobs is not None:
                stream.prompt_logprobs = prompt_logprobs
            if result.stopped:
                stream.finished = True
                self._spawn(self._abort(stream.scheduler_id, [item.request_id]))
                stream.queue.put_nowait(Delta(result.text, result.num_tokens_used, "stop", None,
                                              logprobs[:result.num_tokens_used]))
                continue
            stream.finished = output.finish_reason is not None
            stream.queue.put_nowait(Delta(result.text, len(item.new_token_ids),
                                          output.finish_reason, None, logprobs))

    async def _detokenize(self, items: list[DetokItem]) -> list:
        """Any tokenizer replica will do; while none answers (say, one restarting),
        retry the same call: the state travels with it, so a retry is safe."""
        deadline = time.monotonic() + self.config.tokenizer_retry_s
        while True:
            try:
                reply = await self.bus.request(self.subjects.tokenizer_detokenize,
                                               DetokenizeRequest(items), DetokenizeReply,
                                               timeout=self.config.request_timeout_s)
                return reply.results
            except ServiceUnavailable:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)


def _logprob_token_ids(output: RequestOutput) -> list[int]:
    """Every token id whose text the output's logprobs show, in order."""
    entries = [*output.logprobs, *(e for e in output.prompt_logprobs if e is not None)]
    return [token_id for e in entries for token_id in (e.token_id, *e.top_token_ids)]


def _named_logprobs(output: RequestOutput, result: DetokResult
                    ) -> tuple[tuple[TokenLogprob, ...], list[TokenLogprob | None] | None]:
    """The output's logprobs with the text of each token (in _logprob_token_ids order)."""
    names = iter(zip(result.logprob_tokens, result.logprob_token_bytes))

    def named(entry: TokenLogprobs) -> TokenLogprob:
        token, token_bytes = next(names)
        top = tuple(TokenText(*next(names), logprob)
                    for logprob in entry.top_logprobs)
        return TokenLogprob(TokenText(token, token_bytes, entry.logprob), top)

    logprobs = tuple(named(e) for e in output.logprobs)
    prompt = [None if e is None else named(e) for e in output.prompt_logprobs] \
        if output.prompt_logprobs else None
    return logprobs, prompt
