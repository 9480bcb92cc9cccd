"""The host tier's bookkeeping for one namespace: which arena slot holds which block,
which slots are free, reserved by a writer, pinned by a reader, or busy being copied.
Pure: no I/O, no clock; the kvstore drives it from its event loop.

A slot is in exactly one state:
- free: in ``_free``;
- reserved: an owner (a worker) writes a block into it, then commits or returns it;
- indexed: it holds a committed block (``_blocks``, in LRU order, oldest first);
- loading: a pin took it to read a disk block into; indexed or freed when the read ends.
Indexed slots may also be pinned (counted per pin) or held (a disk write reads them);
those are never evicted. Pins never take more than ``max_pinned`` slots and reservations
more than ``max_reserved``, so neither starves the other.

Every lookup, pin, release and commit walks its blocks here, one request after another
on the kvstore's event loop, so the per-block work is kept small: per-slot state lives in
lists indexed by slot id (no hashing), and a run is pinned in one call. A block keeps its
token ids as a tuple: the garbage collector stops tracking a tuple of ints after its
first pass, so full collections no longer walk every block held (with 248,000 blocks,
its longest pass went from 92-96 ms to 31-35 ms: benchmarks/kvstore_requests.py).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import takewhile
from operator import is_not, itemgetter
from typing import NamedTuple


class HostBlock(NamedTuple):
    slot_id: int
    token_ids: tuple[int, ...]


_is_held = partial(is_not, None)  # a block found by the hash (dict.get gives None if not)
_slot_id, _token_ids = itemgetter(0), itemgetter(1)  # a HostBlock's fields, read in C


@dataclass
class Pin:
    owner_id: str
    slot_ids: list[int] = field(default_factory=list)


@dataclass
class TierChanges:
    """Blocks that entered and left the tier since the last ``take()`` (for events)."""

    stored: list[bytes] = field(default_factory=list)
    removed: list[bytes] = field(default_factory=list)

    def take(self) -> tuple[list[bytes], list[bytes]]:
        stored, removed = self.stored, self.removed
        self.stored, self.removed = [], []
        return stored, removed


class HostTier:
    def __init__(self, num_slots: int, *, max_pinned: int, max_reserved: int) -> None:
        if num_slots < 1:
            raise ValueError("a host tier needs at least one slot")
        self.num_slots = num_slots
        self.max_pinned = max(1, min(max_pinned, num_slots))
        self.max_reserved = max(1, min(max_reserved, num_slots))
        self.changes = TierChanges()
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first
        self._blocks: OrderedDict[bytes, HostBlock] = OrderedDict()
        self._slot_hash: list[bytes | None] = [None] * num_slots  # the block a slot holds
        self._reserved: dict[str, set[int]] = {}
        self._num_reserved = 0
        self._pins: dict[str, Pin] = {}
        self._pin_counts: list[int] = [0] * num_slots  # pins holding each slot
        self._num_pinned = 0  # slots with a pin count above 0
        self._holds: list[int] = [0] * num_slots  # disk writes reading each slot

    # ------------------------------------------------------------ queries
    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    @property
    def num_pinned(self) -> int:
        return self._num_pinned

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_reserved(self) -> int:
        return self._num_reserved

    def block_hashes(self) -> list[bytes]:
        """Every indexed block's hash (least recently used first)."""
        return list(self._blocks)

    def get(self, block_hash: bytes) -> HostBlock | None:
        return self._blocks.get(block_hash)

    def leading_run(self, block_hashes: Sequence[bytes]) -> list[HostBlock]:
        """The blocks of the leading hashes held here, up to the first that is not (one
        pass in C: a 16k prompt's 1,023 blocks are looked up per request)."""
        return list(takewhile(_is_held, map(self._blocks.get, block_hashes)))

    def pinnable(self, run: list[HostBlock], room: int) -> tuple[list[int], list[tuple[int, ...]]]:
        """The slots and token ids of the leading blocks of ``run`` that pins may take
        with ``room`` slots left: the run ends at the first block not pinned yet that
        finds no room (blocks pinned already need none)."""
        slot_ids, token_ids = list(map(_slot_id, run)), list(map(_token_ids, run))
        pin_counts = self._pin_counts
        if list(map(pin_counts.__getitem__, slot_ids)).count(0) > room:
            for index, slot_id in enumerate(slot_ids):
                if not pin_counts[slot_id]:
                    if not room:
                        return slot_ids[:index], token_ids[:index]
                    room -= 1
        return slot_ids, token_ids

    def reserved_by(self, owner_id: str) -> set[int]:
        return set(self._reserved.get(owner_id, ()))

    def pin_ids_of(self, owner_id: str) -> list[str]:
        return [pin_id for pin_id, pin in self._pins.items() if pin.owner_id == owner_id]

    def pinned_slots(self, pin_id: str) -> list[int]:
        pin = self._pins.get(pin_id)
        return list(pin.slot_ids) if pin else []

    def pin_room(self) -> int:
        """Slots that pins may still take."""
        return max(0, self.max_pinned - self.num_pinned)

    # ------------------------------------------------------------ slots
    def take_slot(self) -> int | None:
        """A free slot, evicting the least recently used block that is neither pinned nor
        held when none is free; None when every slot is taken."""
        if self._free:
            return self._free.pop()
        pin_counts, holds = self._pin_counts, self._holds
        for block_hash, block in self._blocks.items():
            slot = block.slot_id
            if not pin_counts[slot] and not holds[slot]:
                self._remove(block_hash)
                return self._free.pop()
        return None

    def free_slot(self, slot_id: int) -> None:
        """Give back a slot that is neither indexed nor reserved (a failed load's)."""
        if self._slot_hash[slot_id] is not None:
            raise ValueError(f"slot {slot_id} holds a block")
        self._free.append(slot_id)

    def _remove(self, block_hash: bytes) -> None:
        block = self._blocks.pop(block_hash)
        self._slot_hash[block.slot_id] = None
        self._free.append(block.slot_id)
        self.changes.removed.append(block_hash)

    def index(self, block_hash: bytes, slot_id: int, token_ids: Sequence[int]) -> int:
        """Record that ``slot_id`` (taken, not reserved) now holds this block. If the hash
        is already held, ``slot_id`` is freed and the held block's slot returned."""
        held = self._blocks.get(block_hash)
        if held is not None:
            self._blocks.move_to_end(block_hash)
            self._free.append(slot_id)
            return held.slot_id
        self._blocks[block_hash] = HostBlock(slot_id, tuple(token_ids))
        self._slot_hash[slot_id] = block_hash
        self.changes.stored.append(block_hash)
        return slot_id

    def touch(self, block_hash: bytes) -> None:
        if block_hash in self._blocks:
            self._blocks.move_to_end(block_hash)

    def hold(self, slot_id: int) -> None:
        """Keep an indexed slot from eviction while something reads it (a disk write)."""
        self._holds[slot_id] += 1

    def unhold(self, slot_id: int) -> None:
        self._holds[slot_id] = max(0, self._holds[slot_id] - 1)

    # ------------------------------------------------------------ writers
    def reserve(self, owner_id: str, num_slots: int) -> list[int]:
        """Up to ``num_slots`` slots for the owner to write into (fewer near the cap)."""
        allowed = min(num_slots, self.max_reserved - self._num_reserved)
        slots: list[int] = []
        while len(slots) < allowed:
            slot = self.take_slot()
            if slot is None:
                break
            slots.append(slot)
        if slots:
            self._reserved.setdefault(owner_id, set()).update(slots)
            self._num_reserved += len(slots)
        return slots

    def commit(self, owner_id: str, blocks: Iterable[tuple[bytes, int, list[int]]],
               returned_slot_ids: Iterable[int] = ()) -> list[tuple[bytes, int, list[int]]]:
        """Index the owner's reserved slots that now hold blocks ((hash, slot, token ids)),
        free the returned ones. Slots the owner does not hold are
        ignored. Returns each block newly indexed (not those already held)."""
        reserved = self._reserved.get(owner_id, set())
        stored: list[tuple[bytes, int, list[int]]] = []
        index = self.index
        num_unreserved = 0
        for block_hash, slot_id, token_ids in blocks:
            if slot_id not in reserved:
                continue
            reserved.discard(slot_id)
            num_unreserved += 1
            if index(block_hash, slot_id, token_ids) == slot_id:
                stored.append((block_hash, slot_id, token_ids))
        for slot_id in returned_slot_ids:
            if slot_id in reserved:
                reserved.discard(slot_id)
                num_unreserved += 1
                self._free.append(slot_id)
        self._num_reserved -= num_unreserved
        if not reserved:
            self._reserved.pop(owner_id, None)
        return stored

    # ------------------------------------------------------------ readers
    def pin(self, pin_id: str, owner_id: str, slot_id: int) -> None:
        """Add a slot (indexed, or loading) to a pin, creating it on first use. The caller
        checks ``pin_room()`` for slots not pinned yet."""
        self.pin_slots(pin_id, owner_id, [slot_id])

    def pin_slots(self, pin_id: str, owner_id: str, slot_ids: list[int]) -> None:
        """``pin`` for a run of slots; their blocks become the most recently used."""
        if not slot_ids:
            return
        pin = self._pins.get(pin_id)
        if pin is None:
            pin = self._pins[pin_id] = Pin(owner_id)
        pin.slot_ids.extend(slot_ids)
        pin_counts, slot_hash, move_to_end = self._pin_counts, self._slot_hash, self._blocks.move_to_end
        for slot_id in slot_ids:
            if not pin_counts[slot_id]:
                self._num_pinned += 1
            pin_counts[slot_id] += 1
            block_hash = slot_hash[slot_id]
            if block_hash is not None:
                move_to_end(block_hash)

    def finish_load(self, pin_id: str, block_hash: bytes, slot_id: int,
                    token_ids: list[int]) -> int:
        """A disk block was read into ``slot_id`` (loading, pinned by ``pin_id`` unless that
        pin was released meanwhile): index it. When the hash got indexed meanwhile, the pin
        moves to that slot and ``slot_id`` is freed. Returns the block's slot."""
        held = self._blocks.get(block_hash)
        if held is None:
            return self.index(block_hash, slot_id, token_ids)
        self._move_pin(pin_id, slot_id, held.slot_id)
        self._blocks.move_to_end(block_hash)
        self._free.append(slot_id)
        return held.slot_id

    def fail_load(self, pin_id: str, slot_id: int) -> None:
        """A disk read into a loading slot failed: unpin and free it."""
        self._move_pin(pin_id, slot_id, None)
        self._free.append(slot_id)

    def unpin_slot(self, pin_id: str, slot_id: int) -> None:
        """Take one slot out of a pin (a run cut short)."""
        self._move_pin(pin_id, slot_id, None)

    def _move_pin(self, pin_id: str, old: int, new: int | None) -> None:
        pin = self._pins.get(pin_id)
        if pin is None or old not in pin.slot_ids:
            return
        index = pin.slot_ids.index(old)
        if new is None:
            del pin.slot_ids[index]
        else:
            pin.slot_ids[index] = new
            self._count_pin(new, 1)
        self._count_pin(old, -1)
        if not pin.slot_ids:
            del self._pins[pin_id]

    def _count_pin(self, slot_id: int, change: int) -> None:
        before = self._pin_counts[slot_id]
        after = self._pin_counts[slot_id] = before + change
        self._num_pinned += (after > 0) - (before > 0)

    def is_pinned(self, slot_id: int) -> bool:
        return self._pin_counts[slot_id] > 0

    def has_pin(self, pin_id: str) -> bool:
        return pin_id in self._pins

    def release(self, pin_ids: Iterable[str], owner_id: str | None = None) -> int:
        """Drop pins (only the owner's when ``owner_id`` is given). Returns how many."""
        released = num_unpinned = 0
        pin_counts = self._pin_counts
        for pin_id in pin_ids:
            pin = self._pins.get(pin_id)
            if pin is None or (owner_id is not None and pin.owner_id != owner_id):
                continue
            del self._pins[pin_id]
            for slot_id in pin.slot_ids:
                count = pin_counts[slot_id] = pin_counts[slot_id] - 1
                num_unpinned += count == 0
            released += 1
        self._num_pinned -= num_unpinned
        return released

    def drop_owner(self, owner_id: str) -> tuple[int, int]:
        """An owner went silent: free its reservations, drop its pins.
        Returns (slots freed, pins dropped)."""
        reserved = self._reserved.pop(owner_id, set())
        self._num_reserved -= len(reserved)
        self._free.extend(sorted(reserved, reverse=True))
        return len(reserved), self.release(self.pin_ids_of(owner_id))
