"""Which LoRA adapters the fleet serves (docs/lora.md): each live replica's registered
adapters, from its stats events or from its answer to a load or unload (whichever is
newer), and the run-time load and unload sent to every live replica.

A request's ``model`` names the base model or an adapter; an adapter no live replica has
is a 404 here, before anything is scheduled, and a request for one goes only to replicas
that have it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog

from shared.bus import Bus
from shared.errors import FlotillaError, NotFound, ServiceUnavailable
from shared.lora_adapters import LoraRef
from shared.messages import LoraLoadRequest, LoraReply, LoraUnloadRequest
from shared.scheduler_stats import SchedulerStats
from shared.subjects import Subjects

log = structlog.get_logger()


class LoraDirectory:
    def __init__(self) -> None:
        # scheduler id -> (its wall-clock time of the report, its adapters by name)
        self._by_scheduler: dict[str, tuple[float, dict[str, LoraRef]]] = {}
        self._instance: dict[str, str] = {}  # replica id -> its newest scheduler id
        # replica id -> what its previous scheduler instance served, until the new one is
        # given it back (a fleet of one replica has no peer to learn it from)
        self._lost: dict[str, dict[str, LoraRef]] = {}

    def observe(self, scheduler_id: str, timestamp: float, adapters: Sequence[LoraRef],
                replica_id: str = "") -> None:
        """A replica's adapters as of ``timestamp`` (an older report changes nothing). A
        new scheduler instance of ``replica_id`` keeps what the one before it served."""
        if replica_id:
            before = self._instance.get(replica_id)
            if before is not None and before != scheduler_id and before in self._by_scheduler:
                self._lost[replica_id] = self._by_scheduler[before][1]
            self._instance[replica_id] = scheduler_id
        known = self._by_scheduler.get(scheduler_id)
        if known is None or timestamp >= known[0]:
            self._by_scheduler[scheduler_id] = (timestamp, {a.name: a for a in adapters})

    def take_lost(self, replica_id: str) -> dict[str, LoraRef]:
        """What the replica's previous scheduler instance served (once)."""
        return self._lost.pop(replica_id, {})

    def unloaded(self, lora_name: str) -> None:
        """``lora_name`` was unloaded: no restarted replica gets it back."""
        for adapters in self._lost.values():
            adapters.pop(lora_name, None)

    def forget(self, scheduler_id: str) -> None:
        self._by_scheduler.pop(scheduler_id, None)

    def adapters(self, live_ids: Sequence[str]) -> dict[str, LoraRef]:
        """Every adapter a live replica has, by name (where replicas disagree on an
        adapter's version, the most recent report's)."""
        reports = sorted((self._by_scheduler[sid] for sid in live_ids if sid in
                          self._by_scheduler), key=lambda report: report[0])
        found: dict[str, LoraRef] = {}
        for _, adapters in reports:
            found.update(adapters)
        return found

    def holders(self, lora_name: str, live_ids: Sequence[str]) -> set[str]:
        """The live replicas that have adapter ``lora_name`` registered."""
        return {sid for sid in live_ids
                if lora_name in self._by_scheduler.get(sid, (0.0, {}))[1]}


def adapters_to_replay(own: Sequence[LoraRef], peers: dict[str, LoraRef]) -> list[LoraRef]:
    """The adapters a replica that just joined should load: those its live peers serve and
    it lacks (a restarted scheduler comes back with its --lora-modules only). An adapter no
    peer has any more, nor the replica's previous instance, was unloaded: not brought back."""
    names = {ref.name for ref in own}
    return [ref for name, ref in sorted(peers.items()) if name not in names]


class LoraControl:
    """Run-time loads and unloads, sent to every live replica at once; a replica that
    joins (or restarts) gets the adapters its peers loaded at run time."""

    def __init__(self, bus: Bus, subjects: Subjects, directory: LoraDirectory,
                 live_ids: Callable[[], list[str]], timeout_s: float) -> None:
        self.bus, self.subjects, self.directory = bus, subjects, directory
        self.live_ids, self.timeout_s = live_ids, timeout_s
        self._synced: set[str] = set()  # schedulers given their peers' adapters

    def adapters(self, scheduler_ids: list[str] | None = None) -> dict[str, LoraRef]:
        """The adapters the live replicas (or ``scheduler_ids``) have, by name."""
        return self.directory.adapters(self.live_ids() if scheduler_ids is None
                                       else scheduler_ids)

    def ready_for(self, lora_name: str, ready_ids: list[str]) -> tuple[LoraRef | None,
                                                                       list[str]]:
        """A request's adapter among the ready replicas (None: the base model, or one none
        of them has) and the replicas that can run it (all of them for the base)."""
        lora = self.adapters(ready_ids).get(lora_name) if lora_name else None
        if lora is None:
            return None, ready_ids
        holders = self.directory.holders(lora_name, ready_ids)
        return lora, [sid for sid in ready_ids if sid in holders]

    def observe(self, stats: SchedulerStats) -> Coroutine[Any, Any, None] | None:
        """A replica's stats: its adapters, and once its worker is attached the replay of
        what its peers serve (a task to run), the first time it is seen."""
        lora = stats.lora
        self.directory.observe(stats.scheduler_id, stats.timestamp, lora.adapters,
                               stats.replica_id)
        if not (stats.worker_ready and lora.max_loras):
            return None
        return self.sync_joined(stats.scheduler_id, lora.adapters, stats.replica_id)

    def sync_joined(self, scheduler_id: str, adapters: Sequence[LoraRef], replica_id: str = ""
                    ) -> Coroutine[Any, Any, None] | None:
        """Once per scheduler (None after the first call): the loads of what its live peers
        serve, or its replica's previous instance served, and it lacks, to run as a task."""
        if scheduler_id in self._synced:
            return None
        self._synced.add(scheduler_id)
        lost = self.directory.take_lost(replica_id) if replica_id else {}
        return self._replay(scheduler_id, adapters, lost)

    async def _replay(self, scheduler_id: str, adapters: Sequence[LoraRef],
                      lost: dict[str, LoraRef]) -> None:
        """A refusal is logged: the replica then serves what it has."""
        peers = lost | self.directory.adapters(
            [sid for sid in self.live_ids() if sid != scheduler_id])
        for ref in adapters_to_replay(adapters, peers):
            try:
                reply = await self.bus.request(
                    self.subjects.scheduler_lora(scheduler_id, "lora_load"),
                    LoraLoadRequest(lora_name=ref.name, lora_path=ref.path), LoraReply,
                    timeout=self.timeout_s)
            except FlotillaError as exc:
                log.warning("lora_replay_refused", scheduler_id=scheduler_id,
                            lora_name=ref.name, error=exc.message)
                continue
            self.directory.observe(scheduler_id, reply.timestamp, reply.adapters)
            log.info("lora_adapter_replayed", scheduler_id=scheduler_id, lora_name=ref.name)

    async def load(self, lora_name: str, lora_path: str, replace: bool) -> None:
        """Every live replica registers the adapter; the first refusal (a 400 naming what
        is wrong with it) is raised once all have answered."""
        await self._everywhere("lora_load", LoraLoadRequest(
            lora_name=lora_name, lora_path=lora_path, replace=replace))

    async def unload(self, lora_name: str) -> None:
        """Every live replica that has it drops it (requests in flight finish); 404
        when none has it."""
        holders = self.directory.holders(lora_name, self.live_ids())
        if not holders:
            raise NotFound(f"LoRA adapter {lora_name!r} is not loaded", param="lora_name",
                           code="model_not_found")
        await self._everywhere("lora_unload", LoraUnloadRequest(lora_name=lora_name),
                               sorted(holders))
        self.directory.unloaded(lora_name)

    async def _everywhere(self, verb: str, message, scheduler_ids: list[str] | None = None
                          ) -> None:
        scheduler_ids = scheduler_ids if scheduler_ids is not None else self.live_ids()
        if not scheduler_ids:
            raise ServiceUnavailable("no replica is ready to take the adapter")
        results = await asyncio.gather(*(self.bus.request(
            self.subjects.scheduler_lora(sid, verb), message, LoraReply,
            timeout=self.timeout_s) for sid in scheduler_ids), return_exceptions=True)
        errors = []
        for sid, result in zip(scheduler_ids, results, strict=True):
            if isinstance(result, LoraReply):
                self.directory.observe(sid, result.timestamp, result.adapters)
            elif isinstance(result, FlotillaError):
                errors.append(result)
                log.warning("lora_change_refused", verb=verb, scheduler_id=sid,
                            error=result.message)
            else:
                raise result
        if errors:
            # a refusal of the adapter itself (4xx) outranks a replica that did not answer
            raise min(errors, key=lambda e: (e.status >= 500, e.status))
        log.info("lora_adapters_changed", verb=verb, num_replicas=len(scheduler_ids))
