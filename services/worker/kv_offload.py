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

import itertools
import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec
import structlog

from services.worker.kv_tiers import KvTiers, LoadTiming, StoreCopy
from shared.messages import KvLoad, KvStoreRun, ScheduledRequest, StepPlan
from shared.kv_messages import KvCommitRequest

log = structlog.get_logger()

MAX_TOKENS_PER_COMMIT = 32768  # a commit message stays far below NATS's 1 MB payload (~250 KB)


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
class BlocksToStore:
    """Consecutive blocks of one request (a KvStoreRun, or part of one), checked against
    the request: all full before this step (``computed_before``), or all completed by it.
    Stores go by runs, not blocks: a step completes ~1,000 blocks in a few dozen runs."""

    token_list: list[int]  # the request's token list (its tokens are read at the end of submit)
    first_block_index: int
    block_ids: list[int]
    block_hashes: list[bytes]
    computed_before: bool  # full before this step (else this step completes them)

    def __len__(self) -> int:
        return len(self.block_ids)


@dataclass
class Commit:
    """What the service publishes (``commit_messages``), as columns: block i is
    ``block_hashes[i]``, copied into ``slot_ids[i]``, holding
    ``token_ids[i * block_size:(i + 1) * block_size]``."""

    store_id: str
    block_size: int
    block_hashes: list[bytes]
    slot_ids: list[int]
    token_ids: list[int]
    returned_slot_ids: list[int] = field(default_factory=list)


@dataclass
class _StoreBatch:
    runs: list[BlocksToStore]
    slot_ids: list[int]  # one per block of the runs, in order
    commit: Commit | None = None  # set at the end of submit, once the token ids are read


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
    def load(self, loads: Sequence[KvLoad], *, in_layer_groups: bool = True) -> LoadTiming:
        if not self.tiers.arena_is_current():
            raise ValueError("the kvstore's arena was replaced (the kvstore restarted): loads "
                             "are refused until the worker re-attaches to it")
        slot_ids = [slot_id for load in loads for slot_id in load.slot_ids]
        block_ids = [block_id for load in loads for block_id in load.block_ids]
        timing = self.tiers.load(slot_ids, block_ids, in_layer_groups=in_layer_groups)
        self.num_loaded += len(block_ids)
        return timing

    def resolve_stores(self, runs: Sequence[KvStoreRun],
                       lookup: Callable[[str], tuple[list[int], list[int], int, int] | None]
                       ) -> list[BlocksToStore]:
        """The parts of ``runs`` that are full and computed once this step has run: per run,
        the blocks full before this step, then those this step completes.

        ``lookup(request_id)`` gives the request's (token list, block table after this step,
        computed tokens before this step, after it), or None when the request is unknown."""
        found_runs: list[BlocksToStore] = []
        block_size = self.block_size
        for run in runs:
            found = lookup(run.request_id)
            first, block_ids = run.first_block_index, run.block_ids
            reason = None
            if found is None:
                reason = "unknown request"
            elif len(block_ids) != len(run.block_hashes):
                reason = "block ids and hashes differ in number"
            else:
                token_list, block_table, computed_before, computed_after = found
                end = first + len(block_ids)
                if first < 0 or list(block_table[first:end]) != list(block_ids):
                    reason = "blocks are not the request's"
                elif end * block_size > computed_after:
                    reason = "blocks not computed"
            if reason is not None:
                log.warning("kv_store_refused", request_id=run.request_id, reason=reason,
                            num_blocks=len(block_ids))
                self.num_skipped += len(block_ids)
                continue
            # blocks first .. first + num_before - 1 were full before this step
            num_before = min(max(computed_before // block_size - first, 0), len(block_ids))
            if num_before:
                found_runs.append(BlocksToStore(token_list, first, block_ids[:num_before],
                                                run.block_hashes[:num_before], True))
            if num_before < len(block_ids):
                found_runs.append(BlocksToStore(token_list, first + num_before,
                                                block_ids[num_before:],
                                                run.block_hashes[num_before:], False))
        return found_runs

    def store(self, runs: Sequence[BlocksToStore]) -> None:
        """Copy the blocks of ``runs`` out after the work queued so far, into reserved slots
        (blocks with no slot left are skipped: storing is best effort)."""
        num_blocks = sum(len(run) for run in runs)
        if not num_blocks:
            return
        slot_ids = self.slot_pool.take(num_blocks)
        if len(slot_ids) < num_blocks:
            self.num_skipped += num_blocks - len(slot_ids)
            log.debug("kv_store_skipped", num_blocks=num_blocks - len(slot_ids),
                      reason="no reserved slot")
            runs = _first_blocks(runs, len(slot_ids))
        if not slot_ids:
            return
        block_ids = list(itertools.chain.from_iterable(run.block_ids for run in runs))
        copy = self.tiers.store(block_ids, slot_ids, payload=_StoreBatch(list(runs), slot_ids))
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
            if batch.commit is None:  # the submit that queued it raised before its end
                self._awaiting_tokens.remove(copy)
                self._read_tokens(batch)
            self.num_stored += len(batch.commit.slot_ids)
            self._commits.append(batch.commit)
        return self.tiers.has_pending

    def _read_tokens(self, batch: _StoreBatch) -> None:
        """The batch's commit: each block's tokens, one slice per run; a block whose tokens
        are not all on the host is never guessed: its slot is given back."""
        size = self.block_size
        commit = batch.commit = Commit(self.store_id, size, [], [], [])
        first_slot = 0  # of the run, in batch.slot_ids
        for run in batch.runs:
            start = run.first_block_index * size
            token_ids = run.token_list[start:start + len(run) * size]
            num_full = len(token_ids) // size  # blocks after a short one are short too
            end_slot = first_slot + len(run)
            if num_full < len(run):
                commit.returned_slot_ids += batch.slot_ids[first_slot + num_full:end_slot]
                self.num_skipped += len(run) - num_full
                token_ids = token_ids[:num_full * size]
                commit.block_hashes += run.block_hashes[:num_full]
            else:
                commit.block_hashes += run.block_hashes
            commit.slot_ids += batch.slot_ids[first_slot:first_slot + num_full]
            commit.token_ids += token_ids
            first_slot = end_slot

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


def commit_messages(commits: Sequence[Commit], namespace: str,
                    owner_id: str) -> list[KvCommitRequest]:
    """The KvCommitRequests that publish ``commits``, as columns: at most
    MAX_TOKENS_PER_COMMIT tokens each, a commit's returned slots with its last message."""
    messages = []
    for commit in commits:
        size, num_blocks = commit.block_size, len(commit.slot_ids)
        per_message = max(1, MAX_TOKENS_PER_COMMIT // size)
        for first in range(0, max(num_blocks, 1), per_message):
            end = first + per_message
            returned = commit.returned_slot_ids if end >= num_blocks else []
            if first == 0 and end >= num_blocks:  # all in one: no copies
                message = KvCommitRequest(
                    namespace=namespace, owner_id=owner_id, store_id=commit.store_id,
                    block_hashes=commit.block_hashes, slot_ids=commit.slot_ids,
                    token_ids=commit.token_ids, block_size=size, returned_slot_ids=returned)
            else:
                message = KvCommitRequest(
                    namespace=namespace, owner_id=owner_id, store_id=commit.store_id,
                    block_hashes=commit.block_hashes[first:end],
                    slot_ids=commit.slot_ids[first:end],
                    token_ids=commit.token_ids[first * size:end * size], block_size=size,
                    returned_slot_ids=returned)
            messages.append(message)
    return messages


def _first_blocks(runs: Sequence[BlocksToStore], num_blocks: int) -> list[BlocksToStore]:
    """The runs cut to their first ``num_blocks`` blocks in all."""
    cut: list[BlocksToStore] = []
    for run in runs:
        if num_blocks <= 0:
            break
        if len(run) > num_blocks:
            run = BlocksToStore(run.token_list, run.first_block_index, run.block_ids[:num_blocks],
                                run.block_hashes[:num_blocks], run.computed_before)
        cut.append(run)
        num_blocks -= len(run)
    return cut
