"""The gateway's NATS edge: tokenizes (through the tokenizer service), submits to a
scheduler, and turns the token outputs coming back into text deltas itself (one
incremental detokenizer per sequence, see streams.py).

Which scheduler gets a request is routing.py's choice (``--routing``, docs/routing.md);
under ``kv`` it reads the block index that block_feed.py keeps from the block events.
The HTTP app (app.py) is handed a started-up service by its caller (__main__.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import structlog

from services.gateway.block_feed import BlockFeed
from services.gateway.block_index import BlockIndex
from services.gateway.health_checks import services_health
from services.gateway.config import GatewayConfig, RoutingPolicy
from services.gateway.lora_directory import LoraControl, LoraDirectory
from services.gateway.metrics import GatewayMetrics
from services.gateway.migration import can_migrate, resumed_request
from services.gateway.replicas import ReplicaTable
from services.gateway.response_store import CANCELLED, ResponseStore
from services.gateway.routing import Decision, PendingPrefill, Replica, Router, RoutingParams
from services.gateway.streams import Delta, RequestStream, apply_output
from shared.bus import Bus
from shared.detokenizer import IncrementalDetokenizer, TokenBytes, fast_decoder
from shared.errors import FlotillaError, ServiceUnavailable
from shared.lora_adapters import LoraRef
from shared.messages import (
    AbortRequest, DecodeReply, DecodeRequest, Empty, EncodeReply, EncodeRequest, ErrorInfo,
    GenerateRequest, ImageInput, OutputBatch, SamplingParams, SubmitReply,
    TokenizerInfo, choice_request_ids,
)
from shared.models import resolve_model
from shared.prefix_hash import image_keys
from shared.scheduler_stats import SchedulerStats
from shared.subjects import Subjects
from shared.tokenizer_loading import load_tokenizer as load_hf_tokenizer

log = structlog.get_logger()

HEARTBEAT_CHECK_S = 1.0
MIGRATION_RETRY_S = 0.5  # while no replica takes a moving request (or one becomes ready)


def load_tokenizer(model: str, cache_dir: str):
    """The served model's tokenizer, for turning output tokens into text here."""
    return load_hf_tokenizer(resolve_model(model, cache_dir).path, cache_dir)


class GatewayService:
    @classmethod
    async def connect(cls, config: GatewayConfig) -> GatewayService:
        """A service with the served model's tokenizer and its own NATS connection (which
        ``stop`` closes); ``start`` subscribes."""
        tokenizer = await asyncio.to_thread(load_tokenizer, config.model, config.cache_dir)
        bus = await Bus.connect(config.nats_url, name=f"gateway-{config.instance_id}")
        return cls(config, bus, GatewayMetrics(config.fleet_metrics), tokenizer)

    def __init__(self, config: GatewayConfig, bus: Bus, metrics: GatewayMetrics,
                 tokenizer) -> None:
        self.config = config
        self.bus = bus
        self.metrics = metrics
        self.decoder = fast_decoder(tokenizer)  # output text is made here, per sequence
        self.token_bytes = TokenBytes(tokenizer)
        self.subjects = Subjects(config.namespace)
        self.output_subject = self.subjects.gateway_outputs(config.instance_id)
        self._streams: dict[str, RequestStream] = {}
        self.replicas = ReplicaTable(config.heartbeat_timeout_s, config.stall_timeout_s)
        self._tokenizer_info: TokenizerInfo | None = None
        self._replica_ready = asyncio.Event()  # set when a replica becomes ready
        self._background: set[asyncio.Task] = set()
        self.index = BlockIndex()
        self.router = Router(RoutingParams(
            config.routing, config.routing_saturation_margin, config.routing_saturation_ratio,
            config.routing_session_ttl_s, config.routing_max_sessions), self.index)
        self._pending_prefill = PendingPrefill()  # prompt tokens sent, no first output yet
        # the index is fed only under kv routing (the other policies ignore it)
        self.blocks = BlockFeed(bus, self.subjects, self.index, metrics, self._spawn) \
            if config.routing == RoutingPolicy.KV else None
        metrics.watch_block_index(self.index)
        self.store = ResponseStore(bus, self.subjects, config.response_retention_s,  # JetStream
                                   config.response_store_replicas, config.response_idle_timeout_s)
        self.lora_control = LoraControl(  # the adapters each replica serves (docs/lora.md)
            bus, self.subjects, LoraDirectory(),
            lambda: [stats.scheduler_id for stats in self.live_schedulers()],
            config.request_timeout_s)

    async def start(self) -> None:
        await self.bus.subscribe(self.output_subject, OutputBatch, self._on_outputs)
        await self.bus.subscribe(self.subjects.scheduler_stats, SchedulerStats, self._on_stats)
        self._spawn(self._watch_heartbeats())
        self.bus.add_listener(self._on_link)
        await self.store.start(lambda: self.store.follow(  # stored requests' own subjects
            self.config.instance_id, self._on_outputs, self._cancelled))
        if self.blocks is not None:
            await self.blocks.start()
            self.bus.add_listener(self.blocks.on_link)

    def _on_link(self, up: bool) -> None:
        """Our own NATS link dropped: outputs sent meanwhile may be lost, so every running
        request moves (resuming from the tokens we did receive; late outputs of the old
        ids are ignored)."""
        if up:
            return
        lost = ServiceUnavailable("the gateway lost its connection to NATS (outputs may be "
                                  "lost)", code="nats_unavailable").to_info()
        for stream in list(self._streams.values()):
            if stream.scheduler_id:
                self._lost(stream, lost)

    async def stop(self) -> None:
        """Cancel the background tasks and close the bus."""
        self.store.stop()
        for task in list(self._background):
            task.cancel()
        await self.bus.close()

    # ------------------------------------------------------------ tokenizer calls
    async def tokenizer_info(self) -> TokenizerInfo:
        if self._tokenizer_info is None:
            self._tokenizer_info = await self.bus.request(
                self.subjects.tokenizer_info, Empty(), TokenizerInfo,
                timeout=self.config.request_timeout_s)
            self.metrics.served_model_name = self._tokenizer_info.model_name  # vllm:* label
        return self._tokenizer_info

    async def encode(self, request: EncodeRequest) -> list[int]:
        return (await self.encode_reply(request)).token_ids

    async def encode_reply(self, request: EncodeRequest) -> EncodeReply:
        """The token ids, and the images preprocessed when the request has some."""
        subject = self.subjects.tokenizer_encode
        if not request.images:
            return await self.bus.request(subject, request, EncodeReply,
                                          timeout=self.config.request_timeout_s)
        with self.metrics.image_preprocess_time.time():  # (a failed wait counts too)
            return await self.bus.request(subject, request, EncodeReply,
                                          timeout=self.config.image_preprocess_timeout_s)

    async def decode(self, token_ids: list[int]) -> str:
        reply = await self.bus.request(self.subjects.tokenizer_decode,
                                       DecodeRequest(token_ids=token_ids), DecodeReply,
                                       timeout=self.config.request_timeout_s)
        return reply.text

    async def health(self) -> dict[str, dict]:
        return await services_health(self.bus, self.subjects, self.config.health_timeout_s)

    # ------------------------------------------------------------ generation
    async def submit(self, prompt_token_ids: list[int], sampling: SamplingParams,
                     stop: list[str], *, priority: int = 0, cache_salt: str | None = None,
                     n: int = 1, session: str | None = None, lora_name: str = "",
                     images: list[ImageInput] | None = None, stored_id: str = ""
                     ) -> tuple[str, list[RequestStream]]:
        """Hand a request (n sequences of one prompt; ``lora_name``: its LoRA adapter) to
        the scheduler routing picks (``session``: its prompt_cache_key or user); returns
        its id and one stream per sequence. Raises if no scheduler accepts it.
        ``stored_id``: its id in the response store, whose subject gets its outputs."""
        request_id = stored_id or uuid.uuid4().hex
        output_subject = self.subjects.response_outputs(self.config.instance_id, request_id) \
            if stored_id else self.output_subject
        streams = [RequestStream(choice_id,
                                 IncrementalDetokenizer(self.decoder, prompt_token_ids, stop))
                   for choice_id in choice_request_ids(request_id, n)]
        request = GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids, sampling=sampling,
            output_subject=output_subject, arrival_time=time.time(), priority=priority,
            cache_salt=cache_salt, n=n, lora_name=lora_name, images=images or [])
        for stream in streams:
            stream.request = request if n == 1 else None  # n > 1 is not migrated
            stream.stored_id = stored_id
            self._streams[stream.request_id] = stream
        try:
            reply = await self._submit(request, session=session)
        except BaseException:
            for stream in streams:
                self._streams.pop(stream.request_id, None)
            raise
        for stream in streams:
            stream.scheduler_id = reply.scheduler_id
        self.replicas.submitted(reply.scheduler_id, n, time.monotonic())
        return request_id, streams

    async def _submit(self, request: GenerateRequest, avoid: str = "",
                      session: str | None = None) -> SubmitReply:
        decision = self._route(request, avoid, session)
        if decision is not None:
            scheduler_id = decision.scheduler_id
            # Count it before the reply comes, so a burst of requests spreads out.
            self.replicas.add_outstanding(scheduler_id, 1)
            first_id = choice_request_ids(request.request_id, request.n)[0]
            self._pending_prefill.add(first_id, scheduler_id, decision.num_compute_tokens)
            submitted = False
            try:
                reply = await self.bus.request(self.subjects.scheduler_submit_to(scheduler_id),
                                               request, SubmitReply,
                                               timeout=self.config.request_timeout_s)
                submitted = True
                return reply
            except ServiceUnavailable:
                self.replicas.drop_stats(scheduler_id)  # gone: any other will do
            finally:
                self.replicas.add_outstanding(scheduler_id, -1)
                if not submitted:
                    self._pending_prefill.done(first_id)
        return await self.bus.request(self.subjects.scheduler_submit, request, SubmitReply,
                                      timeout=self.config.request_timeout_s)

    def lora_adapters(self) -> dict[str, LoraRef]:
        return self.lora_control.adapters()  # (by name, on the live replicas)

    def lora_ref(self, lora_name: str) -> LoraRef | None:
        """The adapter a request names on the live replicas (None: the base model)."""
        return self.lora_control.adapters().get(lora_name) if lora_name else None

    def live_schedulers(self) -> list[SchedulerStats]:
        return self.replicas.live(time.monotonic())

    def seconds_since_step(self, scheduler_id: str) -> float:
        return self.replicas.seconds_since_step(scheduler_id, time.monotonic())

    def is_ready(self, stats: SchedulerStats) -> bool:
        return self.replicas.is_ready(stats, time.monotonic())

    def replica_readiness(self) -> dict[str, dict]:
        """Each live replica's readiness and load, by replica id (for /health)."""
        return {stats.replica_id: {
            "scheduler_id": stats.scheduler_id, "ready": self.is_ready(stats),
            "worker_ready": stats.worker_ready,
            "seconds_since_step": round(self.seconds_since_step(stats.scheduler_id), 1),
            "num_running": stats.num_running, "num_waiting": stats.num_waiting,
            "block_index_synced": self.index.is_synced(stats.scheduler_id)}
            for stats in self.live_schedulers()}

    def _route(self, request: GenerateRequest, avoid: str = "",
               session: str | None = None) -> Decision | None:
        """The ready scheduler for this request (routing.py), None when none is ready.
        Load is its last stats or our own count of requests sent to it since, whichever
        is larger. ``avoid`` (one that just lost a request) is taken only when no other is
        ready."""
        ready = [stats for stats in self.live_schedulers() if self.is_ready(stats)]
        lora, holders = self.lora_control.ready_for(  # (only replicas with the adapter)
            request.lora_name, [stats.scheduler_id for stats in ready])
        ready = [stats for stats in ready if stats.scheduler_id in holders]
        if avoid and any(stats.scheduler_id != avoid for stats in ready):
            ready = [stats for stats in ready if stats.scheduler_id != avoid]
        records = [self.replicas.record(stats.scheduler_id) for stats in ready]
        replicas = [Replica(stats, record.num_outstanding,
                            self._pending_prefill.of(stats.scheduler_id),
                            record.num_outstanding_at_stats)
                    for stats, record in zip(ready, records)]
        decision = self.router.choose(
            replicas, [*request.prompt_token_ids, *request.output_token_ids],
            cache_salt=request.cache_salt, session=session, now=time.monotonic(),
            max_tokens=request.sampling.max_tokens, lora_key=lora.cache_key if lora else "",
            images=image_keys([(image.offset, image.hash) for image in request.images]))
        if decision is not None:
            self.metrics.observe_routing(decision)
            log.debug("request_routed", request_id=request.request_id,
                      scheduler_id=decision.scheduler_id, policy=decision.policy,
                      reason=decision.reason, hit_tokens=decision.hit_tokens,
                      estimated_s=round(decision.estimated_s, 4))
        return decision

    async def deltas(self, stream: RequestStream) -> AsyncIterator[Delta]:
        """Yield a submitted request's text deltas until one carries a finish reason.
        Leaving early (client gone) aborts the request at its scheduler."""
        try:
            while True:
                delta = await stream.next_delta()
                yield delta
                if delta.finish_reason is not None:
                    return
        finally:
            self.release(stream)

    def release(self, stream: RequestStream) -> None:
        """Forget a request; abort it if it is still running."""
        if self._streams.pop(stream.request_id, None) is not None and stream.scheduler_id:
            self.replicas.add_outstanding(stream.scheduler_id, -1)
        self._pending_prefill.done(stream.request_id)
        if not stream.finished:
            stream.finished = True
            if stream.scheduler_id:  # (a moving request is aborted once it lands)
                self._spawn(self._abort(stream.scheduler_id, [stream.request_id]))

    async def _watch_heartbeats(self) -> None:
        """The streams of a scheduler silent for longer than the heartbeat timeout are lost:
        its steps will not come (one task for all streams, not a timer per wait)."""
        while True:
            await asyncio.sleep(HEARTBEAT_CHECK_S)
            self.metrics.flush()  # (several gateway processes: what the others' scrapes read)
            now = time.monotonic()
            self._forget_silent_caches(now)
            stalled = self._newly_stalled()
            for stream in list(self._streams.values()):
                silent_s = self.replicas.silent_s(stream.scheduler_id, now)
                if silent_s > self.config.heartbeat_timeout_s:
                    self._lost(stream, ServiceUnavailable(
                        f"the scheduler stopped responding ({silent_s:.0f}s without a "
                        "heartbeat)").to_info())
                elif stream.scheduler_id in stalled:
                    self._lost(stream, stalled[stream.scheduler_id])

    def _forget_silent_caches(self, now: float) -> None:
        """A scheduler silent past the heartbeat timeout may be gone with its cache: no
        request is routed by its blocks (its stats, if they come back, rebuild them)."""
        for scheduler_id in self.replicas.silent(now):
            self.index.drop_scheduler(scheduler_id)

    def _newly_stalled(self) -> dict[str, ErrorInfo]:
        """Replicas alive but not stepping with work queued for over the stall timeout
        (a hung worker): reported not ready, and their requests move, once per stall."""
        found = {}
        for stall in self.replicas.newly_stalled(time.monotonic()):
            log.warning("replica_stalled", scheduler_id=stall.scheduler_id,
                        replica_id=stall.replica_id, seconds=round(stall.stuck_s, 1))
            found[stall.scheduler_id] = ServiceUnavailable(
                f"replica {stall.replica_id} has not finished a step for {stall.stuck_s:.0f}s "
                "with work queued").to_info()
        return found

    def _lost(self, stream: RequestStream, error: ErrorInfo) -> None:
        """The replica running ``stream`` failed it: move it to another, or end it."""
        if stream.finished or stream.migrating:
            return
        if can_migrate(stream.request, stream.num_migrations, self.config.migration_limit, error):
            stream.migrating = True
            self._spawn(self._migrate(stream, error))
        else:
            stream.fail(error)

    async def _migrate(self, stream: RequestStream, error: ErrorInfo) -> None:
        """Submit the stream's request again, resuming after its tokens, to a live replica
        (waiting up to the migration timeout for one); its deltas keep coming to the same
        stream, so the client sees one unbroken answer."""
        old_id, old_scheduler = stream.request_id, stream.scheduler_id
        if self._streams.pop(old_id, None) is not None and old_scheduler:
            self.replicas.add_outstanding(old_scheduler, -1)
        self._pending_prefill.done(old_id)
        self._spawn(self._abort(old_scheduler, [old_id]))  # in case it still runs it
        stream.num_migrations += 1
        request = resumed_request(stream.request, stream.output_token_ids, stream.num_migrations,
                                  time.time())
        stream.request_id, stream.scheduler_id = request.request_id, ""
        self._streams[request.request_id] = stream
        if stream.stored_id:  # its replays follow the new attempt's outputs from here
            self._spawn(self.store.moved(self.config.instance_id, stream.stored_id, request))
        log.warning("request_migrating", request_id=old_id, new_request_id=request.request_id,
                    scheduler_id=old_scheduler, num_output_tokens=len(stream.output_token_ids),
                    reason=error.message)
        deadline = time.monotonic() + self.config.migration_timeout_s
        while True:
            try:
                reply = await self._submit(request, avoid=old_scheduler)
                break
            except FlotillaError as exc:
                if stream.finished:  # the client left while it waited
                    return
                if exc.status != 503 or time.monotonic() > deadline:
                    self._streams.pop(request.request_id, None)
                    self.metrics.migrations.labels("failed").inc()
                    stream.migrating = False
                    stream.fail(exc.to_info() if exc.status != 503 else error)
                    return
                self._replica_ready.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._replica_ready.wait(), MIGRATION_RETRY_S)
        stream.scheduler_id = reply.scheduler_id
        stream.migrating = False
        self.replicas.submitted(reply.scheduler_id, 1, time.monotonic())
        self.metrics.migrations.labels("resumed").inc()
        if self._streams.get(request.request_id) is not stream:  # the client left meanwhile
            self._spawn(self._abort(reply.scheduler_id, [request.request_id]))

    def _cancelled(self, stored_id: str) -> None:
        """A cancel (from any gateway) of one of our stored requests stops it."""
        for stream in [s for s in self._streams.values() if s.stored_id == stored_id]:
            self.release(stream)  # (aborts it)
            stream.push(Delta("", 0, "error", CANCELLED))

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
        before = self.replicas.stats(stats.scheduler_id)
        if stats.worker_ready and not (before is not None and before.worker_ready):
            self._replica_ready.set()  # moving requests try it now, not after their retry
        for old_id in self.replicas.heard(stats, time.monotonic()):
            self._replaced(old_id, stats)
        self.metrics.observe_scheduler(stats)
        replay = self.lora_control.observe(stats)  # (a joined replica: peers' adapters)
        if replay is not None:
            self._spawn(replay)
        if self.blocks is not None:
            self.blocks.on_stats(stats)

    def _replaced(self, old_id: str, stats: SchedulerStats) -> None:
        """A new scheduler for a replica that had another: the old one restarted, and its
        requests are lost now (no need to wait for its heartbeat to time out)."""
        log.warning("scheduler_replaced", replica_id=stats.replica_id,
                    old_scheduler_id=old_id, new_scheduler_id=stats.scheduler_id)
        self.index.drop_scheduler(old_id)  # a new epoch: the old cache is gone
        self.metrics.replaced(stats.replica_id)
        lost = ServiceUnavailable(f"scheduler {old_id} of replica {stats.replica_id} "
                                  "restarted").to_info()
        for stream in [s for s in self._streams.values() if s.scheduler_id == old_id]:
            self._lost(stream, lost)

    async def _on_outputs(self, batch: OutputBatch) -> None:
        """One scheduler step's outputs for this gateway, turned into text here."""
        for output in batch.outputs:
            stream = self._streams.get(output.request_id)
            if stream is None or stream.finished:
                continue  # aborted, or already ended by a stop string
            if not stream.has_output:  # the first output carries the scheduler's figures
                stream.has_output = True
                self._pending_prefill.done(output.request_id)
                stream.num_cached_tokens = output.num_cached_tokens
                self.metrics.queue_time.observe(output.queue_time_s)
            if output.error is not None:
                self._lost(stream, output.error)
            elif apply_output(stream, output, self.token_bytes, batch.published_at):
                self._spawn(self._abort(stream.scheduler_id, [output.request_id]))
            if stream.finished and output.error is None:
                self.router.observe_output(len(stream.output_token_ids))
