"""The worker's NATS edge: answers its scheduler's step plans with sampled tokens.

Plans run on the main thread (``runner.submit``); on CUDA a step is left in flight while the
next plan is prepared, so a step's reply comes when the next plan has been queued behind it,
or when the GPU has finished it and no plan came (the executor's idle hook).

On SIGTERM (or SIGINT) it keeps serving steps until none came for DRAIN_IDLE_S (its
scheduler drained, or is gone), at most ``shutdown_timeout`` seconds, then exits; a
second signal stops it at once. Its pings report how often its link to NATS dropped,
so the scheduler can tell a step whose reply may have been lost. A NATS connection
closed for good ends the process with EXIT_NATS_LOST.

With ``--kv-node-id`` it attaches to its node's kvstore (docs/kvstore.md): its upkeep
(kv_upkeep.py) maps the host tier's arena, keeps slots reserved for stores, publishes the
commits of finished copies and a keepalive; none of it ever holds up a step.
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from concurrent.futures import Executor

import structlog

from services.worker.config import WorkerConfig
from services.worker.kv_upkeep import KvUpkeep, NoKvUpkeep
from services.worker.main_thread import MainThreadExecutor
from services.worker.runner import ModelRunner
from services.worker.runner_build import build_runner
from services.worker.step_spans import record_prefill_spans
from services.worker.tp_group import start_group
from services.worker.tp_ranks import SingleRank
from shared.bus import EXIT_NATS_LOST, Bus
from shared.errors import ServiceUnavailable
from shared.messages import Empty, HealthReply, StepPlan, StepResult, WorkerInfo
from shared.models import resolve_model
from shared.runtime import freeze_startup_objects, log_startup
from shared.subjects import Subjects
from shared.tracing import spans_enabled

log = structlog.get_logger()

GIL_SWITCH_INTERVAL_S = 0.0002
DRAIN_IDLE_S = 1.0  # draining: exit once no step came for this long
DRAIN_POLL_S = 0.1


class WorkerService:
    def __init__(self, config: WorkerConfig, bus: Bus, runner: ModelRunner,
                 forward: Executor) -> None:
        self.config = config
        self.bus = bus
        self.runner = runner
        self.subjects = Subjects(config.namespace)
        self.num_steps = 0
        self.forward = forward  # where runner.submit runs (the main thread)
        self._loop: asyncio.AbstractEventLoop | None = None
        # step id -> the reply it waits for; touched only on the event loop
        self._results: dict[int, asyncio.Future[StepResult]] = {}
        self.num_running = 0  # steps being computed
        self.last_step_at = time.monotonic()  # when a step last came or ended
        self.draining = False
        # The step id due next: plans come numbered from 0 after each attach; one out of
        # order was sent before the scheduler re-attached (held up in a NATS outage).
        self._next_step_id: int | None = None  # None: no scheduler attached yet
        # the node's kvstore (docs/kvstore.md), or none
        self.kv_upkeep = KvUpkeep(config, bus, runner, forward) if config.kv_node_id \
            else NoKvUpkeep()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        if isinstance(self.forward, MainThreadExecutor):
            self.forward.on_idle = self._read_back_when_done
        replica_id = self.config.replica_id
        # No queue group on step/attach: exactly one worker per replica id.
        # Overlapping, step N's reply waits until step N+1 is queued behind it, so step N+1's
        # plan must not wait for step N's handler: handlers run concurrently (each still
        # starts in order). One step at a time, they run one after the other as before.
        await self.bus.serve(self.subjects.worker_step(replica_id), StepPlan, self._on_step,
                             concurrent=self.runner.overlap_steps)
        await self.bus.serve(self.subjects.worker_attach(replica_id), Empty, self._on_attach)
        await self.bus.serve(self.subjects.worker_ping(replica_id), Empty, self._on_health)
        await self.bus.serve(self.subjects.health("worker"), Empty, self._on_health,
                             queue=self.subjects.queue_group("worker"))
        await self.kv_upkeep.start()

    async def _on_step(self, plan: StepPlan) -> StepResult:
        if plan.worker_id and plan.worker_id != self.config.instance_id:
            raise ServiceUnavailable(
                f"worker {self.config.instance_id} got a step planned for worker "
                f"{plan.worker_id}: it restarted and its cache is empty; the scheduler re-attaches")
        if self._next_step_id is not None and plan.step_id != self._next_step_id:
            log.warning("stale_step_refused", step_id=plan.step_id,
                        expected_step_id=self._next_step_id)
            raise ServiceUnavailable(f"step {plan.step_id} is out of order (step "
                                     f"{self._next_step_id} is due): a stale step")
        self._next_step_id = plan.step_id + 1
        self.num_running += 1
        self.last_step_at = time.monotonic()
        loop = asyncio.get_running_loop()
        reply = self._results[plan.step_id] = loop.create_future()
        started_ns = time.time_ns() if spans_enabled() else 0  # 0: no span (tracing off)
        try:
            # Off the event loop, so pings still answer during long steps.
            await loop.run_in_executor(self.forward, self._submit, plan)
            result = await reply
            if started_ns and plan.new_requests:
                record_prefill_spans(plan, started_ns, time.time_ns())
        finally:
            if reply.done() and not reply.cancelled():
                reply.exception()  # failed along with the step that raised: seen there
            self._results.pop(plan.step_id, None)
            self.num_running -= 1
            self.last_step_at = time.monotonic()
        self.num_steps += 1
        return result

    # ---- on the main thread
    def _submit(self, plan: StepPlan) -> None:
        try:
            results = self.runner.submit(plan)
        except Exception as exc:
            self._fail_in_flight(exc)
            raise
        self._deliver(results)
        self.kv_upkeep.after_submit()

    def _read_back_when_done(self) -> bool:
        """The executor's idle hook: reply for the step in flight once the GPU is done with
        it (no next plan came to queue behind it), and commit finished KV stores; True
        while either is still running."""
        kv_busy = self.kv_upkeep.poll()
        if not self.runner.has_in_flight:
            return kv_busy
        if not self.runner.in_flight_done():
            return True
        try:
            results = self.runner.flush()
        except Exception as exc:  # noqa: BLE001 - the waiting handlers reply with it
            self._fail_in_flight(exc)
            return False
        self._deliver(results)
        return kv_busy

    def _fail_in_flight(self, exc: Exception) -> None:
        """A step failed: forget every request (the scheduler fails them) and fail every
        step still waiting for its reply."""
        self.runner.reset()
        self._loop.call_soon_threadsafe(self._fail_waiting, exc)

    def _deliver(self, results: list[StepResult]) -> None:
        for result in results:
            self._loop.call_soon_threadsafe(self._resolve, result)

    # ---- on the event loop
    def _resolve(self, result: StepResult) -> None:
        reply = self._results.get(result.step_id)
        if reply is not None and not reply.done():
            reply.set_result(result)

    def _fail_waiting(self, exc: Exception) -> None:
        for reply in self._results.values():
            if not reply.done():
                reply.set_exception(exc)

    async def _on_attach(self, _: Empty) -> WorkerInfo:
        self._next_step_id = 0  # at once: a stale step coming during the reset is refused
        # On the forward thread, after any step still computing (one sent before the
        # scheduler lost it, e.g. over a NATS outage): never a reset under a running step.
        started = time.monotonic()
        await asyncio.get_running_loop().run_in_executor(self.forward, self.runner.reset)
        self._fail_waiting(ServiceUnavailable("a scheduler attached: steps of the one before "
                                              "are dropped"))
        runner = self.runner
        log.info("scheduler_attached", num_blocks=runner.num_blocks,
                 waited_s=round(time.monotonic() - started, 3))
        log_startup("scheduler_attached")  # (each attach: the first is the one timed)
        return WorkerInfo(
            worker_id=self.config.instance_id, replica_id=self.config.replica_id,
            model_name=runner.model_name, num_blocks=runner.num_blocks,
            block_size=runner.block_size, max_model_len=runner.max_model_len,
            eos_token_ids=list(runner.eos_token_ids), kv_cache_bytes=runner.kv_cache_bytes,
            device=str(runner.device), dtype=str(runner.dtype),
            kv_namespace=self.kv_upkeep.namespace, kv_node_id=self.kv_upkeep.node_id,
            draft_model=self.config.draft_model or self.config.eagle_head,
            lora_base=runner.lora.base_shapes)

    async def _on_health(self, _: Empty) -> HealthReply:
        detail = {
            "replica_id": self.config.replica_id, "num_blocks": self.runner.num_blocks,
            "num_steps": self.num_steps, "device": str(self.runner.device),
            "num_overlapped_steps": self.runner.num_overlapped_steps,
            "tensor_parallel_size": self.runner.ranks.tp.size,
            "draining": self.draining, "nats_disconnects": self.bus.num_disconnects}
        detail |= self.kv_upkeep.health_detail()
        return HealthReply(service="worker", instance_id=self.config.instance_id, detail=detail)

    async def drain(self, timeout_s: float) -> None:
        """Keep serving until no step came for DRAIN_IDLE_S (at most ``timeout_s``)."""
        self.draining = True
        log.info("worker_draining", timeout_s=timeout_s)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.num_running and time.monotonic() - self.last_step_at >= DRAIN_IDLE_S:
                break
            await asyncio.sleep(DRAIN_POLL_S)
        log.info("worker_drained", num_steps=self.num_steps,
                 timed_out=time.monotonic() >= deadline)


async def serve_bus(config: WorkerConfig, runner: ModelRunner, forward: Executor,
                    stop: asyncio.Event, outcome: dict[str, int]) -> None:
    bus = await Bus.connect(config.nats_url, name=f"worker-{config.instance_id}",
                            on_lost=stop.set)
    service = WorkerService(config, bus, runner, forward)
    await service.start()
    log.info("worker_started", replica_id=config.replica_id)
    log_startup("serving")
    try:
        await stop.wait()
        if not bus.lost_for_good:
            await service.drain(config.shutdown_timeout)
    finally:
        service.kv_upkeep.stop()
        await bus.close()
        if bus.lost_for_good:
            outcome["exit_code"] = EXIT_NATS_LOST


def run(config: WorkerConfig) -> None:
    """Load the model and run forwards on the main thread; NATS runs in a second
    thread until SIGINT/SIGTERM (then the worker drains) or a lost NATS connection."""
    # The bus thread must get the GIL quickly while the main thread launches a step's kernels
    # (pure Python for milliseconds on a GPU): at the default 5 ms switch interval, plans and
    # replies waited behind it and the GPU sat idle between steps.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
    model_files = resolve_model(config.model, config.cache_dir)
    ranks = SingleRank()
    if config.tensor_parallel_size > 1:  # ranks 1.. spawned; rank 0 on its own GPU
        ranks, config = start_group(config, model_files)
    runner = build_runner(config, model_files, ranks)
    freeze_startup_objects()
    log.info("model_loaded", model=model_files.name, num_blocks=runner.num_blocks,
             kv_cache_bytes=runner.kv_cache_bytes, device=str(runner.device))
    log_startup("model_loaded")
    forward = MainThreadExecutor()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    outcome = {"exit_code": 0}

    def bus_main() -> None:
        try:
            loop.run_until_complete(serve_bus(config, runner, forward, stop, outcome))
        except Exception:  # noqa: BLE001 - logged; the process then exits
            log.exception("bus_failed")
            outcome["exit_code"] = 1
        finally:
            forward.shutdown()  # without the bus the worker has nothing to do

    num_signals = 0

    def on_signal(*_) -> None:
        nonlocal num_signals
        num_signals += 1
        if num_signals > 1:
            forward.shutdown()  # a second signal: now
            return
        try:
            loop.call_soon_threadsafe(stop.set)  # the bus thread drains, then stops forward
        except RuntimeError:  # its loop is gone already
            forward.shutdown()

    bus_thread = threading.Thread(target=bus_main, name="bus", daemon=True)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    bus_thread.start()
    forward.run_forever()
    try:
        loop.call_soon_threadsafe(stop.set)
    except RuntimeError:
        pass
    bus_thread.join(timeout=10)
    ranks.close()
    if outcome["exit_code"]:
        sys.exit(outcome["exit_code"])
