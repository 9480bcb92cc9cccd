"""The runner's side of the kvstore: a plan's loads and stores, the slots reserved for
stores, and the commits of finished copies (docs/kvstore.md). No I/O: the worker service
fills the reservation and publishes the commits.

A store's token ids are read from the request's token list at the end of ``submit`` (after
the step before it is read back): with overlapped steps, the last token a stored block
holds may have been sampled by the step still in flight when the store was planned. Every
position a step has computed is on the host by then; a request finished meanwhile keeps its
list (only ever appended to), so its blocks commit all the same.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from services.worker.kv_tiers import KvTiers, LoadTiming, StoreCopy
from shared.messages import KvLoad, KvStoredBlock, KvStoreRun, ScheduledRequest, StepPlan

log = structlog.get_logger()


def recompute_unusable_loads(plan: StepPlan, offload: KvOffload | None,
                             block_size: int) -> tuple[StepPlan, int]:
    """The plan with the loads this worker cannot make turned into recomputes, and how
    many blocks that was. A load is unusable with no kvstore attached, with the arena
    replaced (the kvstore restarted, the worker has not re-attached yet), or when its
    slots were pinned by another kvstore process than the one attached (``store_id``):
    its slot ids would name other bytes here. Loads come only with a request's admission
    (it is in ``new_requests``), into blocks right after its GPU prefix, so that request
    starts computing at the first unusable block instead: a longer step (the request is
    added to it when it was only loading), the same tokens and the same
    ``num_computed_tokens`` after it, so the scheduler never knows."""
    if not plan.kv_loads:
        return plan, 0
    attached = offload is not None and offload.tiers.arena_is_current()
    usable, unusable_blocks = [], set()
    for load in plan.kv_loads:
        if attached and (not load.store_id or load.store_id == offload.store_id):
            usable.append(load)
        else:
            unusable_blocks.update(load.block_ids)
    if not unusable_blocks:
        return plan, 0
    extra_tokens: dict[str, int] = {}  # request id -> tokens computed instead of loaded
    new_requests = []
    for new in plan.new_requests:
        first = next((index for index, block_id in enumerate(new.block_ids)
                      if block_id in unusable_blocks), None)
        if first is not None and first * block_size < new.num_computed_tokens:
            extra_tokens[new.request_id] = new.num_computed_tokens - first * block_size
            new = msgspec.structs.replace(new, num_computed_tokens=first * block_size)
        new_requests.append(new)
    scheduled = [msgspec.structs.replace(s, num_new_tokens=s.num_new_tokens
                                         + extra_tokens[s.request_id])
                 if s.request_id in extra_tokens else s for s in plan.scheduled]
    # a request only loading in this step (it computes from a later one) computes the blocks
    # it could not load now, up to where the scheduler takes it to start (prompt chunks go
    # after the decodes)
    in_plan = {s.request_id for s in plan.scheduled}
    scheduled += [ScheduledRequest(request_id, num_tokens)
                  for request_id, num_tokens in extra_tokens.items() if request_id not in in_plan]
    log.warning("kv_loads_recomputed", step_id=plan.step_id, num_blocks=len(unusable_blocks),
                num_requests=len(extra_tokens),
                reason="no kvstore attached" if offload is None else
                "the arena was replaced" if not attached else "slots of another kvstore")
    return msgspec.structs.replace(plan, new_requests=new_requests, scheduled=scheduled,
                                   kv_loads=usable), len(unusable_blocks)


class SlotPool:
    """Free slots reserved from the kvstore: added on the bus thread, taken on the forward one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._slot_ids: list[int] = []

    def add(self, slot_ids: Sequence[int]) -> None:
        with self._lock:
            self._slot_ids.extend(slot_ids)

    def take(self, num_slots: int) -> list[int]:
        with self._lock:
            taken = self._slot_ids[:num_slots]
            del self._slot_ids[:num_slots]
            return taken

    @property
    def num_free(self) -> int:
        return len(self._slot_ids)


@dataclass
class BlockToStore:
    """One block of a KvStoreRun, checked against the request it names."""

    token_list: list[int]  # the request's token list (its tokens are read at the end of submit)
    block_index: int
    block_id: int
    block_hash: bytes
    computed_before: bool  # full before this step (else this step completes it)


@dataclass
class Commit:
    """What the service publishes as a KvCommitRequest."""

    store_id: str
    blocks: list[KvStoredBlock]
    returned_slot_ids: list[int] = field(default_factory=list)


@dataclass
class _StoreBatch:
    blocks: list[BlockToStore]
    slot_ids: list[int]
    token_ids: list[list[int]] | None = None  # set at the end of submit
    returned_slot_ids: list[int] = field(default_factory=list)


class KvOffload:
    def __init__(self, tiers: KvTiers, store_id: str, block_size: int,
                 target_free_slots: int = 0, max_blocks_per_step: int = 0) -> None:
        self.tiers = tiers
        self.store_id = store_id
        self.block_size = block_size
        self.slot_pool = SlotPool()
        # The most blocks one step can complete (a whole token budget of prompt): the pool
        # is topped up whenever it holds fewer, and the target is two steps' worth, so a
        # long prompt's blocks are not skipped for want of slots (a 1,000-token prompt,
        # 62 blocks, was cut to 45 with a fixed target of an eighth of a 364-slot arena).
        # The kvstore caps all reservations at half its slots anyway.
        self.max_blocks_per_step = max_blocks_per_step
        self.target_free_slots = target_free_slots or min(tiers.num_slots // 2, max(
            16, min(1024, tiers.num_slots // 8), 2 * max_blocks_per_step))
        self.num_loaded = 0  # blocks loaded
        self.num_stored = 0  # blocks committed
        self.num_skipped = 0  # blocks not stored (no reserved slot, or refused)
        self.num_recomputed = 0  # blocks of unusable loads, computed instead
        self._awaiting_tokens: list[StoreCopy] = []
        self._commits: deque[Commit] = deque()  # appended on the forward thread, taken on the bus's

    # ------------------------------------------------------------ reservation
    def slots_wanted(self) -> int:
        """Slots to reserve now (0: enough free for the next step)."""
        num_free = self.slot_pool.num_free
        low_water = max(self.target_free_slots // 2,
                        min(self.max_blocks_per_step, self.target_free_slots))
        return self.target_free_slots - num_free if num_free < low_water else 0

    # ------------------------------------------------------------ a step (forward thread)
    def load(self, loads: Sequence[KvLoad]) -> LoadTiming:
        if not self.tiers.arena_is_current():
            raise ValueError("the kvstore's arena was replaced (the kvstore restarted): loads "
                             "are refused until the worker re-attaches to it")
        slot_ids = [slot_id for load in loads for slot_id in load.slot_ids]
        block_ids = [block_id for load in loads for block_id in load.block_ids]
        timing = self.tiers.load(slot_ids, block_ids)
        self.num_loaded += len(block_ids)
        return timing

    def resolve_stores(self, runs: Sequence[KvStoreRun],
                       lookup: Callable[[str], tuple[list[int], list[int], int, int] | None]
                       ) -> list[BlockToStore]:
        """The blocks of ``runs`` that are full and computed once this step has run.

        ``lookup(request_id)`` gives the request's (token list, block table after this step,
        computed tokens before this step, after it), or None when the request is unknown."""
        blocks: list[BlockToStore] = []
        for run in runs:
            found = lookup(run.request_id)
            reason = None
            if found is None:
                reason = "unknown request"
            elif len(run.block_ids) != len(run.block_hashes):
                reason = "block ids and hashes differ in number"
            else:
                token_list, block_table, computed_before, computed_after = found
                end = run.first_block_index + len(run.block_ids)
                if run.first_block_index < 0 or list(block_table[run.first_block_index:end]) \
                        != list(run.block_ids):
                    reason = "blocks are not the request's"
                elif end * self.block_size > computed_after:
                    reason = "blocks not computed"
            if reason is not None:
                log.warning("kv_store_refused", request_id=run.request_id, reason=reason,
                            num_blocks=len(run.block_ids))
                self.num_skipped += len(run.block_ids)
                continue
            for offset, (block_id, block_hash) in enumerate(zip(run.block_ids,
                                                                run.block_hashes)):
                index = run.first_block_index + offset
                blocks.append(BlockToStore(
                    token_list, index, block_id, block_hash,
                    computed_before=(index + 1) * self.block_size <= computed_before))
        return blocks

    def store(self, blocks: Sequence[BlockToStore]) -> None:
        """Copy ``blocks`` out after the work queued so far, into reserved slots (a block
        with no slot left is skipped: storing is best effort)."""
        if not blocks:
            return
        slot_ids = self.slot_pool.take(len(blocks))
        if len(slot_ids) < len(blocks):
            self.num_skipped += len(blocks) - len(slot_ids)
            log.debug("kv_store_skipped", num_blocks=len(blocks) - len(slot_ids),
                      reason="no reserved slot")
            blocks = blocks[:len(slot_ids)]
        if not blocks:
            return
        copy = self.tiers.store([block.block_id for block in blocks], slot_ids,
                                payload=_StoreBatch(list(blocks), slot_ids))
        self._awaiting_tokens.append(copy)

    def end_submit(self) -> None:
        """Read the token ids of this submit's stores (every computed token is on the host
        now), and commit what has finished copying."""
        for copy in self._awaiting_tokens:
            self._read_tokens(copy.payload)
        self._awaiting_tokens.clear()
        self.poll()

    def poll(self) -> bool:
        """Commit the stores whose copies are complete; True while copies are in flight."""
        for copy in self.tiers.completed():
            batch: _StoreBatch = copy.payload
            if batch.token_ids is None:  # the submit that queued it raised before its end
                self._awaiting_tokens.remove(copy)
                self._read_tokens(batch)
            returned = set(batch.returned_slot_ids)
            stored = [KvStoredBlock(block.block_hash, slot_id, token_ids)
                      for block, slot_id, token_ids in zip(batch.blocks, batch.slot_ids,
                                                           batch.token_ids)
                      if slot_id not in returned]
            self.num_stored += len(stored)
            self._commits.append(Commit(self.store_id, stored, batch.returned_slot_ids))
        return self.tiers.has_pending

    def _read_tokens(self, batch: _StoreBatch) -> None:
        batch.token_ids = []
        for block, slot_id in zip(batch.blocks, batch.slot_ids):
            start = block.block_index * self.block_size
            token_ids = block.token_list[start:start + self.block_size]
            if len(token_ids) < self.block_size:  # not on the host: never guess, give it back
                batch.returned_slot_ids.append(slot_id)
                self.num_skipped += 1
            batch.token_ids.append(token_ids)

    @property
    def has_commits(self) -> bool:
        return bool(self._commits)

    def take_commits(self) -> list[Commit]:
        """Commits ready to publish (any thread)."""
        commits = []
        while self._commits:
            commits.append(self._commits.popleft())
        return commits

    def close(self) -> None:
        """Wait for the copies, then unmap the arena (their commits are dropped: the
        kvstore they were for is gone or replaced)."""
        self.tiers.close()
