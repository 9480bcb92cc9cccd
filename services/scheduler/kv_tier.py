"""The core's half of the scheduler's KV connector (kv_connector.py, docs/kvstore.md): one
synchronous hook per phase of a step, pure bookkeeping. ``KvTierHooks`` does nothing (no
kvstore: the core's default); ``KvTierLedger`` keeps the books of a kvstore:

- A load: a request admitted with a pinned tier hit gets fresh blocks for the part of
  the hit beyond its GPU prefix; the plan's ``KvLoad`` copies the slots into them before
  the step runs (the core enters the blocks in its prefix index marked as loaded, so
  they are never stored back). The pin is released once that step's result is back (the
  copy is done), or at once if no block of it is used. Past a plan's first hit, its
  loads are capped (``max_load_blocks``).
- A store (write-through): each block that enters the prefix index computed here (not
  loaded) goes into the next plan's ``KvStoreRun``s, once: the worker copies it out after
  that step's forward, so the step that computes it has run by then. The worker finds
  each block's tokens through its request, which it still holds for the plan that
  forgets it. A block the core no longer wants stored is skipped (evicted before the
  plan goes out, or no longer its request's at the worker: preempted and readmitted
  with other blocks: ``store_target``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping

import structlog

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request, TierHit
from services.scheduler.tiering import DISK, HOST
from shared.messages import KvLoad, KvStoreRun

log = structlog.get_logger()

# a block to store: (request id, block index, block id, block hash); a plain tuple, since a
# prefill step of 16,384 tokens makes ~1,000
_PendingStore = tuple[str, int, int, bytes]
# whether the worker, running the plan being built, holds (request id, block index, block
# id) with this content (block hash)
IsWanted = Callable[[str, int, int, bytes], bool]


def max_load_blocks(max_load_mib_per_step: int, block_bytes: int) -> int | None:
    """Blocks a plan loads past its first hit (0 MiB or an unknown block size: no cap)."""
    load_cap = max_load_mib_per_step << 20
    return max(1, load_cap // block_bytes) if load_cap and block_bytes else None


def store_target(requests: Mapping[str, Request], block_manager: BlockManager,
                 forget_ids: list[str]) -> IsWanted:
    """Whether block ``block_id`` still holds ``block_hash`` (not evicted) and the worker,
    running the plan that forgets ``forget_ids``, finds it at ``index`` of a request: it
    holds the running ones, and the ones it forgets until that plan's stores are made."""
    forgotten = set(forget_ids)
    holds = block_manager.holds

    def is_wanted(request_id: str, index: int, block_id: int, block_hash: bytes) -> bool:
        if not holds(block_id, block_hash):
            return False
        req = requests.get(request_id)
        if req is not None and req.known_to_worker:
            return index < len(req.block_table) and req.block_table[index] == block_id
        return request_id in forgotten

    return is_wanted


def drop_stale_tier_hits(waiting: list[Request], old_store_id: str, store_id: str) -> str:
    """Forget the queued hits of a kvstore process that has restarted since ``old_store_id``
    (the connector's store id changed): its pins and slots are gone with it. Returns the
    store id to remember."""
    if old_store_id and store_id != old_store_id:
        log.warning("kvstore_restarted", old_store_id=old_store_id, store_id=store_id)
        for req in waiting:
            if req.tier_hit is not None and req.tier_hit.store_id != store_id:
                req.tier_hit = None
    return store_id


def cache_loaded_blocks(block_manager: BlockManager, req: Request, first: int,
                        block_ids: list[int]) -> None:
    """Blocks loaded from the kvstore, ``first``.. of the request, enter the prefix index
    marked as loaded (never stored back)."""
    if not block_ids:
        return
    size, end = block_manager.block_size, first + len(block_ids)
    # each block's tokens as a tuple, cut lazily (a 16k-token hit: 1,023 blocks)
    block_tokens = zip(*[iter(req.all_token_ids[first * size:end * size])] * size)
    cache_block = block_manager.cache_block
    for block_id, block_hash, tokens in zip(block_ids, req.block_hashes[first:end],
                                            block_tokens):
        cache_block(block_id, block_hash, tokens, from_kvstore=True)


class KvTierHooks:
    """The core's hooks with no kvstore: nothing is loaded or stored (and with no
    kvstore no request comes with a tier hit)."""

    looks_up = False  # the connector looks each arrival up in a kvstore before it queues
    store_id = ""  # the kvstore process its hits are pinned by ("": none)

    def __init__(self, num_tokens_loaded: dict[str, int] | None = None) -> None:
        # tokens loaded, by the tier they were found in; carried over from the connector
        # before (the stats stay cumulative across worker re-attaches)
        self.num_tokens_loaded = dict(num_tokens_loaded or {HOST: 0, DISK: 0})

    def slots_to_load(self, hit: TierHit | None, num_gpu_blocks: int,
                      num_usable_blocks: int) -> range | None:
        """At admission: the indices into ``hit.slot_ids`` to load, after the GPU prefix
        (``num_gpu_blocks``) and within ``num_usable_blocks``; None when the plan's loads
        are full (the request waits for the next plan)."""
        return range(0)

    def on_admit(self, hit: TierHit | None, used: range, block_ids: list[int],
                 step_id: int) -> None:
        """A request is admitted: load the ``used`` slots of its hit into ``block_ids``
        in step ``step_id`` (none used: let the pin go). The hit is spent either way."""

    def on_block_cached(self, request_id: str, block_index: int, block_id: int,
                        block_hash: bytes) -> None:
        """A block computed here entered the prefix index."""

    def take_plan(self, is_wanted: IsWanted) -> tuple[list[KvLoad], list[KvStoreRun]]:
        """The loads and stores of the plan being built."""
        return [], []

    def on_step_result(self, step_id: int) -> None:
        """A step's result is back."""

    def on_finish(self, hit: TierHit | None) -> None:
        """A request ended with its hit unused (finished before admission used it)."""

    def on_fail_all(self) -> None:
        """The steps in flight will never report (the worker is gone or reset)."""


class KvTierLedger(KvTierHooks):
    def __init__(self, block_size: int, *, max_load_blocks: int | None = None,
                 num_tokens_loaded: dict[str, int] | None = None) -> None:
        super().__init__(num_tokens_loaded)
        self.block_size = block_size
        self.max_load_blocks = max_load_blocks  # past a plan's first hit (None: no cap)
        self._num_load_blocks = 0  # in the plan being built
        self._loads: list[KvLoad] = []  # for the plan being built
        self._stores: list[_PendingStore] = []
        self._pins_after_step: dict[int, list[str]] = {}  # step id -> pins its loads read
        self._pins_to_release: list[str] = []

    # ------------------------------------------------------------ loads
    def slots_to_load(self, hit: TierHit | None, num_gpu_blocks: int,
                      num_usable_blocks: int) -> range | None:
        """Empty when the GPU prefix ends before the hit starts (its blocks were evicted
        meanwhile: a gap cannot be loaded across); the last token is always computed."""
        if hit is None or num_gpu_blocks < hit.first_block_index:
            return range(0)
        end = min(len(hit.slot_ids), num_usable_blocks - hit.first_block_index)
        used = range(num_gpu_blocks - hit.first_block_index, max(end, 0))
        if used and self._num_load_blocks and self.max_load_blocks is not None and \
                self._num_load_blocks + len(used) > self.max_load_blocks:
            return None
        return used

    def on_admit(self, hit: TierHit | None, used: range, block_ids: list[int],
                 step_id: int) -> None:
        if hit is None:
            return
        if not used:
            self._pins_to_release.append(hit.pin_id)
            return
        self._loads.append(KvLoad([hit.slot_ids[i] for i in used], block_ids, hit.store_id))
        self._pins_after_step.setdefault(step_id, []).append(hit.pin_id)
        self._num_load_blocks += len(used)
        tiers = list(hit.tiers[used.start:used.stop])
        tiers += [HOST] * (len(used) - len(tiers))  # (a hit may name no tiers: host)
        for tier, count in Counter(tiers).items():
            self.num_tokens_loaded[tier] = self.num_tokens_loaded.get(tier, 0) + \
                count * self.block_size

    def on_finish(self, hit: TierHit | None) -> None:
        if hit is not None:
            self._pins_to_release.append(hit.pin_id)

    def on_step_result(self, step_id: int) -> None:
        """The slots the step loaded from are free to release."""
        self._pins_to_release.extend(self._pins_after_step.pop(step_id, ()))

    def on_fail_all(self) -> None:
        for pin_ids in self._pins_after_step.values():
            self._pins_to_release.extend(pin_ids)
        self._pins_after_step.clear()

    def take_pins_to_release(self) -> list[str]:
        pin_ids, self._pins_to_release = self._pins_to_release, []
        return pin_ids

    @property
    def num_pins_held(self) -> int:
        """Pins waiting for a step's result (tests; a request's own hit is not counted)."""
        return sum(len(pin_ids) for pin_ids in self._pins_after_step.values())

    # ------------------------------------------------------------ stores
    def on_block_cached(self, request_id: str, block_index: int, block_id: int,
                        block_hash: bytes) -> None:
        """Store it with the next plan."""
        self._stores.append((request_id, block_index, block_id, block_hash))

    # ------------------------------------------------------------ the plan's share
    def take_plan(self, is_wanted: IsWanted) -> tuple[list[KvLoad], list[KvStoreRun]]:
        loads, self._loads = self._loads, []
        self._num_load_blocks = 0
        return loads, self.take_plan_stores(is_wanted)

    def take_plan_stores(self, is_wanted: IsWanted) -> list[KvStoreRun]:
        """The pending stores as runs of consecutive blocks per request, less those
        ``is_wanted(request id, block index, block id, block hash)`` turns down."""
        runs: list[KvStoreRun] = []
        last: KvStoreRun | None = None
        for request_id, block_index, block_id, block_hash in self._stores:
            if not is_wanted(request_id, block_index, block_id, block_hash):
                continue
            if last is not None and last.request_id == request_id and \
                    last.first_block_index + len(last.block_ids) == block_index:
                last.block_ids.append(block_id)
                last.block_hashes.append(block_hash)
            else:
                last = KvStoreRun(request_id, block_index, [block_id], [block_hash])
                runs.append(last)
        self._stores = []
        return runs
