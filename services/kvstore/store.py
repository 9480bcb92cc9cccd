"""The kvstore's state and the operations its NATS edge calls: namespaces (one arena and
host tier each), the shared disk tier, owners and their keepalives, block events.
Synchronous, called from the event loop only; the blocking parts (creating an arena,
reading disk blocks, writing them) are done by the caller off the loop, between the
steps here (``begin_pin`` / ``read_pin`` in a thread / ``finish_pin``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import structlog

from services.kvstore.disk_tier import DiskTier
from services.kvstore.events import EventBatcher
from services.kvstore.host_tier import HostBlock, HostTier
from services.kvstore.owners import OwnerClock
from shared.kv_arena import KvArena
from shared.messages import BlockSnapshotPart
from shared.kv_messages import (
    KvBlockEvent, KvCommitRequest, KvLayout, KvLookupRequest, KvPinReply, KvPinRequest,
    KvTierStats,
)

log = structlog.get_logger()

HOST, DISK = "host", "disk"


def slot_nbytes_of(layout: KvLayout, itemsize: int) -> int:
    if itemsize < 1 or any(dim < 1 for dim in layout.slot_shape):
        raise ValueError(f"a layout needs positive sizes: {layout.slot_shape} x {itemsize} bytes")
    return math.prod(layout.slot_shape) * itemsize


def num_host_slots(host_memory: int, slot_nbytes: int, free_bytes: int | None) -> int:
    """Slots for ``host_memory`` bytes, but no more than fit in what the shared-memory
    filesystem has free (with a 10% margin): a write past a full tmpfs is a SIGBUS."""
    budget = host_memory if free_bytes is None else min(host_memory, int(free_bytes * 0.9))
    return budget // slot_nbytes


def _columns(request: KvCommitRequest) -> Iterator[tuple[bytes, int, tuple[int, ...]]]:
    """A commit's column form as (hash, slot, token ids) per block; ValueError at once when
    the columns do not line up (nothing of the commit is applied then)."""
    hashes, slot_ids, token_ids, size = (request.block_hashes, request.slot_ids,
                                         request.token_ids, request.block_size)
    if size < 1 or len(slot_ids) != len(hashes) or len(token_ids) != len(hashes) * size:
        raise ValueError(f"a commit of {len(hashes)} block hashes, {len(slot_ids)} slot ids and "
                         f"{len(token_ids)} token ids in blocks of {size}")
    # each block's tokens as a tuple (what the host tier keeps), cut in C: zip over one
    # iterator taken size times
    return zip(hashes, slot_ids, zip(*[iter(token_ids)] * size))


@dataclass
class Namespace:
    name: str
    slot_nbytes: int
    arena: KvArena
    host: HostTier
    slots: np.ndarray = field(init=False)  # [num_slots, slot_nbytes] uint8, the mapped arena

    def __post_init__(self) -> None:
        self.slots = self.arena.slots()

    def slot_view(self, slot_id: int) -> memoryview:
        return memoryview(self.slots[slot_id])


class Lookup(NamedTuple):
    tiers: list[str]  # the tier of each block of the leading run held (host first)
    # its leading host blocks pinned (when the lookup asked): their slots and tokens
    slot_ids: list[int]
    token_ids: list[tuple[int, ...]]


@dataclass
class PinItem:
    block_hash: bytes
    slot_id: int
    tier: str
    token_ids: Sequence[int] | None  # a disk block's come with its read


@dataclass
class PinPlan:
    """A pin under way: host hits are pinned, disk hits have loading slots to read into."""

    request: KvPinRequest
    namespace: Namespace | None
    items: list[PinItem]

    @property
    def disk_items(self) -> list[PinItem]:
        return [item for item in self.items if item.tier == DISK]


class KvStore:
    def __init__(self, store_id: str, node_id: str, *, disk: DiskTier | None,
                 owner_timeout_s: float, max_pinned_fraction: float,
                 max_reserved_fraction: float) -> None:
        self.store_id = store_id
        self.node_id = node_id
        self.disk = disk
        self.owners = OwnerClock(owner_timeout_s)
        self.events = EventBatcher(store_id, node_id)
        self.namespaces: dict[str, Namespace] = {}
        self._max_pinned_fraction = max_pinned_fraction
        self._max_reserved_fraction = max_reserved_fraction

    # ------------------------------------------------------------ namespaces
    def new_host_tier(self, num_slots: int) -> HostTier:
        return HostTier(num_slots, max_pinned=int(num_slots * self._max_pinned_fraction),
                        max_reserved=int(num_slots * self._max_reserved_fraction))

    def add_namespace(self, namespace: Namespace) -> None:
        self.namespaces[namespace.name] = namespace

    # ------------------------------------------------------------ writers
    def reserve(self, namespace: str, owner_id: str, num_slots: int, now: float) -> list[int]:
        self.owners.touch(owner_id, now)
        ns = self.namespaces.get(namespace)
        if ns is None or num_slots < 1:
            return []
        return ns.host.reserve(owner_id, num_slots)

    def commit(self, request: KvCommitRequest, now: float) -> list[tuple[bytes, int, list[int]]]:
        """Index the committed blocks; returns the newly stored ones (hash, slot, token
        ids) for the disk. A commit meant for another store (this one restarted) is ignored."""
        self.owners.touch(request.owner_id, now)
        ns = self.namespaces.get(request.namespace)
        if ns is None or request.store_id != self.store_id:
            return []
        # lazily, block by block: a list of them all would outlive the collector's young
        # generation and make its passes dearer (~1 ms more per 1,024 blocks)
        blocks = _columns(request) if request.block_hashes else ()
        return ns.host.commit(request.owner_id, blocks, request.returned_slot_ids)

    # ------------------------------------------------------------ readers
    def lookup(self, request: KvLookupRequest, now: float = 0.0) -> Lookup:
        """The tier of each block of the leading run held (host first). With an owner and
        a pin id, the run's leading host blocks are also pinned under that id, as
        ``begin_pin`` would (within the pin cap): the run's first disk hit, or a block the
        cap leaves no room for, ends what is pinned (not the run looked up)."""
        ns = self.namespaces.get(request.namespace)
        if ns is None:
            return Lookup([], [], [])
        host, disk = ns.host, self.disk
        pinning = bool(request.owner_id and request.pin_id)
        if pinning:
            self.owners.touch(request.owner_id, now)
            if host.has_pin(request.pin_id):
                raise ValueError(f"pin id {request.pin_id!r} is in use")
        run = host.leading_run(request.block_hashes)
        tiers = [HOST] * len(run)
        slot_ids: list[int] = []
        token_ids: list[tuple[int, ...]] = []
        if pinning and run:
            slot_ids, token_ids = host.pinnable(run, host.pin_room())
        if disk is not None:  # past the host run: disk hits, and host hits after them
            for block_hash in request.block_hashes[len(run):]:
                if host.get(block_hash) is not None:
                    tiers.append(HOST)
                elif disk.contains(ns.name, block_hash):
                    tiers.append(DISK)
                else:
                    break
        host.pin_slots(request.pin_id, request.owner_id, slot_ids)
        return Lookup(tiers, slot_ids, token_ids)

    def begin_pin(self, request: KvPinRequest, now: float) -> PinPlan:
        """Pin the leading run's host hits and take a slot for each disk hit (to read into,
        off the loop); the run stops at a miss, at the pin cap or when no slot is left."""
        self.owners.touch(request.owner_id, now)
        ns = self.namespaces.get(request.namespace)
        plan = PinPlan(request, ns, [])
        if ns is None:
            return plan
        host = ns.host
        if host.has_pin(request.pin_id):
            raise ValueError(f"pin id {request.pin_id!r} is in use")
        room = host.pin_room()
        run: list[tuple[bytes, HostBlock | None]] = []  # None: a disk hit
        for block_hash in request.block_hashes:
            block = host.get(block_hash)
            if block is not None:
                needs_room = not host.is_pinned(block.slot_id)
            elif self.disk is not None and self.disk.contains(ns.name, block_hash):
                needs_room = True
            else:
                break
            if needs_room and room == 0:
                break
            room -= needs_room
            run.append((block_hash, block))
        # Pin the host hits first, so taking slots for the disk hits cannot evict them.
        pin_id, owner_id = request.pin_id, request.owner_id
        host.pin_slots(pin_id, owner_id, [block.slot_id for _, block in run if block is not None])
        for index, (block_hash, block) in enumerate(run):
            if block is not None:
                plan.items.append(PinItem(block_hash, block.slot_id, HOST, block.token_ids))
                continue
            slot_id = host.take_slot()
            if slot_id is None:  # everything else is pinned, held or reserved
                for _, rest in run[index:]:
                    if rest is not None:
                        host.unpin_slot(pin_id, rest.slot_id)
                break
            host.pin(pin_id, owner_id, slot_id)
            plan.items.append(PinItem(block_hash, slot_id, DISK, None))
        return plan

    def read_pin(self, plan: PinPlan) -> list[list[int]]:
        """Off the event loop: read the plan's disk blocks into their slots, in order,
        stopping at the first that fails. Returns the token ids of those read."""
        read: list[list[int]] = []
        for item in plan.disk_items:
            try:
                token_ids = self.disk.read_into(plan.namespace.name, item.block_hash,
                                                plan.namespace.slot_view(item.slot_id))
            except Exception:  # noqa: BLE001 - whatever it was, the run ends here, slots freed
                log.exception("kv_disk_read_failed")
                break
            if token_ids is None:
                break
            read.append(token_ids)
        return read

    def finish_pin(self, plan: PinPlan, read: list[list[int]]) -> KvPinReply:
        """Index what was read, cut the run at the first block that could not be, unpin and
        free the rest."""
        ns, pin_id = plan.namespace, plan.request.pin_id
        kept: list[PinItem] = []
        reads = iter(read)
        failed = False
        for item in plan.items:
            if item.tier == DISK:
                token_ids = None if failed else next(reads, None)
                if token_ids is None:
                    failed = True
                    ns.host.fail_load(pin_id, item.slot_id)
                    continue
                item.slot_id = ns.host.finish_load(pin_id, item.block_hash, item.slot_id,
                                                   token_ids)
                item.token_ids = token_ids
            elif failed:
                ns.host.unpin_slot(pin_id, item.slot_id)
                continue
            kept.append(item)
        return KvPinReply(store_id=self.store_id, slot_ids=[i.slot_id for i in kept],
                          token_ids=[i.token_ids for i in kept], tiers=[i.tier for i in kept])

    def release(self, namespace: str, owner_id: str, pin_ids: list[str], now: float) -> int:
        self.owners.touch(owner_id, now)
        ns = self.namespaces.get(namespace)
        return ns.host.release(pin_ids, owner_id) if ns is not None else 0

    # ------------------------------------------------------------ owners
    def keepalive(self, owner_id: str, now: float) -> None:
        self.owners.touch(owner_id, now)

    def expire_owners(self, now: float) -> dict[str, tuple[int, int]]:
        """Drop the reservations and pins of owners silent past the timeout:
        owner -> (slots freed, pins dropped)."""
        dropped = {}
        for owner_id in self.owners.expire(now):
            freed = pins = 0
            for ns in self.namespaces.values():
                num_slots, num_pins = ns.host.drop_owner(owner_id)
                freed, pins = freed + num_slots, pins + num_pins
            dropped[owner_id] = (freed, pins)
        return dropped

    # ------------------------------------------------------------ reporting
    def collect_events(self, now: float) -> list[KvBlockEvent]:
        return self._collect(now, None)

    def snapshot(self, now: float) -> tuple[list[KvBlockEvent], int, list[BlockSnapshotPart]]:
        """Drain the pending changes into events and take every indexed hash per namespace
        and tier: (the events to publish, the seq of the last of them (or of the last event
        before, when none was pending), the parts). The parts are exactly the state those
        events leave: the disk's index is read under the same lock as its last changes."""
        disk_index: dict[str, list[bytes]] = {}
        events = self._collect(now, disk_index)
        parts = [BlockSnapshotPart(namespace=name, tier=HOST, block_hashes=ns.host.block_hashes())
                 for name, ns in sorted(self.namespaces.items()) if ns.host.num_blocks]
        parts += [BlockSnapshotPart(namespace=name, tier=DISK, block_hashes=hashes)
                  for name, hashes in sorted(disk_index.items())]
        return events, self.events.seq, parts

    def _collect(self, now: float, disk_index: dict[str, list[bytes]] | None) -> list[KvBlockEvent]:
        for ns in self.namespaces.values():
            stored, removed = ns.host.changes.take()
            self.events.add(ns.name, HOST, stored, removed)
        if self.disk is not None:
            if disk_index is None:
                changes = self.disk.take_changes()
            else:
                changes, index = self.disk.take_changes_and_index()
                disk_index.update(index)
            by_namespace: dict[str, tuple[list[bytes], list[bytes]]] = defaultdict(lambda: ([], []))
            for namespace, stored, block_hash in changes:
                by_namespace[namespace][0 if stored else 1].append(block_hash)
            for namespace, (stored_hashes, removed_hashes) in by_namespace.items():
                self.events.add(namespace, DISK, stored_hashes, removed_hashes)
        return self.events.flush(now) if self.events else []

    def tier_stats(self) -> list[KvTierStats]:
        spaces = self.namespaces.values()
        stats = [KvTierStats(
            tier=HOST, num_blocks=sum(ns.host.num_blocks for ns in spaces),
            num_bytes=sum(ns.host.num_blocks * ns.slot_nbytes for ns in spaces),
            capacity_bytes=sum(ns.host.num_slots * ns.slot_nbytes for ns in spaces),
            num_pinned=sum(ns.host.num_pinned for ns in spaces))]
        if self.disk is not None:
            stats.append(KvTierStats(tier=DISK, num_blocks=self.disk.num_blocks,
                                     num_bytes=self.disk.num_bytes,
                                     capacity_bytes=self.disk.capacity_bytes))
        return stats
