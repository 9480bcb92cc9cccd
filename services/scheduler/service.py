"""The scheduler's NATS edge: takes requests, drives its worker with overlapped steps,
publishes each step's tokens to the gateways that asked, and reports stats.

Losing NATS: core NATS keeps nothing, so a step, its reply or an output sent around
the outage may be gone. When this scheduler's link drops, every request it holds fails
with a 503, the worker is re-attached (its cache reset) once the link is back, and the
error outputs wait in the outbox (outbox.py) to be sent again once the link returns.

The kvstore enters through the KV connector (kv_connector.py, null without a kvstore):
the core validates a request and gives it its place in line, then the connector's
``find_hit`` may await a lookup before the core queues it, so with ``--kv-node-id`` submits
are handled concurrently (each keeps the place in line it arrived at). The core is always
there: until a worker attaches (and while one re-attaches) it is a core over no blocks,
and submits are refused as "not ready"; once one attaches, stats say so at once.

For the gateways' KV-aware routing, the prefix cache's blocks are published as they come
and go, with a snapshot on request (block_events.py), and the stats name the prices.

Draining (SIGTERM): no new requests (the queue-group submit is unsubscribed, an
addressed submit gets 503 "draining", stats and health say so); running and waiting
requests finish for up to ``shutdown_timeout``; what is left then fails with a 503.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import msgspec
import structlog

from services.scheduler.block_events import BlockEventPublisher, routing_stats
from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_client import KEEPALIVE_INTERVAL_S
from services.scheduler.kv_connector import KvConnectorFactory, NoKvConnector
from services.scheduler.lora_handlers import LoraHandlers
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.outbox import Outbox, bus_lost_error
from services.scheduler.output_publisher import OutputPublisher
from services.scheduler.request_spans import request_spans
from services.scheduler.scheduler import Scheduler
from services.scheduler.step_stats import StepStats
from services.scheduler.tiering import TierSpeeds
from shared.bus import PING_INTERVAL_S, Bus
from shared.errors import FlotillaError, ServiceUnavailable, TooManyRequests
from shared.messages import (
    AbortRequest, Empty, GenerateRequest, HealthReply, StepPlan, StepResult, SubmitReply,
    WorkerInfo,
)
from shared.runtime import freeze_startup_objects, log_startup
from shared.subjects import Subjects

log = structlog.get_logger()

IDLE_CHECK_S = 1.0  # while idle, this often make sure the worker is the one attached
ATTACH_RETRY_S = 0.1  # (NATS refuses a request nothing answers at once: asking is cheap)
# A final output this recent may have been written into a link found dead later: a dead
# TCP link without a reset is found after about three ping intervals.
RECENT_FINAL_S = 3.0 * PING_INTERVAL_S
WORKER_LINK_KEY = "nats_disconnects"  # in the worker's ping reply


class SchedulerService:
    def __init__(self, config: SchedulerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.namespace)
        # the KV connector of the attached worker (the core's hooks are this one's)
        self.kv = NoKvConnector()
        # the LoRA adapters (--lora-modules, then run-time loads), across re-attaches
        self.loras = LoraRegistry(config.enable_lora, config.max_loras,
                                  config.lora_module_list)
        # replaced once a worker attaches and says how big its cache is
        self.core = Scheduler.without_worker(config, self.kv, self.loras)
        self._worker_id = ""  # the worker attached ("": none): its cache is what core tracks
        self._worker_link: int | None = None  # its count of NATS disconnects, from its pings
        self._wakeup = asyncio.Event()
        self._stats_now = asyncio.Event()
        self._bus_epoch = bus.num_disconnects  # link drops already acted on
        self.outbox = Outbox(RECENT_FINAL_S)
        self.spans = request_spans()  # each request's span (none with tracing off)
        self.outputs = OutputPublisher(bus, self.outbox, self.spans)  # to the waiting gateways
        self.draining = False
        self.tier_speeds = TierSpeeds()  # measured across worker re-attaches
        self.step_stats = StepStats(self.tier_speeds)
        self._new_kv_connector = KvConnectorFactory(config, bus, self.subjects, self.tier_speeds)
        self._worker_info: WorkerInfo | None = None
        self.block_events = BlockEventPublisher(  # the GPU tier, for the gateways' routing
            bus, self.subjects, config.instance_id, config.replica_id,
            lambda: self.core.block_manager)
        self.lora_handlers = LoraHandlers(
            self.loras, lambda: self._worker_info.lora_base if self.worker_attached else None,
            self._stats_now.set)
        bus.add_listener(self._on_link)

    @property
    def worker_attached(self) -> bool:
        return bool(self._worker_id)

    async def start(self) -> None:
        queue = self.subjects.queue_group("scheduler")
        concurrent = bool(self.config.kv_node_id)
        await self.bus.serve(self.subjects.scheduler_submit, GenerateRequest, self._on_submit,
                             queue=queue, concurrent=concurrent)
        await self.bus.serve(self.subjects.scheduler_submit_to(self.config.instance_id),
                             GenerateRequest, self._on_submit, concurrent=concurrent)
        await self.bus.serve(self.subjects.scheduler_abort(self.config.instance_id), AbortRequest,
                             self._on_abort)
        await self.bus.serve(self.subjects.health("scheduler"), Empty, self._on_health, queue=queue)
        await self.lora_handlers.serve(self.bus, self.subjects, self.config.instance_id)
        await self.block_events.start()

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop``, then drain. A step loop that crashes ends the process
        (raised here) rather than leaving a scheduler that answers but never steps."""
        step_loop = asyncio.create_task(self._step_loop())
        helpers = [asyncio.create_task(self._stats_loop()),
                   asyncio.create_task(self.outputs.redeliver()),
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
        log.info("scheduler_draining", num_running=len(core.running),
                 num_waiting=len(core.waiting),
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
        if self.core.requests:
            emitted = self.core.fail_all(ServiceUnavailable(
                f"the scheduler shut down before the request finished (it drained for "
                f"{self.config.shutdown_timeout:g}s)", code="shutdown").to_info())
            num_failed = len(emitted)
            await self.outputs.publish(emitted)
        await self.outputs.send_held(final=True)
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
        if not self.worker_attached:
            raise ServiceUnavailable("the worker is not ready yet")
        # Queued: what would still wait if every free batch slot were filled now (a request
        # submitted a moment ago sits in `waiting` until the next step admits it).
        core, kv = self.core, self.kv
        num_queued = len(core.running) + len(core.waiting) - self.config.max_num_seqs
        if num_queued >= self.config.max_queued_requests:
            raise TooManyRequests(f"the server is busy: {num_queued} requests are queued to "
                                  "run; try again later")
        arrival = core.arrive(request)  # validated here, the one time: before any lookup
        try:
            hit = await kv.find_hit(arrival)  # None: a miss (or no kvstore)
        except BaseException:
            core.withdraw(arrival)
            raise
        if arrival.aborted or self.core is not core or self.draining:
            core.withdraw(arrival)
            await kv.let_go(hit)
            if not arrival.aborted:  # (aborted: the gateway wants it no more)
                raise ServiceUnavailable("the scheduler re-attached its worker or began "
                                         "draining while the request arrived",
                                         code="draining" if self.draining else None)
        else:
            core.queue(arrival, hit)
            self.spans.submitted(request, core.model_name)
        self._wakeup.set()
        return SubmitReply(scheduler_id=self.config.instance_id)

    async def _on_abort(self, request: AbortRequest) -> Empty:
        self.core.abort(request.request_ids)  # (also those being looked up: intake.py)
        await self.kv.release_pins()
        return Empty()

    async def _on_health(self, _: Empty) -> HealthReply:
        core, attached = self.core, self.worker_attached
        detail = {"replica_id": self.config.replica_id, "worker_ready": attached,
                  "draining": self.draining}
        if attached:  # worker_id: the worker instance attached (tests wait on it)
            detail |= {"num_running": len(core.running), "num_waiting": len(core.waiting),
                       "worker_id": self._worker_id,
                       "worker_kv_store_id": self.kv.worker_store_id}
        status = "draining" if self.draining else "ok" if attached else "starting"
        return HealthReply(service="scheduler", instance_id=self.config.instance_id,
                           status=status, detail=detail)

    def _on_link(self, up: bool) -> None:
        """The bus's link to NATS dropped or came back (on the event loop)."""
        if up:
            self._stats_now.set()  # announce ourselves again at once
            return
        self._wakeup.set()  # an idle step loop notices now
        self.outbox.link_lost(time.monotonic())

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
            self.kv = self._new_kv_connector(info, info.kv_namespace, info.kv_node_id, self.kv)
            self.core = Scheduler(self.config, num_blocks=info.num_blocks,
                                  block_size=info.block_size, max_model_len=info.max_model_len,
                                  eos_token_ids=info.eos_token_ids, model_name=info.model_name,
                                  kv=self.kv, worker_drafts=bool(info.draft_model),
                                  gpu_streams=info.device.startswith("cuda"), loras=self.loras)
            if self.config.speculative_config and not self.core.drafter.enabled:
                log.error("speculation_off", worker_id=info.worker_id,
                          detail="--speculative-config names a draft model but the worker was "
                                 "started without --draft-model: nothing is drafted")
            self._worker_id = info.worker_id
            self.step_stats.worker_attached()  # its expert counts start from zero
            self._bus_epoch = self.bus.num_disconnects  # attached over the link as it is now
            self._worker_link = None
            await self._ping_worker()  # learn its link count, to tell when it drops
            log_startup("worker_connected", worker_id=info.worker_id, num_blocks=info.num_blocks,
                        block_size=info.block_size, max_model_len=info.max_model_len,
                        kv_namespace=info.kv_namespace, kv_node_id=info.kv_node_id)
            self._stats_now.set()  # ready: tell the gateways now, not at the next beat
            return

    def _learn_worker_kv(self, detail: dict) -> None:
        """The worker's kvstore as its ping reports it. A worker attaches to its kvstore
        after it starts (or again after the kvstore restarts), maybe after we attached to
        it: its WorkerInfo then named no kvstore, and only its pings tell us."""
        store_id = str(detail.get("kv_store_id", ""))
        namespace = str(detail.get("kv_namespace", ""))
        if namespace and namespace != self.kv.namespace:  # (pinged: a worker is attached)
            self.kv = self._new_kv_connector(
                self._worker_info, namespace, str(detail.get("kv_node_id", "")), self.kv)
            self.core.use_connector(self.kv)
            log.info("worker_kvstore_learned", kv_namespace=namespace, kv_store_id=store_id)
        # only this kvstore's slots can be loaded (the worker computes any other load)
        self.kv.worker_store_id = store_id

    async def _step_loop(self) -> None:
        """Keep up to ``max_steps_in_flight`` steps at the worker: step N+1 is planned
        and queued while step N computes, so the worker never waits for the scheduler.
        Returns once draining with nothing left to do."""
        in_flight: deque[tuple[StepPlan, asyncio.Task]] = deque()
        try:
            while True:
                if not self.worker_attached:
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
                await self.kv.release_pins()  # unused hits of the requests just admitted
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
                self.step_stats.record_step(plan, result)
                await self.outputs.publish(core.update(plan, result))
                await self.kv.release_pins()  # the step's loads are done
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
        old_core = self.core
        self.core = Scheduler.without_worker(self.config, self.kv, self.loras)
        self._worker_id = ""
        emitted = old_core.fail_all(error.to_info())
        await self.kv.release_pins()
        log.warning("requests_failed", num_requests=len(emitted), reason=error.message)
        if bus_lost:
            self.spans.outputs(emitted)  # (held, not published: their spans end now)
            self.outbox.hold(emitted, error, time.monotonic())
        else:
            await self.outputs.publish(emitted)

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
        if reply is None or not self.worker_attached:
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
            self.spans.traced(msgspec.structs.replace(plan, worker_id=self._worker_id)),
            StepResult,
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

    async def _keepalive_loop(self) -> None:
        """Keep this scheduler's pins at the kvstore (and send releases NATS held up); ask
        the worker which kvstore it is attached to now (a busy step loop rarely pings)."""
        while True:
            await asyncio.sleep(KEEPALIVE_INTERVAL_S)
            await self.kv.keep_alive()
            if self.config.kv_node_id and self.worker_attached:
                await self._ping_worker()

    # ------------------------------------------------------------ stats
    async def _stats_loop(self) -> None:
        while True:
            core, kv = self.core, self.kv
            routing = routing_stats(core, self.tier_speeds, self._worker_info, kv,
                                    self.block_events.seq)
            stats = self.step_stats.report(
                self.config, core, kv, routing, now=time.monotonic(),
                worker_ready=self.worker_attached and not self.draining)  # (else routed around)
            try:
                await self.bus.publish(self.subjects.scheduler_stats, stats)
            except ServiceUnavailable:
                pass  # the link is down: the next ones go out once it is back
            self._stats_now.clear()
            try:
                await asyncio.wait_for(self._stats_now.wait(), self.config.stats_interval_s)
            except TimeoutError:
                pass


def _cancel(in_flight: deque[tuple[StepPlan, asyncio.Task]]) -> None:
    for _, task in in_flight:
        task.cancel()
    in_flight.clear()


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, name=f"scheduler-{config.instance_id}",
                            on_lost=stop.set)
    service = SchedulerService(config, bus)
    await service.start()
    freeze_startup_objects()
    log_startup("serving", replica_id=config.replica_id)  # (the scheduler has started)
    try:
        await service.run(stop)
    finally:
        await bus.close()
    bus.exit_if_lost()
