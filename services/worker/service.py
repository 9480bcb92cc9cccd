"""The worker's NATS edge: answers its scheduler's step plans with sampled tokens."""

from __future__ import annotations

import asyncio

import structlog

from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.bus import Bus
from shared.messages import Empty, HealthReply, StepPlan, StepResult, WorkerInfo
from shared.models import resolve_model
from shared.subjects import Subjects

log = structlog.get_logger()


class WorkerService:
    def __init__(self, config: WorkerConfig, bus: Bus, runner: ModelRunner) -> None:
        self.config = config
        self.bus = bus
        self.runner = runner
        self.subjects = Subjects(config.namespace)
        self.num_steps = 0

    async def start(self) -> None:
        replica_id = self.config.replica_id
        # No queue group on step/attach: exactly one worker per replica id.
        await self.bus.serve(self.subjects.worker_step(replica_id), StepPlan, self._on_step)
        await self.bus.serve(self.subjects.worker_attach(replica_id), Empty, self._on_attach)
        await self.bus.serve(self.subjects.worker_ping(replica_id), Empty, self._on_health)
        await self.bus.serve(self.subjects.health("worker"), Empty, self._on_health,
                             queue=self.subjects.queue_group("worker"))

    async def _on_step(self, plan: StepPlan) -> StepResult:
        try:
            # The forward runs in a thread so health checks still answer during long steps.
            result = await asyncio.to_thread(self.runner.execute, plan)
        except Exception:
            self.runner.reset()  # the scheduler fails these requests; start clean
            raise
        self.num_steps += 1
        return result

    async def _on_attach(self, _: Empty) -> WorkerInfo:
        self.runner.reset()
        runner = self.runner
        log.info("scheduler_attached", num_blocks=runner.num_blocks)
        return WorkerInfo(
            worker_id=self.config.instance_id, replica_id=self.config.replica_id,
            model_name=runner.model_name, num_blocks=runner.num_blocks,
            block_size=runner.block_size, max_model_len=runner.max_model_len,
            eos_token_ids=list(runner.eos_token_ids), kv_cache_bytes=runner.kv_cache_bytes,
            device=str(runner.device), dtype=str(runner.dtype))

    async def _on_health(self, _: Empty) -> HealthReply:
        return HealthReply(service="worker", instance_id=self.config.instance_id, detail={
            "replica_id": self.config.replica_id, "num_blocks": self.runner.num_blocks,
            "num_steps": self.num_steps, "device": str(self.runner.device)})


async def serve(config: WorkerConfig, stop: asyncio.Event) -> None:
    model_files = resolve_model(config.model, config.cache_dir)
    runner = await asyncio.to_thread(ModelRunner, config, model_files)
    log.info("model_loaded", model=model_files.name, num_blocks=runner.num_blocks,
             kv_cache_bytes=runner.kv_cache_bytes, device=str(runner.device))
    bus = await Bus.connect(config.nats_url, name=f"worker-{config.instance_id}")
    service = WorkerService(config, bus, runner)
    await service.start()
    log.info("worker_started", replica_id=config.replica_id)
    try:
        await stop.wait()
    finally:
        await bus.close()
