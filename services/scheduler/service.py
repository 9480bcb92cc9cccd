"""The scheduler's NATS edge: takes requests, drives its worker with overlapped steps,
publishes each step's tokens to the gateways that asked, and reports stats.

Losing NATS: core NATS keeps nothing, so a step, its reply or an output sent around
the outage may be gone. When this scheduler's link drops, every request it holds fails
with a 503 (the gateway moves it to a replica, resuming after the tokens it did get),
the worker is re-attached (its cache reset) once the link is back, and those error
outputs, plus an error for each request finished just before the drop (its last output
may have died with the link; a gateway that had it ignores the error), are sent again
a few times after the link returns, when the gateways have subscribed again.

With a kvstore (``--kv-node-id`` set and the worker attached to one, docs/kvstore.md):
each submitted request's blocks beyond its GPU prefix are looked up before it is queued
(kv_client.py: a short deadline, a miss on any trouble); a hit worth loading is pinned
and rides with the request. Submits are then handled concurrently, each keeping the
place in line it arrived at. Pins are released when the scheduler says (after the step
that loaded them, or unused), and kept alive every couple of seconds.

For the gateways' KV-aware routing, the prefix cache's blocks are published as they come
and go, with a snapshot on request (block_events.py), and the stats name the prices.

Draining (SIGTERM): no new requests (the queue-group submit is unsubscribed, an
addressed submit gets 503 "draining", stats and health say so); running and waiting
requests finish for up to ``shutdown_timeout``; what is left then fails with a 503.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque
from dataclasses import dataclass

import msgspec
import structlog

from services.scheduler.block_events import BlockEventPublisher, routing_stats
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_client import KEEPALIVE_INTERVAL_S, KvClient
from services.scheduler.request import TierHit
from services.scheduler.scheduler import Emitted, Scheduler
from services.scheduler.tiering import TierSpeeds
from shared.bus import PING_INTERVAL_S, Bus
from shared.errors import FlotillaError, ServiceUnavailable, TooManyRequests
from shared.messages import (
    AbortRequest, Empty, GenerateRequest, HealthReply, OutputBatch, RequestOutput,
    SchedulerStats, StepPlan, StepResult, SubmitReply, WorkerInfo, choice_request_ids,
)
from shared.subjects import Subjects

log = structlog.get_logger()

MAX_STEP_SAMPLES = 512  # per stats event
IDLE_CHECK_S = 1.0  # while idle, this often make sure the worker is the one attached
ATTACH_RETRY_S = 0.5
# Error outputs of a lost link are sent this long after it is back (and after they were
# made): peers resubscribe within about nats-py's reconnect wait (0.5 s) of NATS.
REDELIVERY_AFTER_S = (0.5, 2.0, 5.0)
REDELIVERY_TICK_S = 0.25
# A final output this recent may have been written into a link found dead later: a dead
# TCP link without a reset is found after about three ping intervals.
RECENT_FINAL_S = 3.0 * PING_INTERVAL_S
WORKER_LINK_KEY = "nats_disconnects"  # in the worker's ping reply


def bus_lost_error() -> ServiceUnavailable:
    return ServiceUnavailable("the scheduler lost its connection to NATS while the request ran "
                              "(its output may be incomplete)", code="nats_unavailable")


@dataclass
class _Held:
    """An error output waiting for the link (and the gateways) to come back."""

    emitted: Emitted
    added_at: float
    num_sent: int = 0


class SchedulerService:
    def __init__(self, config: SchedulerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.namespace)
        self.core: Scheduler | None = None  # built once the worker says how big its cache is
        self._worker_id = ""  # the worker instance attached: its cache is what core tracks
        self._worker_link: int | None = None  # its count of NATS disconnects, from its pings
        self._wakeup = asyncio.Event()
        self._stats_now = asyncio.Event()
        self._worker_busy_s = 0.0
        self._step_samples: list[tuple[int, float]] = []  # (tokens, seconds) since last stats
        self._bus_epoch = bus.num_disconnects  # link drops already acted on
        self._held: list[_Held] = []
        self._recent_finals: deque[tuple[float, Emitted]] = deque()
        self.draining = False
        self.kv: KvClient | None = None  # the kvstore of the attached worker, if any
        self.tier_speeds = TierSpeeds()  # measured across worker re-attaches
        self._looking_up: set[str] = set()  # request ids whose kvstore lookup runs
        self._aborted_while_looking_up: set[str] = set()
        self._kv_store_id = ""  # the kvstore process the queued hits were pinned by
        # the kvstore process the worker's arena belongs to, from its pings ("": none): only
        # its slots can be loaded (the worker computes any other load instead)
        self._worker_kv_store_id = ""
        self._worker_info: WorkerInfo | None = None
        # tier hits of the cores before the current one: the stats stay cumulative across
        # worker re-attaches (a gateway that saw no stats between a reset and a larger
        # count would add only the difference)
        self._kv_tier_hits_before: dict[str, int] = {}
        self.block_events = BlockEventPublisher(  # the GPU tier, for the gateways' routing
            bus, self.subjects, config.instance_id, config.replica_id,
            lambda: self.core.block_manager if self.core is not None else None)
        bus.add_listener(self._on_link)

    async def start(self) -> None:
        queue = self.subjects.queue_group("scheduler")
        # with a kvstore a submit may wait for a lookup: others go on meanwhile
        concurrent = bool(self.config.kv_node_id)
        await self.bus.serve(self.subjects.scheduler_submit, GenerateRequest, self._on_submit,
                             queue=queue, concurrent=concurrent)
        await self.bus.serve(self.subjects.scheduler_submit_to(self.config.instance_id),
                             GenerateRequest, self._on_submit, concurrent=concurrent)
        await self.bus.serve(self.subjects.scheduler_abort(self.config.instance_id), AbortRequest,
                             self._on_abort)
        await self.bus.serve(self.subjects.health("scheduler"), Empty, self._on_health, queue=queue)
        await self.block_events.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``, then drain. A step loop that crashes ends the process
        (raised here) rather than leaving a scheduler that answers but never steps."""
        step_loop = asyncio.create_task(self._step_loop())
        helpers = [asyncio.create_task(self._stats_loop()),
                   asyncio.create_task(self._redelivery_loop()),
                   asyncio.create_task(self._keepalive_loop()),
                   asyncio.create_task(self.block_events.run())]
        stopped = asyncio.create_task(stop.wait())
        try:
            await asyncio.wait({step_loop, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if step_loop.done():
                step_loop.result()
            if not self.bus.lost_for_good:
                await self.drain(step_loop)
        finally:
            for task in (step_loop, stopped, *helpers):
                task.cancel()
            await asyncio.gather(step_loop, stopped, *helpers, return_exceptions=True)

    async def drain(self, step_loop: asyncio.Task) -> None:
        """Take no new requests; let the held ones finish for up to shutdown_timeout,
        then fail the rest with 503 (the gateway moves them to another replica)."""
        core = self.core
        self.draining = True
        log.info("scheduler_draining", num_running=len(core.running) if core else 0,
                 num_waiting=len(core.waiting) if core else 0,
                 timeout_s=self.config.shutdown_timeout)
        await self.bus.unsubscribe(self.subjects.scheduler_submit,
                                   queue=self.subjects.queue_group("scheduler"))
        self._stats_now.set()
        self._wakeup.set()
        done, _ = await asyncio.wait({step_loop}, timeout=self.config.shutdown_timeout)
        if not done:
            step_loop.cancel()
        (outcome,) = await asyncio.gather(step_loop, return_exceptions=True)
        if isinstance(outcome, Exception):
            log.error("step_loop_failed", error=repr(outcome))
        num_failed = 0
        if self.core is not None and self.core.requests:
            emitted = self.core.fail_all(ServiceUnavailable(
                f"the scheduler shut down before the request finished (it drained for "
                f"{self.config.shutdown_timeout:g}s)", code="shutdown").to_info())
            num_failed = len(emitted)
            await self._publish(emitted)
        await self._send_held(final=True)
        try:
            await self.bus.flush()
        except Exception:  # noqa: BLE001 - NATS may be gone; nothing more to do
            pass
        log.info("scheduler_drained", num_failed=num_failed)

    # ------------------------------------------------------------ handlers
    async def _on_submit(self, request: GenerateRequest) -> SubmitReply:
        if self.draining:
            raise ServiceUnavailable(f"scheduler {self.config.instance_id} is draining (shutting "
                                     "down) and takes no new requests", code="draining")
        if self.core is None:
            raise ServiceUnavailable("the worker is not ready yet")
        # Queued: what would still wait if every free batch slot were filled now (a request
        # submitted a moment ago sits in `waiting` until the next step admits it).
        core = self.core
        num_queued = len(core.running) + len(core.waiting) - self.config.max_num_seqs
        if num_queued >= self.config.max_queued_requests:
            raise TooManyRequests(f"the server is busy: {num_queued} requests are queued to "
                                  "run; try again later")
        if self.kv is None:
            core.add_request(request)
        else:
            await self._submit_with_lookup(core, request)
        self._wakeup.set()
        return SubmitReply(scheduler_id=self.config.instance_id)

    async def _submit_with_lookup(self, core: Scheduler, request: GenerateRequest) -> None:
        """Queue a request with its kvstore hit, if any, in the place in line it arrived
        at. A request aborted, or a core replaced, during the lookup lets go of the hit."""
        core.validate(request)  # a bad request fails before any lookup
        kv, seq, query = self.kv, core.next_arrival_seq(), core.prefix_query(request)
        request_ids = choice_request_ids(request.request_id, request.n)
        hit: TierHit | None = None
        if query is not None and not self._looking_up.intersection(request_ids):
            self._looking_up.update(request_ids)
            try:
                hit = await kv.find_hit(query, [*request.prompt_token_ids, *request.output_token_ids])
            finally:
                self._looking_up.difference_update(request_ids)
        aborted = not self._aborted_while_looking_up.isdisjoint(request_ids)
        self._aborted_while_looking_up.difference_update(request_ids)
        if hit is not None and (hit.store_id != kv.store_id or self.core is not core or aborted
                                or self.draining or hit.store_id != self._worker_kv_store_id):
            await kv.release([hit.pin_id])
            hit = None
        if aborted:
            return
        if self.core is not core or self.draining:
            raise ServiceUnavailable("the scheduler re-attached its worker or began draining "
                                     "while the request arrived", code="draining"
                                     if self.draining else None)
        self._drop_stale_hits(core)
        try:
            core.add_request(request, tier_hit=hit, arrival_seq=seq,
                             block_hashes=query.block_hashes if query is not None else None)
        except FlotillaError:
            if hit is not None:
                await kv.release([hit.pin_id])
            raise

    def _drop_stale_hits(self, core: Scheduler) -> None:
        """Hits pinned by a kvstore that has restarted since are gone with it."""
        store_id = self.kv.store_id if self.kv is not None else ""
        if store_id != self._kv_store_id:
            if self._kv_store_id:
                log.warning("kvstore_restarted", old_store_id=self._kv_store_id, store_id=store_id)
                core.drop_tier_hits(store_id)
            self._kv_store_id = store_id

    async def _on_abort(self, request: AbortRequest) -> Empty:
        self._aborted_while_looking_up.update(self._looking_up.intersection(request.request_ids))
        if self.core is not None:
            self.core.abort(request.request_ids)
            await self._release_pins(self.core)
        return Empty()

    async def _release_pins(self, core: Scheduler) -> None:
        if self.kv is not None:
            pin_ids = core.take_pins_to_release()
            if pin_ids:
                await self.kv.release(pin_ids)

    async def _on_health(self, _: Empty) -> HealthReply:
        core = self.core
        detail = {"replica_id": self.config.replica_id, "worker_ready": core is not None,
                  "draining": self.draining}
        if core is not None:  # worker_id: the worker instance attached (tests wait on it)
            detail |= {"num_running": len(core.running), "num_waiting": len(core.waiting),
                       "worker_id": self._worker_id,
                       "worker_kv_store_id": self._worker_kv_store_id}
        status = "draining" if self.draining else "ok" if core is not None else "starting"
        return HealthReply(service="scheduler", instance_id=self.config.instance_id,
                           status=status, detail=detail)

    def _on_link(self, up: bool) -> None:
        """The bus's link to NATS dropped or came back (on the event loop)."""
        if up:
            self._stats_now.set()  # announce ourselves again at once
            return
        self._wakeup.set()  # an idle step loop notices now
        cutoff = time.monotonic() - RECENT_FINAL_S
        self._hold([emitted for at, emitted in self._recent_finals if at >= cutoff],
                   bus_lost_error())
        self._recent_finals.clear()

    # ------------------------------------------------------------ the step loop
    async def _connect_worker(self) -> None:
        """Wait for this replica's worker and size the block table from its cache."""
        subject = self.subjects.worker_attach(self.config.replica_id)
        while not self.draining:
            try:
                info = await self.bus.request(subject, Empty(), WorkerInfo, timeout=2.0)
            except ServiceUnavailable:
                await asyncio.sleep(ATTACH_RETRY_S)
                continue
            self._worker_info = info
            self.kv = self._kv_client(info.kv_namespace, info.kv_node_id)
            self._worker_kv_store_id = ""
            self.core = Scheduler(self.config, num_blocks=info.num_blocks,
                                  block_size=info.block_size, max_model_len=info.max_model_len,
                                  eos_token_ids=info.eos_token_ids, model_name=info.model_name,
                                  kvstore=self.kv is not None,
                                  block_bytes=info.kv_cache_bytes // max(info.num_blocks, 1))
            self._worker_id = info.worker_id
            self._bus_epoch = self.bus.num_disconnects  # attached over the link as it is now
            self._worker_link = None
            await self._ping_worker()  # learn its link count, to tell when it drops
            log.info("worker_connected", worker_id=info.worker_id, num_blocks=info.num_blocks,
                     block_size=info.block_size, max_model_len=info.max_model_len,
                     kv_namespace=info.kv_namespace, kv_node_id=info.kv_node_id)
            return

    def _kv_client(self, namespace: str, node_id: str) -> KvClient | None:
        """The kvstore to use: only with --kv-node-id and a worker attached to one."""
        info = self._worker_info
        if not self.config.kv_node_id or not namespace or info is None or info.num_blocks <= 0:
            return None
        return KvClient(self.bus, self.subjects, owner_id=self.config.instance_id,
                        node_id=node_id or self.config.kv_node_id, namespace=namespace,
                        block_bytes=info.kv_cache_bytes // info.num_blocks,
                        block_size=info.block_size, speeds=self.tier_speeds)

    def _learn_worker_kv(self, detail: dict) -> None:
        """The worker's kvstore as its ping reports it. A worker attaches to its kvstore
        after it starts (or again after the kvstore restarts), maybe after we attached to
        it: its WorkerInfo then named no kvstore, and only its pings tell us."""
        self._worker_kv_store_id = str(detail.get("kv_store_id", ""))
        namespace = str(detail.get("kv_namespace", ""))
        core = self.core
        if core is None or not namespace or (self.kv is not None and self.kv.namespace == namespace):
            return
        self.kv = self._kv_client(namespace, str(detail.get("kv_node_id", "")))
        if self.kv is not None:
            core.kv_tier.stores_enabled = True
            log.info("worker_kvstore_learned", kv_namespace=namespace,
                     kv_store_id=self._worker_kv_store_id)

    async def _step_loop(self) -> None:
        """Keep up to ``max_steps_in_flight`` steps at the worker: step N+1 is planned
        and queued while step N computes, so the worker never waits for the scheduler.
        Returns once draining with nothing left to do."""
        in_flight: deque[tuple[StepPlan, asyncio.Task]] = deque()
        try:
            while True:
                if self.core is None:
                    if self.draining:
                        return
                    await self._connect_worker()
                    continue
                core = self.core
                if self.bus.num_disconnects != self._bus_epoch:
                    self._bus_epoch = self.bus.num_disconnects
                    if core.has_work or in_flight:
                        _cancel(in_flight)
                        await self._reattach(bus_lost_error(), bus_lost=True)
                        continue
                if self.draining and not core.has_work and not in_flight:
                    return
                self._wakeup.clear()  # a submit after this point wakes the waits below
                while len(in_flight) < self.config.max_steps_in_flight and core.has_work:
                    plan = core.schedule()
                    if plan is None:
                        break
                    in_flight.append((plan, asyncio.create_task(self._run_step(plan))))
                await self._release_pins(core)  # unused hits of the requests just admitted
                if not in_flight:
                    try:
                        await asyncio.wait_for(self._wakeup.wait(), timeout=IDLE_CHECK_S)
                    except TimeoutError:
                        await self._check_worker_identity()
                    continue
                plan, step = in_flight[0]
                if len(in_flight) < self.config.max_steps_in_flight:
                    # Room for another step: also wake for a new request to queue one.
                    waiter = asyncio.create_task(self._wakeup.wait())
                    await asyncio.wait({step, waiter}, return_when=asyncio.FIRST_COMPLETED)
                    waiter.cancel()
                    if not step.done():
                        continue
                else:
                    await asyncio.wait({step})
                in_flight.popleft()
                try:
                    result = step.result()
                except FlotillaError as exc:
                    await self._worker_failed(plan, exc, in_flight)
                    continue
                self._record_step(plan, result)
                await self._publish(core.update(plan, result))
                await self._release_pins(core)  # the step's loads are done
        finally:
            _cancel(in_flight)

    async def _worker_failed(self, plan: StepPlan, exc: FlotillaError,
                             in_flight: deque[tuple[StepPlan, asyncio.Task]]) -> None:
        log.error("step_failed", step_id=plan.step_id, error=exc.message)
        _cancel(in_flight)
        if self.bus.num_disconnects != self._bus_epoch:  # our own link dropped
            self._bus_epoch = self.bus.num_disconnects
            await self._reattach(bus_lost_error(), bus_lost=True)
        else:
            await self._reattach(ServiceUnavailable(f"the worker failed: {exc.message}"))

    async def _reattach(self, error: FlotillaError, *, bus_lost: bool = False) -> None:
        """End every request with ``error``; the step loop then attaches the worker again
        (a fresh cache). The core goes first, so a submit arriving meanwhile is refused,
        not lost. After a lost link the errors wait for the link and the gateways."""
        old_core, self.core = self.core, None
        for tier, num_tokens in old_core.kv_tier.num_tokens_loaded.items():
            self._kv_tier_hits_before[tier] = self._kv_tier_hits_before.get(tier, 0) + num_tokens
        emitted = old_core.fail_all(error.to_info())
        await self._release_pins(old_core)
        log.warning("requests_failed", num_requests=len(emitted), reason=error.message)
        if bus_lost:
            self._hold(emitted, error)
        else:
            await self._publish(emitted)

    async def _ping_worker(self) -> HealthReply | None:
        """Ping this replica's worker; remember how often its link to NATS dropped."""
        try:
            reply = await self.bus.request(self.subjects.worker_ping(self.config.replica_id),
                                           Empty(), HealthReply, timeout=2.0)
        except FlotillaError:
            return None
        count = reply.detail.get(WORKER_LINK_KEY)
        if reply.instance_id == self._worker_id and isinstance(count, int):
            self._worker_link = max(count, self._worker_link or 0)
        if reply.instance_id == self._worker_id and self.config.kv_node_id:
            self._learn_worker_kv(reply.detail)
        return reply

    async def _check_worker_identity(self) -> None:
        """A worker restarted while we were idle has an empty cache that the prefix cache
        still points into: drop our state and attach to it, before a step reads stale KV."""
        reply = await self._ping_worker()
        if reply is None or self.core is None:
            return  # down: the next step fails and re-attaches
        if reply.instance_id != self._worker_id:
            log.warning("worker_replaced", old_worker_id=self._worker_id,
                        new_worker_id=reply.instance_id)
            await self._reattach(ServiceUnavailable("the worker restarted"))

    async def _run_step(self, plan: StepPlan) -> StepResult:
        """Send one step; while it runs, ping the worker every second so a dead worker,
        or one whose link to NATS dropped meanwhile (the step or its reply may be gone),
        fails the step in about a second instead of at the step timeout."""
        link_at_send = self._worker_link
        step = asyncio.create_task(self.bus.request(
            self.subjects.worker_step(self.config.replica_id),
            msgspec.structs.replace(plan, worker_id=self._worker_id), StepResult,
            timeout=self.config.step_timeout_s))
        try:
            while True:
                done, _ = await asyncio.wait({step}, timeout=1.0)
                if done:
                    return step.result()
                reply = await self._ping_worker()
                if reply is None:
                    raise ServiceUnavailable("the worker does not answer pings")
                if link_at_send is None:
                    link_at_send = self._worker_link
                elif self._worker_link != link_at_send:
                    raise ServiceUnavailable("the worker's connection to NATS dropped while it "
                                             "ran the step (its reply may be lost)")
        finally:
            step.cancel()

    def _record_step(self, plan: StepPlan, result: StepResult) -> None:
        num_tokens = sum(s.num_new_tokens for s in plan.scheduled)
        self._worker_busy_s += result.step_time_s
        num_prompt = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        self.tier_speeds.observe_step(num_tokens, num_prompt, result.step_time_s,  # routing too
                                      result.kv_load_bytes, result.kv_load_bytes_per_s)
        if len(self._step_samples) < MAX_STEP_SAMPLES:
            self._step_samples.append((num_tokens, result.step_time_s))
        log.debug("step_done", step_id=plan.step_id, num_scheduled=len(plan.scheduled),
                  num_tokens=num_tokens, worker_time_s=round(result.step_time_s, 4),
                  kv_load_bytes=result.kv_load_bytes,
                  kv_load_gb_per_s=round(result.kv_load_bytes_per_s / 1e9, 1))

    # ------------------------------------------------------------ outputs
    async def _publish(self, emitted: list[Emitted]) -> None:
        """Send outputs to their gateways. Never raises: with the link down, the final
        outputs are held as errors (earlier outputs of those requests may be lost too:
        the gateway resumes them from what it has) and the running requests fail at the
        step loop's next turn."""
        by_subject = defaultdict(list)
        for item in emitted:
            by_subject[item.output_subject].append(item.output)
        now = time.monotonic()
        for subject, outputs in by_subject.items():
            try:
                await self.bus.publish(subject, OutputBatch(outputs))
            except ServiceUnavailable:
                self._hold([Emitted(subject, o) for o in outputs if o.finish_reason is not None],
                           bus_lost_error())
                continue
            self._recent_finals.extend((now, Emitted(subject, o)) for o in outputs
                                       if o.finish_reason is not None)
        cutoff = now - RECENT_FINAL_S
        while self._recent_finals and self._recent_finals[0][0] < cutoff:
            self._recent_finals.popleft()

    def _hold(self, emitted: list[Emitted], error: FlotillaError) -> None:
        """Keep these as error outputs, to send once the link is back."""
        info = error.to_info()
        now = time.monotonic()
        for item in emitted:
            output = item.output
            if output.error is None:
                output = RequestOutput.failure(output.request_id, output.num_prompt_tokens, info)
            self._held.append(_Held(Emitted(item.output_subject, output), now))

    async def _redelivery_loop(self) -> None:
        while True:
            await asyncio.sleep(REDELIVERY_TICK_S)
            await self._send_held()

    async def _send_held(self, *, final: bool = False) -> None:
        """Send the held error outputs that are due (``final``: all of them, once)."""
        if not self._held or not self.bus.is_connected:
            return
        now = time.monotonic()
        due = [held for held in self._held if final or now - max(
            held.added_at, self.bus.connected_at) >= REDELIVERY_AFTER_S[held.num_sent]]
        by_subject = defaultdict(list)
        for held in due:
            by_subject[held.emitted.output_subject].append(held)
        try:
            for subject, items in by_subject.items():
                await self.bus.publish(subject, OutputBatch([h.emitted.output for h in items]))
                for held in items:
                    held.num_sent += 1
        except ServiceUnavailable:
            pass  # down again: the rest wait for the next reconnect
        finally:
            self._held = [held for held in self._held
                          if not final and held.num_sent < len(REDELIVERY_AFTER_S)]
        if due:
            log.info("error_outputs_sent", num_outputs=len(due), final=final)

    async def _keepalive_loop(self) -> None:
        """Keep this scheduler's pins at the kvstore (and send releases NATS held up); ask
        the worker which kvstore it is attached to now (a busy step loop rarely pings)."""
        while True:
            await asyncio.sleep(KEEPALIVE_INTERVAL_S)
            if self.kv is not None:
                await self.kv.keep_alive()
            if self.config.kv_node_id and self.core is not None:
                await self._ping_worker()

    # ------------------------------------------------------------ stats
    async def _stats_loop(self) -> None:
        last_wall, last_busy, was_busy = time.monotonic(), 0.0, False
        while True:
            core = self.core
            now, busy = time.monotonic(), self._worker_busy_s
            is_busy = bool(core and core.running)
            # Idle share of the worker's time over an interval with work throughout.
            idle_ratio = (max(0.0, 1.0 - (busy - last_busy) / (now - last_wall))
                          if was_busy and is_busy and now > last_wall else -1.0)
            last_wall, last_busy, was_busy = now, busy, is_busy
            samples, self._step_samples = self._step_samples, []
            try:
                await self.bus.publish(self.subjects.scheduler_stats,
                                       self._stats(core, idle_ratio, samples))
            except ServiceUnavailable:
                pass  # the link is down: the next ones go out once it is back
            self._stats_now.clear()
            try:
                await asyncio.wait_for(self._stats_now.wait(), self.config.stats_interval_s)
            except TimeoutError:
                pass

    def _stats(self, core: Scheduler | None, idle_ratio: float,
               samples: list[tuple[int, float]]) -> SchedulerStats:
        manager = core.block_manager if core else None
        tier_hits = dict(self._kv_tier_hits_before)
        for tier, num_tokens in (core.kv_tier.num_tokens_loaded.items() if core else ()):
            tier_hits[tier] = tier_hits.get(tier, 0) + num_tokens
        return SchedulerStats(
            scheduler_id=self.config.instance_id, replica_id=self.config.replica_id,
            timestamp=time.time(), num_running=len(core.running) if core else 0,
            num_waiting=len(core.waiting) if core else 0,
            num_blocks_used=manager.num_used_blocks if manager else 0,
            num_blocks_total=manager.num_blocks if manager else 0,
            num_steps=core.num_steps if core else 0,
            num_preemptions=core.num_preemptions if core else 0,
            # draining: not ready for new requests (gateways route around it)
            worker_ready=core is not None and not self.draining,
            num_prefix_queries=core.num_prefix_queries if core else 0,
            num_prefix_hits=core.num_prefix_hits if core else 0,
            num_kv_tier_hits=sum(tier_hits.values()), num_kv_tier_hits_by_tier=tier_hits,
            worker_busy_s=self._worker_busy_s, worker_idle_ratio=idle_ratio,
            recent_step_tokens=[tokens for tokens, _ in samples],
            recent_step_times_s=[seconds for _, seconds in samples],
            **routing_stats(core, self.tier_speeds, self.kv, self._worker_info,
                            self.block_events.seq))


def _cancel(in_flight: deque[tuple[StepPlan, asyncio.Task]]) -> None:
    for _, task in in_flight:
        task.cancel()
    in_flight.clear()


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, name=f"scheduler-{config.instance_id}",
                            on_lost=stop.set)
    service = SchedulerService(config, bus)
    await service.start()
    log.info("scheduler_started", replica_id=config.replica_id)
    try:
        await service.run(stop)
    finally:
        await bus.close()
    bus.exit_if_lost()
