"""The worker's upkeep of its node's kvstore (docs/kvstore.md), on the bus's event loop:
attach (map the host tier's arena and give the runner a ``KvConnector``), keep slots
reserved for stores, publish the commits of finished copies, a keepalive every
KV_KEEPALIVE_S, and attach again when the kvstore is absent, restarted or replaced. A
kvstore that does not answer is retried in the background; none of it ever holds up a
step. ``NoKvUpkeep`` is the worker's without ``--kv-node-id``.

The service calls ``after_submit`` and ``poll`` on the forward thread (after a step, and
while idle); everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor

import structlog

from services.worker.config import WorkerConfig
from services.worker.kv_offload import Commit, KvOffload, commit_messages
from services.worker.kv_tiers import KvTiers, attach_arena
from services.worker.runner import ModelRunner
from shared.bus import Bus
from shared.errors import FlotillaError
from shared.kv_messages import (
    KvAttachReply, KvAttachRequest, KvKeepAlive, KvLayout, KvReserveReply, KvReserveRequest,
)
from shared.models import weights_version
from shared.subjects import Subjects

log = structlog.get_logger()

KV_KEEPALIVE_S = 2.0  # also how often an absent or replaced kvstore is attached again
KV_REQUEST_TIMEOUT_S = 2.0


class NoKvUpkeep:
    """No kvstore: nothing to attach, keep or publish."""

    namespace = ""  # the kvstore namespace attached ("": none)
    node_id = ""  # the kvstore attached ("": none)

    async def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def after_submit(self) -> None:
        """(forward thread) A step was submitted."""

    def poll(self) -> bool:
        """(forward thread) Commit finished copies; True while copies are in flight."""
        return False

    def health_detail(self) -> dict:
        return {}


class KvUpkeep(NoKvUpkeep):
    def __init__(self, config: WorkerConfig, bus: Bus, runner: ModelRunner,
                 forward: Executor) -> None:
        self.config = config
        self.bus = bus
        self.runner = runner
        self.forward = forward  # the runner's thread: attach_kv runs there, between steps
        self.subjects = Subjects(config.namespace)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._layout: KvLayout | None = None
        self.namespace = ""  # "" while not attached
        self._task: asyncio.Task | None = None
        self._reserving = False
        self._attaching = False
        self.num_commits_dropped = 0

    @property
    def node_id(self) -> str:
        return self.config.kv_node_id if self.namespace else ""

    def _subject(self, verb: str) -> str:
        return self.subjects.kvstore(self.config.kv_node_id, verb)

    async def start(self) -> None:
        """One attach now (so the first scheduler learns of it), then the upkeep task."""
        self._loop = asyncio.get_running_loop()
        runner = self.runner
        self._layout = await self._loop.run_in_executor(None, lambda: runner.kv_layout(
            weights_version(runner.model_path, runner.seed)))
        await self._attach()
        self.start_upkeep()

    def start_upkeep(self) -> None:
        self._task = asyncio.create_task(self._maintain())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    # ---- on the forward thread
    def after_submit(self) -> None:
        if self.runner.kv.offload is not None:
            self._loop.call_soon_threadsafe(self._after_step)

    def poll(self) -> bool:
        offload = self.runner.kv.offload
        if offload is None:
            return False
        busy = offload.poll()
        if offload.has_commits:
            self._loop.call_soon_threadsafe(self._after_step)
        return busy

    # ---- on the event loop
    def health_detail(self) -> dict:
        offload = self.runner.kv.offload
        return {
            "kv_node_id": self.config.kv_node_id, "kv_attached": offload is not None,
            "kv_namespace": self.namespace,
            "kv_store_id": offload.store_id if offload else "",
            "kv_num_loaded": offload.num_loaded if offload else 0,
            "kv_num_stored": offload.num_stored if offload else 0,
            "kv_num_skipped": offload.num_skipped if offload else 0,
            "kv_num_recomputed": offload.num_recomputed if offload else 0,
            "kv_num_free_slots": offload.slot_pool.num_free if offload else 0,
            "kv_num_commits_dropped": self.num_commits_dropped}

    async def _attach(self) -> bool:
        """Attach to the node's kvstore, map its arena and use it from the next step on;
        False (and no kvstore) when it does not answer."""
        if self._attaching:
            return False
        self._attaching = True
        try:
            try:
                reply = await self.bus.request(self._subject("attach"), KvAttachRequest(
                    owner_id=self.config.instance_id, layout=self._layout,
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
            self.namespace = reply.namespace
            log.info("kvstore_attached", node_id=reply.node_id, store_id=reply.store_id,
                     namespace=reply.namespace, num_slots=reply.num_slots,
                     pinned=offload.tiers.pinned)
        finally:
            self._attaching = False
        await self._reserve()
        return True

    def _open_offload(self, reply: KvAttachReply) -> KvOffload:
        arena, inode = attach_arena(reply.arena_path)
        runner = self.runner
        try:
            if arena.store_id != reply.store_id:
                raise ValueError(f"the arena belongs to kvstore {arena.store_id!r}, not "
                                 f"{reply.store_id!r}")
            tiers = KvTiers(runner.kv_cache, arena, arena_inode=inode,
                            num_load_groups=runner.kv_load_groups)
        except Exception:
            arena.close()
            raise
        config = self.config
        return KvOffload(tiers, reply.store_id, runner.block_size, max_blocks_per_step=(
            -(-config.max_num_batched_tokens // runner.block_size) + config.max_num_seqs))

    async def _detach(self, why: str) -> None:
        log.warning("kvstore_detached", node_id=self.config.kv_node_id, reason=why)
        self.namespace = ""
        await self._loop.run_in_executor(self.forward, self.runner.attach_kv, None)

    async def _maintain(self) -> None:
        """Every KV_KEEPALIVE_S: attach when not attached, re-attach when the kvstore was
        replaced, else a keepalive (and slots, if low)."""
        while True:
            await asyncio.sleep(KV_KEEPALIVE_S)
            try:
                offload = self.runner.kv.offload
                if offload is None:
                    await self._attach()
                    continue
                if not offload.tiers.arena_is_current():
                    await self._detach("the kvstore's arena was replaced")
                    await self._attach()
                    continue
                await self.bus.publish(self._subject("keepalive"),
                                       KvKeepAlive(owner_id=self.config.instance_id))
                await self._reserve()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("kvstore_upkeep_failed")

    async def _reserve(self) -> None:
        offload = self.runner.kv.offload
        if offload is None or self._reserving or not offload.slots_wanted():
            return
        self._reserving = True
        try:
            reply = await self.bus.request(self._subject("reserve"), KvReserveRequest(
                namespace=self.namespace, owner_id=self.config.instance_id,
                num_slots=offload.slots_wanted()), KvReserveReply, timeout=KV_REQUEST_TIMEOUT_S)
        except FlotillaError as exc:
            log.info("kvstore_reserve_failed", error=str(exc))
            return
        finally:
            self._reserving = False
        if reply.store_id != offload.store_id:  # it restarted: our slot ids mean nothing now
            await self._detach("the kvstore restarted")
            await self._attach()
            return
        offload.slot_pool.add(reply.slot_ids)

    def _after_step(self) -> None:
        """Publish finished stores' commits; top up the slots."""
        offload = self.runner.kv.offload
        if offload is None:
            return
        commits = offload.take_commits()
        if commits:
            asyncio.create_task(self._publish(commits))
        if offload.slots_wanted() and not self._reserving:
            asyncio.create_task(self._reserve())

    async def _publish(self, commits: list[Commit]) -> None:
        for message in commit_messages(commits, self._layout.namespace,
                                       self.config.instance_id):
            try:
                await self.bus.publish(self._subject("commit"), message)
            except FlotillaError as exc:  # the reservation lapses at the kvstore
                self.num_commits_dropped += 1
                log.info("kvstore_commit_dropped", error=str(exc),
                         num_blocks=len(message.slot_ids))
