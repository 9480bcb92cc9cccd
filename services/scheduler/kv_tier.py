"""The scheduler's side of the kvstore (docs/kvstore.md): loads and stores that go into
the next step plan, and the pins to release. Pure bookkeeping; the service sends the
kvstore messages.

- A load: a request admitted with a pinned tier hit gets fresh blocks for the part of
  the hit beyond its GPU prefix; the plan's ``KvLoad`` copies the slots into them before
  the step runs. The blocks enter the prefix index marked as loaded, so they are never
  stored back. The pin is released once that step's result is back (the copy is done),
  or at once if no block of it is used.
- A store (write-through): each block that enters the prefix index computed here (not
  loaded) goes into the next plan's ``KvStoreRun``s, once: the worker copies it out after
  that step's forward, so the step that computes it has run by then. The worker finds
  each block's tokens through its request, which it still holds for the plan that
  forgets it. A block evicted before the plan goes out is skipped, and so is one that is
  no longer its request's at the worker (preempted and readmitted with other blocks).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import TierHit
from shared.messages import KvLoad, KvStoreRun


# a block to store: (request id, block index, block id, block hash); a plain tuple, since a
# prefill step of 16,384 tokens makes ~1,000
_PendingStore = tuple[str, int, int, bytes]


class KvTierLedger:
    def __init__(self, block_manager: BlockManager, stores_enabled: bool) -> None:
        self.block_manager = block_manager
        self.stores_enabled = stores_enabled  # the replica has a kvstore
        self._loads: list[KvLoad] = []  # for the plan being built
        self._stores: list[_PendingStore] = []
        self._pins_after_step: dict[int, list[str]] = {}  # step id -> pins its loads read
        self._pins_to_release: list[str] = []
        self.num_tokens_loaded: dict[str, int] = {"host": 0, "disk": 0}  # by tier found in

    # ------------------------------------------------------------ loads
    @staticmethod
    def usable_slots(hit: TierHit | None, num_gpu_blocks: int, num_usable_blocks: int) -> range:
        """Indices into ``hit.slot_ids`` of the blocks to load: those after the GPU prefix
        (``num_gpu_blocks`` blocks) and within the first ``num_usable_blocks`` (the last
        token is always computed). Empty when the GPU prefix ends before the hit starts
        (its blocks were evicted meanwhile: a gap cannot be loaded across)."""
        if hit is None or num_gpu_blocks < hit.first_block_index:
            return range(0)
        end = min(len(hit.slot_ids), num_usable_blocks - hit.first_block_index)
        return range(num_gpu_blocks - hit.first_block_index, max(end, 0))

    def load(self, hit: TierHit, used: range, block_ids: list[int], step_id: int,
             block_hashes: Sequence[bytes], token_ids: Sequence[int]) -> None:
        """Plan loading the ``used`` slots of ``hit`` into ``block_ids`` in step
        ``step_id``; ``block_hashes`` and ``token_ids`` are the request's (from its first
        block)."""
        if not used:
            self.release(hit)
            return
        self._loads.append(KvLoad([hit.slot_ids[i] for i in used], block_ids, hit.store_id))
        self._pins_after_step.setdefault(step_id, []).append(hit.pin_id)
        block_size = self.block_manager.block_size
        first = hit.first_block_index + used.start  # the first loaded block's index
        end = first + len(used)
        # each block's tokens as a tuple, cut lazily (a 16k-token hit: 1,023 blocks)
        block_tokens = zip(*[iter(token_ids[first * block_size:end * block_size])] * block_size)
        cache_block = self.block_manager.cache_block
        for block_id, block_hash, tokens in zip(block_ids, block_hashes[first:end], block_tokens):
            cache_block(block_id, block_hash, tokens, from_kvstore=True)
        tiers = list(hit.tiers[used.start:used.stop])
        tiers += ["host"] * (len(used) - len(tiers))  # (a hit may name no tiers: host)
        for tier, count in Counter(tiers).items():
            self.num_tokens_loaded[tier] = self.num_tokens_loaded.get(tier, 0) + count * block_size

    def release(self, hit: TierHit | None) -> None:
        if hit is not None:
            self._pins_to_release.append(hit.pin_id)

    def step_done(self, step_id: int) -> None:
        """A step's result is back: the slots it loaded from are free to release."""
        self._pins_to_release.extend(self._pins_after_step.pop(step_id, ()))

    def release_all_steps(self) -> None:
        """The steps in flight will never report (the worker is gone or reset)."""
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
    def block_cached(self, request_id: str, block_index: int, block_id: int,
                     block_hash: bytes) -> None:
        """A block computed here entered the prefix index: store it with the next plan."""
        if self.stores_enabled:
            self._stores.append((request_id, block_index, block_id, block_hash))

    # ------------------------------------------------------------ the plan's share
    def take_plan_loads(self) -> list[KvLoad]:
        loads, self._loads = self._loads, []
        return loads

    def take_plan_stores(self, is_requests_block: Callable[[str, int, int], bool]
                         ) -> list[KvStoreRun]:
        """The pending stores as runs of consecutive blocks per request, less those whose
        block was evicted, or that ``is_requests_block(request id, block index, block id)``
        says the worker will not find there."""
        runs: list[KvStoreRun] = []
        last: KvStoreRun | None = None
        holds = self.block_manager.holds
        for request_id, block_index, block_id, block_hash in self._stores:
            if not holds(block_id, block_hash) or \
                    not is_requests_block(request_id, block_index, block_id):
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
