"""The scheduler's NATS edge: takes requests, drives its worker one step at a time,
publishes each step's tokens to the gateways that asked, and reports stats."""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict

import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Emitted, Scheduler
from shared.bus import Bus
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import (
    AbortRequest, Empty, GenerateRequest, HealthReply, OutputBatch, SchedulerStats, StepResult,
    SubmitReply, WorkerInfo,
)
from shared.subjects import Subjects

log = structlog.get_logger()


class SchedulerService:
    def __init__(self, config: SchedulerConfig, bus: Bus) -> None:
        self.config = config
        self.bus = bus
        self.subjects = Subjects(config.namespace)
        self.core: Scheduler | None = None  # built once the worker says how big its cache is
        self.worker: WorkerInfo | None = None
        self._wakeup = asyncio.Event()

    async def start(self) -> None:
        queue = self.subjects.queue_group("scheduler")
        await self.bus.serve(self.subjects.scheduler_submit, GenerateRequest, self._on_submit, queue=queue)
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

    # ------------------------------------------------------------ loops
    async def _connect_worker(self) -> None:
        """Wait for this replica's worker and size the block table from its cache."""
        subject = self.subjects.worker_attach(self.config.replica_id)
        while True:
            try:
                info = await self.bus.request(subject, Empty(), WorkerInfo, timeout=2.0)
                break
            except ServiceUnavailable:
                await asyncio.sleep(0.5)
        self.worker = info
        self.core = Scheduler(self.config, num_blocks=info.num_blocks, block_size=info.block_size,
                              max_model_len=info.max_model_len, eos_token_ids=info.eos_token_ids)
        log.info("worker_connected", worker_id=info.worker_id, num_blocks=info.num_blocks,
                 block_size=info.block_size, max_model_len=info.max_model_len)

    async def _step_loop(self) -> None:
        await self._connect_worker()
        step_subject = self.subjects.worker_step(self.config.replica_id)
        while True:
            core = self.core
            plan = core.schedule() if core.has_work else None
            if plan is None:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            started = time.perf_counter()
            try:
                result = await self._run_step(step_subject, plan)
            except FlotillaError as exc:
                log.error("step_failed", step_id=plan.step_id, error=exc.message)
                error = ServiceUnavailable(f"the worker failed: {exc.message}").to_info()
                await self._publish(core.fail_all(error))
                self.core = None
                await self._connect_worker()  # a fresh cache: the old state is gone
                continue
            await self._publish(core.update(plan, result))
            log.debug("step_done", step_id=plan.step_id, num_scheduled=len(plan.scheduled),
                      num_tokens=sum(s.num_new_tokens for s in plan.scheduled),
                      step_time_s=round(time.perf_counter() - started, 4),
                      worker_time_s=round(result.step_time_s, 4))

    async def _run_step(self, step_subject: str, plan) -> StepResult:
        """Send one step; while it runs, ping the worker every second so a dead worker
        fails the step in about a second instead of at the step timeout."""
        step = asyncio.create_task(self.bus.request(step_subject, plan, StepResult,
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

    async def _publish(self, emitted: list[Emitted]) -> None:
        by_subject = defaultdict(list)
        for item in emitted:
            by_subject[item.output_subject].append(item.output)
        for subject, outputs in by_subject.items():
            await self.bus.publish(subject, OutputBatch(outputs))

    async def _stats_loop(self) -> None:
        while True:
            core = self.core
            await self.bus.publish(self.subjects.scheduler_stats, SchedulerStats(
                scheduler_id=self.config.instance_id, replica_id=self.config.replica_id,
                timestamp=time.time(),
                num_running=len(core.running) if core else 0,
                num_waiting=len(core.waiting) if core else 0,
                num_blocks_used=core.block_manager.num_used_blocks if core else 0,
                num_blocks_total=core.block_manager.num_blocks if core else 0,
                num_steps=core.num_steps if core else 0,
                num_preemptions=core.num_preemptions if core else 0,
                worker_ready=core is not None))
            await asyncio.sleep(self.config.stats_interval_s)


async def serve(config: SchedulerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, name=f"scheduler-{config.instance_id}")
    service = SchedulerService(config, bus)
    await service.start()
    log.info("scheduler_started", replica_id=config.replica_id)
    try:
        await service.run(stop)
    finally:
        await bus.close()
