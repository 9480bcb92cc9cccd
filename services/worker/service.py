"""The worker's NATS edge: answers its scheduler's step plans with sampled tokens."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from concurrent.futures import Executor

import structlog

from services.worker.config import WorkerConfig
from services.worker.main_thread import MainThreadExecutor
from services.worker.runner import ModelRunner
from shared.bus import Bus
from shared.errors import ServiceUnavailable
from shared.messages import Empty, HealthReply, StepPlan, StepResult, WorkerInfo
from shared.models import resolve_model
from shared.runtime import freeze_startup_objects
from shared.subjects import Subjects

log = structlog.get_logger()

GIL_SWITCH_INTERVAL_S = 0.0002


class WorkerService:
    def __init__(self, config: WorkerConfig, bus: Bus, runner: ModelRunner,
                 forward: Executor) -> None:
        self.config = config
        self.bus = bus
        self.runner = runner
        self.subjects = Subjects(config.namespace)
        self.num_steps = 0
        self.forward = forward  # where runner.execute runs (the main thread)

    async def start(self) -> None:
        replica_id = self.config.replica_id
        # No queue group on step/attach: exactly one worker per replica id.
        await self.bus.serve(self.subjects.worker_step(replica_id), StepPlan, self._on_step)
        await self.bus.serve(self.subjects.worker_attach(replica_id), Empty, self._on_attach)
        await self.bus.serve(self.subjects.worker_ping(replica_id), Empty, self._on_health)
        await self.bus.serve(self.subjects.health("worker"), Empty, self._on_health,
                             queue=self.subjects.queue_group("worker"))

    async def _on_step(self, plan: StepPlan) -> StepResult:
        if plan.worker_id and plan.worker_id != self.config.instance_id:
            raise ServiceUnavailable(
                f"worker {self.config.instance_id} got a step planned for worker "
                f"{plan.worker_id}: it restarted and its cache is empty; the scheduler re-attaches")
        try:
            # Off the event loop, so pings still answer during long steps.
            result = await asyncio.get_running_loop().run_in_executor(
                self.forward, self.runner.execute, plan)
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


async def serve_bus(config: WorkerConfig, runner: ModelRunner, forward: Executor,
                    stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, name=f"worker-{config.instance_id}")
    service = WorkerService(config, bus, runner, forward)
    await service.start()
    log.info("worker_started", replica_id=config.replica_id)
    try:
        await stop.wait()
    finally:
        await bus.close()


def run(config: WorkerConfig) -> None:
    """Load the model and run forwards on the main thread; NATS runs in a second
    thread until SIGINT/SIGTERM."""
    # The bus thread must get the GIL quickly while the main thread launches a step's kernels
    # (pure Python for milliseconds on a GPU): at the default 5 ms switch interval, plans and
    # replies waited behind it and the GPU sat idle between steps.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    model_files = resolve_model(config.model, config.cache_dir)
    runner = ModelRunner(config, model_files)
    freeze_startup_objects()
    log.info("model_loaded", model=model_files.name, num_blocks=runner.num_blocks,
             kv_cache_bytes=runner.kv_cache_bytes, device=str(runner.device))
    forward = MainThreadExecutor()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def bus_main() -> None:
        try:
            loop.run_until_complete(serve_bus(config, runner, forward, stop))
        except Exception:  # noqa: BLE001 - logged; the process then exits
            log.exception("bus_failed")
        finally:
            forward.shutdown()  # without the bus the worker has nothing to do

    bus_thread = threading.Thread(target=bus_main, name="bus", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: forward.shutdown())
    bus_thread.start()
    forward.run_forever()
    loop.call_soon_threadsafe(stop.set)
    bus_thread.join(timeout=10)
