"""The worker's NATS edge: answers its scheduler's step plans with sampled tokens.

Plans run on the main thread (``runner.submit``); on CUDA a step is left in flight while the
next plan is prepared, so a step's reply comes when the next plan has been queued behind it,
or when the GPU has finished it and no plan came (the executor's idle hook).

On SIGTERM (or SIGINT) it keeps serving steps until none came for DRAIN_IDLE_S (its
scheduler drained, or is gone), at most ``shutdown_timeout`` seconds, then exits; a
second signal stops it at once. Its pings report how often its link to NATS dropped,
so the scheduler can tell a step whose reply may have been lost. A NATS connection
closed for good ends the process with EXIT_NATS_LOST.

With ``--kv-node-id`` it attaches to its node's kvstore (docs/kvstore.md): maps the host
tier's arena, keeps slots reserved for stores, publishes the commits of finished copies and a
keepalive. A kvstore that does not answer is retried in the background; none of it ever
holds up a step.
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
from services.worker.kv_offload import Commit, KvOffload, commit_messages
from services.worker.kv_tiers import KvTiers, attach_arena
from services.worker.main_thread import MainThreadExecutor
from services.worker.runner import ModelRunner
from shared.bus import EXIT_NATS_LOST, Bus
from shared.errors import FlotillaError, ServiceUnavailable
from shared.messages import (
    Empty, HealthReply, KvAttachReply, KvAttachRequest, KvKeepAlive, KvLayout,
    KvReserveReply, KvReserveRequest, StepPlan, StepResult, WorkerInfo,
)
from shared.models import resolve_model, weights_version
from shared.runtime import freeze_startup_objects
from shared.subjects import Subjects

log = structlog.get_logger()

GIL_SWITCH_INTERVAL_S = 0.0002
DRAIN_IDLE_S = 1.0  # draining: exit once no step came for this long
DRAIN_POLL_S = 0.1
KV_KEEPALIVE_S = 2.0  # also how often an absent or replaced kvstore is attached again
KV_REQUEST_TIMEOUT_S = 2.0


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
        # the kvstore (docs/kvstore.md); touched on the event loop
        self._kv_layout: KvLayout | None = None
        self._kv_namespace = ""  # "" while not attached
        self._kv_task: asyncio.Task | None = None
        self._kv_reserving = False
        self._kv_attaching = False
        self.num_kv_commits_dropped = 0

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
        if self.config.kv_node_id:
            runner = self.runner
            self._kv_layout = await self._loop.run_in_executor(None, lambda: runner.kv_layout(
                weights_version(runner.model_path, runner.seed)))
            await self._kv_attach()  # one try now, so the first scheduler learns of it
            self.start_kv_upkeep()

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
        try:
            # Off the event loop, so pings still answer during long steps.
            await loop.run_in_executor(self.forward, self._submit, plan)
            result = await reply
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
        if self.runner.kv_offload is not None:
            self._loop.call_soon_threadsafe(self._kv_after_step)

    def _poll_kv(self) -> bool:
        """Commit the stores whose copies finished; True while copies are in flight."""
        offload = self.runner.kv_offload
        if offload is None:
            return False
        busy = offload.poll()
        if offload.has_commits:
            self._loop.call_soon_threadsafe(self._kv_after_step)
        return busy

    def _read_back_when_done(self) -> bool:
        """The executor's idle hook: reply for the step in flight once the GPU is done with
        it (no next plan came to queue behind it), and commit finished KV stores; True
        while either is still running."""
        kv_busy = self._poll_kv()
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
        return WorkerInfo(
            worker_id=self.config.instance_id, replica_id=self.config.replica_id,
            model_name=runner.model_name, num_blocks=runner.num_blocks,
            block_size=runner.block_size, max_model_len=runner.max_model_len,
            eos_token_ids=list(runner.eos_token_ids), kv_cache_bytes=runner.kv_cache_bytes,
            device=str(runner.device), dtype=str(runner.dtype),
            kv_namespace=self._kv_namespace,
            kv_node_id=self.config.kv_node_id if self._kv_namespace else "")

    async def _on_health(self, _: Empty) -> HealthReply:
        detail = {
            "replica_id": self.config.replica_id, "num_blocks": self.runner.num_blocks,
            "num_steps": self.num_steps, "device": str(self.runner.device),
            "num_overlapped_steps": self.runner.num_overlapped_steps,
            "draining": self.draining, "nats_disconnects": self.bus.num_disconnects}
        if self.config.kv_node_id:
            offload = self.runner.kv_offload
            detail |= {
                "kv_node_id": self.config.kv_node_id, "kv_attached": offload is not None,
                "kv_namespace": self._kv_namespace,
                "kv_store_id": offload.store_id if offload else "",
                "kv_num_loaded": offload.num_loaded if offload else 0,
                "kv_num_stored": offload.num_stored if offload else 0,
                "kv_num_skipped": offload.num_skipped if offload else 0,
                "kv_num_recomputed": offload.num_recomputed if offload else 0,
                "kv_num_free_slots": offload.slot_pool.num_free if offload else 0,
                "kv_num_commits_dropped": self.num_kv_commits_dropped}
        return HealthReply(service="worker", instance_id=self.config.instance_id, detail=detail)

    # ---- the kvstore (event loop)
    async def _kv_attach(self) -> bool:
        """Attach to the node's kvstore, map its arena and use it from the next step on;
        False (and no kvstore) when it does not answer."""
        if self._kv_attaching:
            return False
        self._kv_attaching = True
        try:
            layout = self._kv_layout
            try:
                reply = await self.bus.request(
                    self.subjects.kvstore(self.config.kv_node_id, "attach"),
                    KvAttachRequest(owner_id=self.config.instance_id, layout=layout,
                                    itemsize=self.runner.kv_cache.element_size()),
                    KvAttachReply, timeout=KV_REQUEST_TIMEOUT_S)
            except FlotillaError as exc:
                log.info("kvstore_unavailable", node_id=self.config.kv_node_id, error=str(exc))
                return False
            try:  # mapping and pinning a large arena takes a while: off both loops
                offload = await self._loop.run_in_executor(None, self._open_offload, reply)
            except (OSError, ValueError) as exc:
                log.error("kvstore_arena_unusable", path=reply.arena_path, error=str(exc))
                return False
            await self._loop.run_in_executor(self.forward, self.runner.attach_kv, offload)
            self._kv_namespace = reply.namespace
            log.info("kvstore_attached", node_id=reply.node_id, store_id=reply.store_id,
                     namespace=reply.namespace, num_slots=reply.num_slots,
                     pinned=offload.tiers.pinned)
        finally:
            self._kv_attaching = False
        await self._kv_reserve()
        return True

    def _open_offload(self, reply: KvAttachReply) -> KvOffload:
        arena, inode = attach_arena(reply.arena_path)
        try:
            if arena.store_id != reply.store_id:
                raise ValueError(f"the arena belongs to kvstore {arena.store_id!r}, not "
                                 f"{reply.store_id!r}")
            tiers = KvTiers(self.runner.kv_cache, arena, arena_inode=inode,
                            num_load_groups=self.config.kv_load_layer_groups)
        except Exception:
            arena.close()
            raise
        config = self.config
        return KvOffload(tiers, reply.store_id, self.runner.block_size, max_blocks_per_step=(
            -(-config.max_num_batched_tokens // self.runner.block_size) + config.max_num_seqs))

    async def _kv_detach(self, why: str) -> None:
        log.warning("kvstore_detached", node_id=self.config.kv_node_id, reason=why)
        self._kv_namespace = ""
        await self._loop.run_in_executor(self.forward, self.runner.attach_kv, None)

    async def _kv_maintain(self) -> None:
        """Every KV_KEEPALIVE_S: attach when not attached, re-attach when the kvstore was
        replaced, else a keepalive (and slots, if low)."""
        while True:
            await asyncio.sleep(KV_KEEPALIVE_S)
            try:
                offload = self.runner.kv_offload
                if offload is None:
                    await self._kv_attach()
                    continue
                if not offload.tiers.arena_is_current():
                    await self._kv_detach("the kvstore's arena was replaced")
                    await self._kv_attach()
                    continue
                await self.bus.publish(self.subjects.kvstore(self.config.kv_node_id, "keepalive"),
                                       KvKeepAlive(owner_id=self.config.instance_id))
                await self._kv_reserve()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("kvstore_upkeep_failed")

    async def _kv_reserve(self) -> None:
        offload = self.runner.kv_offload
        if offload is None or self._kv_reserving or not offload.slots_wanted():
            return
        self._kv_reserving = True
        try:
            reply = await self.bus.request(
                self.subjects.kvstore(self.config.kv_node_id, "reserve"),
                KvReserveRequest(namespace=self._kv_namespace, owner_id=self.config.instance_id,
                                 num_slots=offload.slots_wanted()),
                KvReserveReply, timeout=KV_REQUEST_TIMEOUT_S)
        except FlotillaError as exc:
            log.info("kvstore_reserve_failed", error=str(exc))
            return
        finally:
            self._kv_reserving = False
        if reply.store_id != offload.store_id:  # it restarted: our slot ids mean nothing now
            await self._kv_detach("the kvstore restarted")
            await self._kv_attach()
            return
        offload.slot_pool.add(reply.slot_ids)

    def _kv_after_step(self) -> None:
        """Publish finished stores' commits; top up the slots."""
        offload = self.runner.kv_offload
        if offload is None:
            return
        commits = offload.take_commits()
        if commits:
            asyncio.create_task(self._kv_publish(commits))
        if offload.slots_wanted() and not self._kv_reserving:
            asyncio.create_task(self._kv_reserve())

    async def _kv_publish(self, commits: list[Commit]) -> None:
        subject = self.subjects.kvstore(self.config.kv_node_id, "commit")
        for message in commit_messages(commits, self._kv_layout.namespace,
                                       self.config.instance_id):
            try:
                await self.bus.publish(subject, message)
            except FlotillaError as exc:  # the reservation lapses at the kvstore
                self.num_kv_commits_dropped += 1
                log.info("kvstore_commit_dropped", error=str(exc),
                         num_blocks=len(message.slot_ids))

    def start_kv_upkeep(self) -> None:
        self._kv_task = asyncio.create_task(self._kv_maintain())

    def stop_kv_upkeep(self) -> None:
        if self._kv_task is not None:
            self._kv_task.cancel()
            self._kv_task = None

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
    try:
        await stop.wait()
        if not bus.lost_for_good:
            await service.drain(config.shutdown_timeout)
    finally:
        service.stop_kv_upkeep()
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
    runner = ModelRunner(config, model_files)
    freeze_startup_objects()
    log.info("model_loaded", model=model_files.name, num_blocks=runner.num_blocks,
             kv_cache_bytes=runner.kv_cache_bytes, device=str(runner.device))
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
    if outcome["exit_code"]:
        sys.exit(outcome["exit_code"])
