"""The scheduler's side of the KV connector seam (docs/kvstore.md; vLLM's KV connector is
the model for the split: a scheduler side and a worker side). The kvstore enters the
scheduler here and nowhere else:

- the shell (service.py) awaits ``prepare`` before a request queues (its blocks beyond
  the GPU prefix looked up, a hit worth loading pinned and checked to be of the kvstore
  the worker reads), ``release_pins`` after each planning and each step result,
  and ``keep_alive`` every couple of seconds;
- the core (scheduler.py) calls one synchronous hook per phase of a step (kv_tier.py):
  ``slots_to_load`` and ``on_admit`` at admission, ``on_block_cached``, ``take_plan``,
  ``on_step_result``, ``on_finish``, ``on_fail_all``.

``KvConnector`` is the null implementation: no kvstore (no ``--kv-node-id``, or a worker
attached to none): nothing is looked up, loaded or stored. ``TieredKvConnector`` is the
kvstore's: the ledger of kv_tier.py, the calls of kv_client.py (the choice in them is
tiering.py's). The service makes one per worker attach and swaps a null one for a tiered
one when a ping says the worker reached its kvstore; the counts of loaded tokens carry
over, so the stats stay cumulative.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from services.scheduler.config import SchedulerConfig
from services.scheduler.kv_client import KvClient
from services.scheduler.kv_tier import KvTierHooks, KvTierLedger, max_load_blocks
from services.scheduler.request import TierHit
from services.scheduler.scheduler import Scheduler
from services.scheduler.tiering import TierSpeeds
from shared.bus import Bus
from shared.messages import GenerateRequest, WorkerInfo, choice_request_ids
from shared.subjects import Subjects

log = structlog.get_logger()


@dataclass(frozen=True)
class Prepared:
    """A request as the kvstore leaves it, ready to queue: its pinned hit (None: a miss),
    the place in line it arrived at (taken before the lookup; None: now) and its block
    hashes (the lookup's, not computed twice)."""

    tier_hit: TierHit | None = None
    arrival_seq: int | None = None
    block_hashes: list[bytes] | None = None


class KvConnector(KvTierHooks):
    """No kvstore: the null connector (its core hooks are KvTierHooks')."""

    node_id = ""
    namespace = ""
    worker_store_id = ""  # the kvstore process the worker's arena belongs to ("": none)

    async def prepare(self, core: Scheduler, request: GenerateRequest) -> Prepared | None:
        """Ready ``request`` to queue in ``core``; None if it was aborted meanwhile."""
        return Prepared()

    async def let_go(self, prepared: Prepared) -> None:
        """The prepared request was not queued after all: release its hit."""

    def aborted(self, request_ids: list[str]) -> None:
        """An abort came for these (maybe while their lookup runs)."""

    async def release_pins(self) -> None:
        """Release the pins the core has done with."""

    async def keep_alive(self) -> None:
        """Keep this scheduler's pins at the kvstore."""

    def stats(self) -> dict:
        """The SchedulerStats fields of the kvstore."""
        return dict(num_kv_tier_hits=sum(self.num_tokens_loaded.values()),
                    num_kv_tier_hits_by_tier=dict(self.num_tokens_loaded),
                    kv_node_id=self.node_id, kv_namespace=self.namespace)


class TieredKvConnector(KvTierLedger, KvConnector):
    """The kvstore's connector: KvTierLedger's books behind the core's hooks, and the
    shell's calls through a KvClient of the worker's kvstore."""

    def __init__(self, client: KvClient, load_cap_blocks: int | None, *,
                 num_tokens_loaded: dict[str, int] | None = None) -> None:
        super().__init__(client.block_size, max_load_blocks=load_cap_blocks,
                         num_tokens_loaded=num_tokens_loaded)
        self.client = client
        self._looking_up: set[str] = set()  # request ids whose lookup runs
        self._aborted_while_looking_up: set[str] = set()
        self._queued_store_id = ""  # the kvstore process the queued hits were pinned by

    @property
    def node_id(self) -> str:
        return self.client.node_id

    @property
    def namespace(self) -> str:
        return self.client.namespace

    async def prepare(self, core: Scheduler, request: GenerateRequest) -> Prepared | None:
        """Look up (and pin) a hit worth loading, in the place in line the request arrived
        at. A hit of a kvstore other than the one the worker reads is let go, and so is
        the hit of a request aborted during its lookup."""
        core.validate(request)  # a bad request fails before any lookup
        client, seq, query = self.client, core.next_arrival_seq(), core.prefix_query(request)
        request_ids = choice_request_ids(request.request_id, request.n)
        hit: TierHit | None = None
        if query is not None and not self._looking_up.intersection(request_ids):
            self._looking_up.update(request_ids)
            try:
                hit = await client.find_hit(query, [*request.prompt_token_ids,
                                                    *request.output_token_ids])
            finally:
                self._looking_up.difference_update(request_ids)
        aborted = not self._aborted_while_looking_up.isdisjoint(request_ids)
        self._aborted_while_looking_up.difference_update(request_ids)
        if hit is not None and (aborted or hit.store_id != client.store_id
                                or hit.store_id != self.worker_store_id):
            await client.release([hit.pin_id])
            hit = None
        if aborted:
            return None
        self._drop_stale_hits(core)
        return Prepared(hit, seq, query.block_hashes if query is not None else None)

    def _drop_stale_hits(self, core: Scheduler) -> None:
        """Hits pinned by a kvstore that has restarted since are gone with it."""
        store_id = self.client.store_id
        if store_id != self._queued_store_id:
            if self._queued_store_id:
                log.warning("kvstore_restarted", old_store_id=self._queued_store_id,
                            store_id=store_id)
                core.drop_tier_hits(store_id)
            self._queued_store_id = store_id

    async def let_go(self, prepared: Prepared) -> None:
        if prepared.tier_hit is not None:
            await self.client.release([prepared.tier_hit.pin_id])

    def aborted(self, request_ids: list[str]) -> None:
        self._aborted_while_looking_up.update(self._looking_up.intersection(request_ids))

    async def release_pins(self) -> None:
        pin_ids = self.take_pins_to_release()
        if pin_ids:
            await self.client.release(pin_ids)

    async def keep_alive(self) -> None:
        await self.client.keep_alive()


@dataclass(frozen=True)
class KvConnectorFactory:
    """Makes the KV connector of an attached worker: the tiered one only with
    ``--kv-node-id`` and a worker attached to a kvstore."""

    config: SchedulerConfig
    bus: Bus
    subjects: Subjects
    speeds: TierSpeeds  # the scheduler's, measured across worker re-attaches

    def __call__(self, worker: WorkerInfo | None, namespace: str, node_id: str,
                 previous: KvConnector) -> KvConnector:
        """``namespace`` and ``node_id``: the worker's kvstore ("": none); the counts of
        loaded tokens carry over from ``previous``."""
        config, carried = self.config, previous.num_tokens_loaded
        if not config.kv_node_id or not namespace or worker is None or worker.num_blocks <= 0:
            return KvConnector(carried)
        block_bytes = worker.kv_cache_bytes // worker.num_blocks
        client = KvClient(self.bus, self.subjects, owner_id=config.instance_id,
                          node_id=node_id or config.kv_node_id, namespace=namespace,
                          block_bytes=block_bytes, block_size=worker.block_size,
                          speeds=self.speeds)
        return TieredKvConnector(client, max_load_blocks(config.max_kv_load_mib_per_step,
                                                         block_bytes), num_tokens_loaded=carried)
