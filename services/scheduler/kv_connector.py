"""The scheduler's side of the KV connector seam (docs/kvstore.md; vLLM's KV connector is
the model for the split: a scheduler side and a worker side). The kvstore enters the
scheduler here and nowhere else. The scheduler asks; the connector answers:

- the shell (service.py) asks ``find_hit`` for a request the core has validated and
  given its place in line (intake.py), before the core queues it: a hit worth loading,
  pinned, of the kvstore the worker reads; ``let_go`` of one not queued after all;
  ``release_pins`` after each planning and each step result; ``keep_alive`` every couple
  of seconds;
- the core (scheduler.py) calls one synchronous hook per phase of a step (kv_tier.py):
  ``slots_to_load`` and ``on_admit`` at admission, ``on_block_cached``, ``take_plan``,
  ``on_step_result``, ``on_finish``, ``on_fail_all``; and reads ``looks_up`` and
  ``store_id``.

``NoKvConnector`` is the null implementation: no kvstore (no ``--kv-node-id``, or a worker
attached to none): nothing is looked up, loaded or stored. ``KvConnector`` is the
kvstore's: the ledger of kv_tier.py, the calls of kv_client.py (the choice in them is
tiering.py's). The service makes one per worker attach and swaps a null one for a real
one when a ping says the worker reached its kvstore; the counts of loaded tokens carry
over, so the stats stay cumulative.
"""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.config import SchedulerConfig
from services.scheduler.intake import Arrival
from services.scheduler.kv_client import KvClient
from services.scheduler.kv_tier import KvTierHooks, KvTierLedger, max_load_blocks
from services.scheduler.request import TierHit
from services.scheduler.tiering import TierSpeeds
from shared.bus import Bus
from shared.messages import WorkerInfo
from shared.subjects import Subjects


class NoKvConnector(KvTierHooks):
    """No kvstore: the null connector (its core hooks are KvTierHooks')."""

    node_id = ""
    namespace = ""
    worker_store_id = ""  # the kvstore process the worker's arena belongs to ("": none)

    async def find_hit(self, arrival: Arrival) -> TierHit | None:
        """A pinned hit of ``arrival``'s blocks worth loading; None: a miss."""
        return None

    async def let_go(self, hit: TierHit | None) -> None:
        """A hit whose request was not queued after all: release its pin."""

    async def release_pins(self) -> None:
        """Release the pins the core has done with."""

    async def keep_alive(self) -> None:
        """Keep this scheduler's pins at the kvstore."""


class KvConnector(KvTierLedger, NoKvConnector):
    """The kvstore's connector: KvTierLedger's books behind the core's hooks, and the
    shell's calls through a KvClient of the worker's kvstore."""

    looks_up = True

    def __init__(self, client: KvClient, load_cap_blocks: int | None, *,
                 num_tokens_loaded: dict[str, int] | None = None) -> None:
        super().__init__(client.block_size, max_load_blocks=load_cap_blocks,
                         num_tokens_loaded=num_tokens_loaded)
        self.client = client

    @property
    def node_id(self) -> str:
        return self.client.node_id

    @property
    def namespace(self) -> str:
        return self.client.namespace

    @property
    def store_id(self) -> str:
        return self.client.store_id

    async def find_hit(self, arrival: Arrival) -> TierHit | None:
        """Look up (and pin) a hit worth loading. A hit of a kvstore other than the one
        the worker reads is let go."""
        if arrival.query is None:
            return None
        client = self.client
        hit = await client.find_hit(arrival.query, arrival.token_ids)
        if hit is not None and (hit.store_id != client.store_id
                                or hit.store_id != self.worker_store_id):
            await client.release([hit.pin_id])
            return None
        return hit

    async def let_go(self, hit: TierHit | None) -> None:
        if hit is not None:
            await self.client.release([hit.pin_id])

    async def release_pins(self) -> None:
        pin_ids = self.take_pins_to_release()
        if pin_ids:
            await self.client.release(pin_ids)

    async def keep_alive(self) -> None:
        await self.client.keep_alive()


@dataclass(frozen=True)
class KvConnectorFactory:
    """Makes the KV connector of an attached worker: the kvstore's only with
    ``--kv-node-id`` and a worker attached to a kvstore."""

    config: SchedulerConfig
    bus: Bus
    subjects: Subjects
    speeds: TierSpeeds  # the scheduler's, measured across worker re-attaches

    def __call__(self, worker: WorkerInfo | None, namespace: str, node_id: str,
                 previous: NoKvConnector) -> NoKvConnector:
        """``namespace`` and ``node_id``: the worker's kvstore ("": none); the counts of
        loaded tokens carry over from ``previous``."""
        config, carried = self.config, previous.num_tokens_loaded
        if not config.kv_node_id or not namespace or worker is None or worker.num_blocks <= 0:
            return NoKvConnector(carried)
        block_bytes = worker.kv_cache_bytes // worker.num_blocks
        client = KvClient(self.bus, self.subjects, owner_id=config.instance_id,
                          node_id=node_id or config.kv_node_id, namespace=namespace,
                          block_bytes=block_bytes, block_size=worker.block_size,
                          speeds=self.speeds)
        return KvConnector(client, max_load_blocks(config.max_kv_load_mib_per_step,
                                                   block_bytes), num_tokens_loaded=carried)
