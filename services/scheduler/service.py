"""The scheduler's NATS edge: takes requests, drives its worker with overlapped steps,
publishes each step's tokens to the gateways that asked, and reports stats."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict, deque

import msgspec
import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Emitted, Scheduler
from shared.bus import Bus
from shared.errors import FlotillaError, ServiceUnavailable, TooManyRequests
from shared.messages import (
    AbortRequest, Empty, GenerateRequest, HealthReply, OutputBatch, SchedulerStats, StepPlan,
    StepResult, SubmitReply, WorkerInfo,
)
from shared.subjects import Subjects

log = structlog.get_logger()

MAX_STEP_SAMPLES = 512  # per stats event
IDLE_CHECK_S = 1.0  # while idle, this often make sure the worker is the one attached


class SchedulerService:
    def __init__(self, config: SchedulerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.namespace)
        self.core: Scheduler | None = None  # built once the worker says how big its cache is
        self._worker_id = ""  # the worker instance attached: its cache is what core tracks
        self._wakeup = asyncio.Event()
        self._worker_busy_s = 0.0
        self._step_samples: list[tuple[int, float]] = []  # (tokens, seconds) since last stats

    async def start(self) -> None:
        queue = self.subjects.queue_group("scheduler")
        await self.bus.serve(self.subjects.scheduler_submit, GenerateRequest, self._on_submit, queue=queue)
        await self.bus.serve(self.subjects.scheduler_submit_to(self.config.instance_id),
                             GenerateRequest, self._on_submit)
        await self.bus.serve(self.subjects.scheduler_abort(self.config.instance_id), AbortRequest,
                             self._on_abort)
        await self.bus.serve(self.subjects.health("scheduler"), Empty, self._on_health, queue=queue)

    async def run(self, stop: asyncio.Event) -> None:
        tasks = [asyncio.create_task(self._step_loop()), asyncio.create_task(self._stats_loop())]
        await stop.wait()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    # ------------------------------------------------------------ handlers
    async def _on_submit(self, request: GenerateRequest) -> SubmitReply:
        if self.core is None:
            raise ServiceUnavailable("the worker is not ready yet")
        # Queued: what would still wait if every free batch slot were filled now (a request
        # submitted a moment ago sits in `waiting` until the next step admits it).
        core = self.core
        num_queued = len(core.running) + len(core.waiting) - self.config.max_num_seqs
        if num_queued >= self.config.max_queued_requests:
            raise TooManyRequests(f"the server is busy: {num_queued} requests are queued to "
                                  "run; try again later")
        self.core.add_request(request)
        self._wakeup.set()
        return SubmitReply(scheduler_id=self.config.instance_id)

    async def _on_abort(self, request: AbortRequest) -> Empty:
        if self.core is not None:
            self.core.abort(request.request_ids)
        return Empty()

    async def _on_health(self, _: Empty) -> HealthReply:
        core = self.core
        detail = {"replica_id": self.config.replica_id, "worker_ready": core is not None}
        if core is not None:
            detail |= {"num_running": len(core.running), "num_waiting": len(core.waiting)}
        return HealthReply(service="scheduler", instance_id=self.config.instance_id,
                           status="ok" if core is not None else "starting", detail=detail)

    # ------------------------------------------------------------ the step loop
    async def _connect_worker(self) -> None:
        """Wait for this replica's worker and size the block table from its cache."""
        subject = self.subjects.worker_attach(self.config.replica_id)
        while True:
            try:
                info = await self.bus.request(subject, Empty(), WorkerInfo, timeout=2.0)
                break
            except ServiceUnavailable:
                await asyncio.sleep(0.5)
        self.core = Scheduler(self.config, num_blocks=info.num_blocks, block_size=info.block_size,
                              max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids,
                              model_name=info.model_name)
        self._worker_id = info.worker_id
        log.info("worker_connected", worker_id=info.worker_id, num_blocks=info.num_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len)

    async def _step_loop(self) -> None:
        """Keep up to ``max_steps_in_flight`` steps at the worker: step N+1 is planned
        and queued while step N computes, so the worker never waits for the scheduler."""
        await self._connect_worker()
        in_flight: deque[tuple[StepPlan, asyncio.Task]] = deque()
        while True:
            core = self.core
            self._wakeup.clear()  # a submit after this point wakes the waits below
            while len(in_flight) < self.config.max_steps_in_flight and core.has_work:
                plan = core.schedule()
                if plan is None:
                    break
                in_flight.append((plan, asyncio.create_task(self._run_step(plan))))
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

    async def _worker_failed(self, plan: StepPlan, exc: FlotillaError,
                             in_flight: deque[tuple[StepPlan, asyncio.Task]]) -> None:
        log.error("step_failed", step_id=plan.step_id, error=exc.message)
        for _, other in in_flight:
            other.cancel()
        in_flight.clear()
        await self._reattach(ServiceUnavailable(f"the worker failed: {exc.message}"))

    async def _reattach(self, error: FlotillaError) -> None:
        """End every request with ``error`` and start over with the worker's fresh cache.
        The core goes first, so a submit arriving meanwhile is refused, not lost."""
        old_core, self.core = self.core, None
        await self._publish(old_core.fail_all(error.to_info()))
        await self._connect_worker()

    async def _check_worker_identity(self) -> None:
        """A worker restarted while we were idle has an empty cache that the prefix cache
        still points into: drop our state and attach to it, before a step reads stale KV."""
        try:
            reply = await self.bus.request(self.subjects.worker_ping(self.config.replica_id),
                                           Empty(), HealthReply, timeout=2.0)
        except FlotillaError:
            return  # down: the next step fails and re-attaches
        if reply.instance_id != self._worker_id:
            log.warning("worker_replaced", old_worker_id=self._worker_id,
                        new_worker_id=reply.instance_id)
            await self._reattach(ServiceUnavailable("the worker restarted"))

    async def _run_step(self, plan: StepPlan) -> StepResult:
        """Send one step; while it runs, ping the worker every second so a dead worker
        fails the step in about a second instead of at the step timeout."""
        step = asyncio.create_task(self.bus.request(
            self.subjects.worker_step(self.config.replica_id),
            msgspec.structs.replace(plan, worker_id=self._worker_id), StepResult,
            timeout=self.config.step_timeout_s))
        ping_subject = self.subjects.worker_ping(self.config.replica_id)
        try:
            while True:
                done, _ = await asyncio.wait({step}, timeout=1.0)
                if done:
                    return step.result()
                await self.bus.request(ping_subject, Empty(), HealthReply, timeout=2.0)
        finally:
            step.cancel()

    def _record_step(self, plan: StepPlan, result: StepResult) -> None:
        num_tokens = sum(s.num_new_tokens for s in plan.scheduled)
        self._worker_busy_s += result.step_time_s
        if len(self._step_samples) < MAX_STEP_SAMPLES:
            self._step_samples.append((num_tokens, result.step_time_s))
        log.debug("step_done", step_id=plan.step_id, num_scheduled=len(plan.scheduled),
                  num_tokens=num_tokens, worker_time_s=round(result.step_time_s, 4))

    async def _publish(self, emitted: list[Emitted]) -> None:
        by_subject = defaultdict(list)
        for item in emitted:
            by_subject[item.output_subject].append(item.output)
        for subject, outputs in by_subject.items():
            await self.bus.publish(subject, OutputBatch(outputs))

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
            await self.bus.publish(self.subjects.scheduler_stats, self._stats(core, idle_ratio, samples))
            await asyncio.sleep(self.config.stats_interval_s)

    def _stats(self, core: Scheduler | None, idle_ratio: float,
               samples: list[tuple[int, float]]) -> SchedulerStats:
        manager = core.block_manager if core else None
        return SchedulerStats(
            scheduler_id=self.config.instance_id, replica_id=self.config.replica_id,
            timestamp=time.time(), num_running=len(core.running) if core else 0,
            num_waiting=len(core.waiting) if core else 0,
            num_blocks_used=manager.num_used_blocks if manager else 0,
            num_blocks_total=manager.num_blocks if manager else 0,
            num_steps=core.num_steps if core else 0,
            num_preemptions=core.num_preemptions if core else 0,
            worker_ready=core is not None,
            num_prefix_queries=core.num_prefix_queries if core else 0,
            num_prefix_hits=core.num_prefix_hits if core else 0,
            worker_busy_s=self._worker_busy_s, worker_idle_ratio=idle_ratio,
            recent_step_tokens=[tokens for tokens, _ in samples],
            recent_step_times_s=[seconds for _, seconds in samples])


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, name=f"scheduler-{config.instance_id}")
    service = SchedulerService(config, bus)
    await service.start()
    log.info("scheduler_started", replica_id=config.replica_id)
    try:
        await service.run(stop)
    finally:
        await bus.close()
