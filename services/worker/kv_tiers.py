"""KV blocks between the worker's cache and the kvstore's host arena (docs/kvstore.md).

The arena (``shared/kv_arena.py``) is mapped as a tensor of slots ``[num_slots, num_layers,
2, block_size, num_kv_heads, head_dim]`` in the cache's dtype; the cache is ``[num_layers, 2,
num_blocks, block_size, num_kv_heads, head_dim]``, so a block is strided in the cache and
contiguous in a slot.

On CPU a copy is a plain copy, one per run of consecutive slots and blocks. On CUDA the arena
is registered as pinned memory (copies are DMA and never block the host) and every copy goes
through a device staging buffer laid out like the slots, so each host<->device transfer is
one memcpy per run of consecutive slots and the scatter/gather of blocks stays on the device
(``kernels/kv_blocks.py``: one program per layer piece of a block, at memory speed):

- ``load`` runs on a load stream that waits on an event recorded after the work queued so
  far (a step still in flight may use the blocks' old contents), and records a done event.
  It runs beside the step queued after it: the scheduler plans a loading request's compute
  for a later step, and any step whose chunks touch blocks still loading first makes the
  compute stream wait on that load (``wait_for_loads``), so nothing reads a half-loaded block.
  With ``num_load_groups`` G > 1 (CUDA) it copies the blocks in G layer groups, one after
  the other, with an event per group (``kv_load_groups.py``): a forward that can wait
  between layers waits before each layer's attention for its group only;
- ``store`` runs on a copy stream that waits on an event recorded after the work queued so
  far (the forward that computed the blocks), and records a done event. Until that event
  has passed, any later write into those blocks (a forward, a load) first makes the compute
  stream wait on it (``wait_for_stores``), so a copy never reads a block being rewritten.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import structlog
import torch

from kernels.kv_blocks import compile_copies, gather_blocks, scatter_blocks
from services.worker.cuda_copy import memcpy_2d
from services.worker.kv_load_groups import (
    LoadChunk, LoadCopy, group_chunk_blocks, group_copies, layer_groups, load_chunks, load_waits,
)
from shared.kv_arena import KvArena

log = structlog.get_logger()

MAX_STAGING_BYTES = 32 << 20  # per direction, on the device: copies are cut into chunks of this


def chunked_runs(ids: Sequence[int], chunk_size: int) -> list[list[tuple[int, int, int]]]:
    """Runs of consecutive ids within each chunk of ``chunk_size`` ids (index within the
    chunk, first id, length), found in one pass over all of them."""
    if not len(ids):
        return []
    ids = np.asarray(ids, dtype=np.int64)  # [n]
    starts = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = np.union1d(np.concatenate(([0], starts)), np.arange(0, len(ids), chunk_size))
    lengths = np.diff(np.append(starts, len(ids)))
    found: list[list[tuple[int, int, int]]] = [[] for _ in range(-(-len(ids) // chunk_size))]
    for start, first, length in zip(starts.tolist(), ids[starts].tolist(), lengths.tolist()):
        found[start // chunk_size].append((start % chunk_size, first, length))
    return found


def paired_runs(slot_ids: Sequence[int], block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Runs where slots and blocks are both consecutive: (first slot, first block, length)."""
    if len(slot_ids) != len(block_ids):
        raise ValueError(f"{len(slot_ids)} slots for {len(block_ids)} blocks")
    if not slot_ids:
        return []
    slots, blocks = np.asarray(slot_ids, dtype=np.int64), np.asarray(block_ids, dtype=np.int64)
    starts = np.flatnonzero((np.diff(slots) != 1) | (np.diff(blocks) != 1)) + 1
    starts = np.concatenate(([0], starts))
    lengths = np.diff(np.append(starts, len(slots)))
    return list(zip(slots[starts].tolist(), blocks[starts].tolist(), lengths.tolist()))


@dataclass
class LoadTiming:
    """Bytes a step's loads copied, and how long they took (CUDA: read once the step is)."""

    num_bytes: int
    seconds: float = 0.0  # CPU: measured at once
    start: torch.cuda.Event | None = None
    end: torch.cuda.Event | None = None
    group_ends: tuple[torch.cuda.Event, ...] = ()  # per layer group (G > 1), timed too

    def bytes_per_s(self) -> float:
        """0 when unknown (CUDA events not complete yet: never waits for them)."""
        seconds = self.seconds
        if self.start is not None and self.end is not None:
            if not self.end.query():
                return 0.0
            seconds = self.start.elapsed_time(self.end) / 1e3
        return self.num_bytes / seconds if seconds > 0 else 0.0


@dataclass
class StoreCopy:
    """Blocks being copied into slots; ``payload`` is the caller's (what to commit)."""

    block_ids: frozenset[int]
    slot_ids: list[int]
    done: torch.cuda.Event | None  # None: complete (CPU)
    payload: object = None
    waited: bool = field(default=False)  # the compute stream already waits on it

    def is_done(self) -> bool:
        return self.done is None or self.done.query()


class KvTiers:
    """The copies between one KV cache and one mapped arena."""

    def __init__(self, kv_cache: torch.Tensor, arena: KvArena, arena_inode: int | None = None,
                 max_staging_bytes: int = MAX_STAGING_BYTES, num_load_groups: int = 1) -> None:
        self.kv_cache = kv_cache
        # [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim], a view of the cache
        self.blocks = kv_cache.permute(2, 0, 1, 3, 4, 5)
        self.slot_shape = tuple(self.blocks.shape[1:])
        self.slot_nbytes = math.prod(self.slot_shape) * kv_cache.element_size()
        if arena.slot_nbytes != self.slot_nbytes:
            raise ValueError(f"arena slots hold {arena.slot_nbytes} bytes, a block is "
                             f"{self.slot_nbytes}: another layout")
        self.arena = arena
        self.num_slots = arena.num_slots
        # the file mapped (a kvstore that restarts replaces it: another inode, other slots;
        # the old inode lives on while mapped, so a new file never has its number)
        self.arena_inode = arena_inode if arena_inode is not None else os.stat(arena.path).st_ino
        # [num_slots, num_layers, 2, block_size, num_kv_heads, head_dim] on the mapped file
        self.slots = torch.from_numpy(arena.slots()).view(kv_cache.dtype) \
            .view(arena.num_slots, *self.slot_shape)
        self.device = kv_cache.device
        self.num_layers = kv_cache.shape[0]
        # layers [first, end) per load group; one group on CPU, where a load is a plain copy
        self.load_groups = layer_groups(self.num_layers, num_load_groups
                                        if self.device.type == "cuda" else 1)
        self.pinned = False
        self.pending: deque[StoreCopy] = deque()  # in copy order (the copy stream is FIFO)
        self.pending_loads: deque[LoadCopy] = deque()  # in load order (the load stream is FIFO)
        self._copy_stream: torch.cuda.Stream | None = None
        self._load_stream: torch.cuda.Stream | None = None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # maybe built on another thread
                self.pinned = _register(self.slots)
                if self.pinned:  # unpinned before the unmap even if close() is never called:
                    # a range unmapped while registered makes the next mapping at that address
                    # fail to register (cudaErrorHostMemoryAlreadyRegistered)
                    self._unpin = weakref.finalize(self, _unregister, self.slots.data_ptr())
                self._copy_stream = torch.cuda.Stream(self.device)
                self._load_stream = torch.cuda.Stream(self.device)
                self._scatter_stream = torch.cuda.Stream(self.device)
                self.staging_blocks = max(1, max_staging_bytes // self.slot_nbytes)
                shape = (self.staging_blocks, *self.slot_shape)
                if len(self.load_groups) > 1:
                    self._memcpy_2d = memcpy_2d()  # RuntimeError when it cannot be bound
                    self._group_of_layer = tuple(group for group, (first, end)
                                                 in enumerate(self.load_groups)
                                                 for _ in range(first, end))
                    # a staging buffer holds as many blocks of a group as bytes allow
                    self.group_staging_blocks = group_chunk_blocks(self.staging_blocks,
                                                                   self.load_groups)
                with torch.cuda.stream(self._load_stream):  # persistent: never freed
                    # two buffers: the link fills one while the other is scattered
                    self._load_staging = [torch.empty(shape, dtype=kv_cache.dtype,
                                                      device=self.device) for _ in range(2)]
                with torch.cuda.stream(self._copy_stream):  # used on the copy stream only
                    self._store_staging = torch.empty(shape, dtype=kv_cache.dtype,
                                                      device=self.device)
                # here (off the step loop), not at the first store or load
                compile_copies(kv_cache, self._store_staging,
                               self.load_groups if len(self.load_groups) > 1 else [])

    def arena_is_current(self) -> bool:
        """The mapped file is still the kvstore's arena (not replaced by a restarted one,
        whose slot ids would name other bytes here)."""
        try:
            return os.stat(self.arena.path).st_ino == self.arena_inode
        except OSError:
            return False

    # ------------------------------------------------------------ loads
    def load(self, slot_ids: Sequence[int], block_ids: Sequence[int], *,
             in_layer_groups: bool = True) -> LoadTiming:
        """Copy slots into blocks after the work queued so far (CPU: now); on CUDA it runs
        beside whatever the compute stream runs next, which must ``wait_for_loads`` before
        touching these blocks. ``in_layer_groups``: in this tier's layer groups (if it has
        more than one), else in one group (fewer copies: a load read only by a later step
        gains nothing from groups)."""
        if len(slot_ids) != len(block_ids):
            raise ValueError(f"a load of {len(slot_ids)} slots into {len(block_ids)} blocks")
        self._check_ids(slot_ids, block_ids)
        timing = LoadTiming(num_bytes=len(slot_ids) * self.slot_nbytes)
        if not slot_ids:
            return timing
        if self.device.type != "cuda":
            self._load_now(slot_ids, block_ids, timing)
            return timing
        grouped = len(self.load_groups) > 1 and in_layer_groups
        self._queue_load(slot_ids, block_ids, timing, grouped)
        self.pending_loads.append(LoadCopy(frozenset(block_ids), timing.end, timing.group_ends,
                                           self._group_of_layer if grouped else ()))
        return timing

    def _load_now(self, slot_ids: Sequence[int], block_ids: Sequence[int],
                  timing: LoadTiming) -> None:
        """CPU: copy the slots into the blocks at once, timed on the host."""
        started = time.perf_counter()
        for slot_id, block_id, length in paired_runs(slot_ids, block_ids):
            self.blocks[block_id:block_id + length].copy_(self.slots[slot_id:slot_id + length])
        timing.seconds = time.perf_counter() - started

    def _queue_load(self, slot_ids: Sequence[int], block_ids: Sequence[int],
                    timing: LoadTiming, grouped: bool) -> None:
        """CUDA: queue the load on the load stream, chunk by chunk (each group's, when
        ``grouped``), each chunk staged then scattered into its blocks; ``timing`` gets its
        start, end and group-end events."""
        stream, scatter_stream = self._load_stream, self._scatter_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # a step in flight may use them
        self._wait_for_stores_on(stream, block_ids)  # and copies out may still read them
        timing.start, timing.end = (torch.cuda.Event(enable_timing=True),
                                    torch.cuda.Event(enable_timing=True))
        chunks = self.load_chunks(slot_ids, grouped)
        # Chunk k is copied (copy engine, load stream) into buffer k % 2 once chunk k - 2's
        # scatter (a kernel, scatter stream) is done with it, so the link never waits for a
        # scatter: on the H200 one buffer cost a 1,024-block load ~2.5 ms (44.7 ms against
        # 42.2 without staging).
        scattered: list[torch.cuda.Event | None] = [None, None]
        group_ends: list[torch.cuda.Event] = []
        with torch.cuda.stream(stream):
            timing.start.record(stream)
            device_block_ids = _device_ids(block_ids, self.device)  # one transfer for all chunks
            device_block_ids.record_stream(scatter_stream)
            for number, part in enumerate(chunks):
                if scattered[part.buffer] is not None:
                    stream.wait_event(scattered[part.buffer])
                staging = self._stage_chunk(part, grouped, stream)
                scattered[part.buffer] = self._scatter_chunk(
                    part, staging, device_block_ids, grouped, stream)
                last_of_group = number + 1 == len(chunks) or chunks[number + 1].group != part.group
                if grouped and last_of_group:
                    group_ends.append(torch.cuda.Event(enable_timing=True))  # (benchmarks)
                    group_ends[-1].record(scatter_stream)
            stream.wait_stream(scatter_stream)  # the load ends with its last scatter
            timing.end.record(stream)
        timing.group_ends = tuple(group_ends)

    def _stage_chunk(self, part: LoadChunk, grouped: bool,
                     stream: torch.cuda.Stream) -> torch.Tensor:
        """Queue the copy of ``part``'s slots into its staging buffer (on ``stream``) -> the
        staged rows: [n, the group's layers, 2, ...] when ``grouped``, else [n, *slot_shape]."""
        if grouped:
            return self._copy_group(part, stream)
        staging = self._load_staging[part.buffer][:part.num_blocks]
        for index, slot_id, length in part.slot_runs:
            staging[index:index + length].copy_(self.slots[slot_id:slot_id + length],
                                                non_blocking=True)
        return staging

    def _scatter_chunk(self, part: LoadChunk, staging: torch.Tensor,
                       device_block_ids: torch.Tensor, grouped: bool,
                       stream: torch.cuda.Stream) -> torch.cuda.Event:
        """Queue the scatter of a staged chunk into its blocks on the scatter stream, once
        its copy on ``stream`` is done -> the event its staging buffer is free again at."""
        copied = torch.cuda.Event()
        copied.record(stream)
        scatter_stream = self._scatter_stream
        scatter_stream.wait_event(copied)
        with torch.cuda.stream(scatter_stream):
            scatter_blocks(self.kv_cache,
                           device_block_ids[part.first:part.first + part.num_blocks],
                           staging, layers=self.load_groups[part.group] if grouped else None)
            scattered = torch.cuda.Event()
            scattered.record(scatter_stream)
        return scattered

    def load_chunks(self, slot_ids: Sequence[int], grouped: bool) -> list[LoadChunk]:
        """A load's staging chunks in issue order: each group's (all layers of a block in
        one chunk when not ``grouped``: each block copied once)."""
        chunk = self.group_staging_blocks if grouped else self.staging_blocks
        return load_chunks(chunked_runs(slot_ids, chunk), chunk, len(slot_ids),
                           len(self.load_groups) if grouped else 1)

    def _copy_group(self, part: LoadChunk, stream: torch.cuda.Stream) -> torch.Tensor:
        """Queue the copy of ``part``'s group of layers from its slots into its staging
        buffer, one 2D copy per run of consecutive slots -> the staging rows [n, the
        group's layers, 2, block_size, num_kv_heads, head_dim]."""
        first, end = self.load_groups[part.group]
        layer_nbytes = self.slot_nbytes // self.num_layers
        staging = self._load_staging[part.buffer].view(-1)[
            :part.num_blocks * (end - first) * layer_nbytes // self.kv_cache.element_size()
        ].view(part.num_blocks, end - first, *self.slot_shape[1:])
        staging_ptr, slots_ptr = staging.data_ptr(), self.slots.data_ptr()
        for copy in group_copies(part.slot_runs, (first, end), layer_nbytes, self.slot_nbytes):
            self._memcpy_2d(staging_ptr + copy.dst_offset, copy.dst_pitch,
                            slots_ptr + copy.src_offset, copy.src_pitch, copy.width, copy.height,
                            stream.cuda_stream)
        return staging

    def wait_for_loads(self, block_ids: Iterable[int], written_block_ids: Iterable[int] | None
                       = None, by_layer: bool = False) -> list[list[torch.cuda.Event]] | None:
        """Before the compute stream touches ``block_ids`` (reads or writes; of which it
        writes ``written_block_ids``, None: maybe all): it waits for the loads still writing
        any of them (a device-side wait; nothing waits on the host). With ``by_layer`` (the
        forward waits between its layers), grouped loads it writes nothing of are left to
        the forward: per layer, the events its attention must wait on (None: none)."""
        while self.pending_loads and self.pending_loads[0].done.query():
            self.pending_loads.popleft()
        if not self.pending_loads:
            return None
        block_ids = set(block_ids)
        written = block_ids if written_block_ids is None else set(written_block_ids)
        whole, per_layer = load_waits(self.pending_loads, block_ids, written, self.num_layers,
                                      by_layer)
        compute = torch.cuda.current_stream(self.device)
        for event in whole:
            compute.wait_event(event)
        return per_layer

    # ------------------------------------------------------------ stores
    def store(self, block_ids: Sequence[int], slot_ids: Sequence[int],
              payload: object = None) -> StoreCopy:
        """Copy blocks into slots after the work queued so far (CPU: now)."""
        if len(slot_ids) != len(block_ids):
            raise ValueError(f"a store of {len(block_ids)} blocks into {len(slot_ids)} slots")
        self._check_ids(slot_ids, block_ids)
        copy = StoreCopy(frozenset(block_ids), list(slot_ids), None, payload)
        if self.device.type != "cuda":
            for slot_id, block_id, length in paired_runs(slot_ids, block_ids):
                self.slots[slot_id:slot_id + length].copy_(self.blocks[block_id:block_id + length])
            self.pending.append(copy)
            return copy
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))  # after the forward
        chunk = self.staging_blocks
        with torch.cuda.stream(stream):
            device_block_ids = _device_ids(block_ids, self.device)  # one transfer for all chunks
            for first, slot_runs in zip(range(0, len(slot_ids), chunk),
                                        chunked_runs(slot_ids, chunk)):
                num_blocks = min(chunk, len(slot_ids) - first)
                staging = self._store_staging[:num_blocks]  # [n, *slot_shape]
                gather_blocks(self.kv_cache, device_block_ids[first:first + num_blocks], staging)
                for index, slot_id, length in slot_runs:
                    self.slots[slot_id:slot_id + length].copy_(staging[index:index + length],
                                                               non_blocking=True)
            copy.done = torch.cuda.Event()
            copy.done.record(stream)
        self.pending.append(copy)
        return copy

    def wait_for_stores(self, block_ids: Iterable[int]) -> None:
        """Before writing ``block_ids``: the compute stream waits for the copies still reading
        any of them (a cheap device-side wait; nothing waits on the host)."""
        if self.device.type != "cuda" or not self.pending:
            return
        self._wait_for_stores_on(torch.cuda.current_stream(self.device), block_ids,
                                 mark_waited=True)

    def _wait_for_stores_on(self, stream: torch.cuda.Stream, block_ids: Iterable[int],
                            mark_waited: bool = False) -> None:
        if not self.pending:
            return
        block_ids = set(block_ids)
        for copy in self.pending:
            if not copy.waited and not block_ids.isdisjoint(copy.block_ids) \
                    and not copy.done.query():
                stream.wait_event(copy.done)
                copy.waited = copy.waited or mark_waited  # (the compute stream's wait is for good)

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def completed(self) -> list[StoreCopy]:
        """Stores whose copies are complete, in order (removed from the pending ones)."""
        done = []
        while self.pending and self.pending[0].is_done():
            done.append(self.pending.popleft())
        return done

    def synchronize(self) -> None:
        """Wait on the host for every copy (before unmapping the arena)."""
        for copy in self.pending:
            if copy.done is not None:
                copy.done.synchronize()
        for load in self.pending_loads:
            load.done.synchronize()
        self.pending_loads.clear()

    def close(self) -> None:
        """Wait for the copies, unpin and unmap the arena."""
        self.synchronize()
        if self.pinned:
            self._unpin()
            self.pinned = False
        self.slots = None
        try:
            self.arena.close()
        except BufferError:  # a view of the slots is still alive: the mapping goes with it
            log.warning("kv_arena_still_referenced", path=str(self.arena.path))

    def _check_ids(self, slot_ids: Sequence[int], block_ids: Sequence[int]) -> None:
        if (not slot_ids or 0 <= min(slot_ids) and max(slot_ids) < self.num_slots) and (
                not block_ids or 0 <= min(block_ids) and max(block_ids) < self.blocks.shape[0]):
            return
        bad_slots = [s for s in slot_ids if not 0 <= s < self.num_slots]
        bad_blocks = [b for b in block_ids if not 0 <= b < self.blocks.shape[0]]
        if bad_slots or bad_blocks:
            raise ValueError(f"kv copy: slots {bad_slots} outside [0, {self.num_slots}) or "
                             f"blocks {bad_blocks} outside [0, {self.blocks.shape[0]})")


def attach_arena(path: str | os.PathLike) -> tuple[KvArena, int]:
    """Map the arena file at ``path``: (arena, the inode mapped), checked unchanged around
    the mapping."""
    for _ in range(3):
        inode = os.stat(path).st_ino
        arena = KvArena.attach(path)
        if os.stat(path).st_ino == inode:
            return arena, inode
        arena.close()
    raise ValueError(f"the arena {path} keeps being replaced")


def _device_ids(ids: Sequence[int], device: torch.device) -> torch.Tensor:
    """[len(ids)] int64 on ``device``, through pinned memory (a pageable copy would wait
    for every kernel queued before it)."""
    return torch.tensor(ids, dtype=torch.int64).pin_memory().to(device, non_blocking=True)


def _unregister(data_ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(data_ptr)


def _register(slots: torch.Tensor) -> bool:
    """Pin the mapped arena for DMA; False (and pageable copies) when the driver refuses."""
    error = torch.cuda.cudart().cudaHostRegister(slots.data_ptr(),
                                                 slots.numel() * slots.element_size(), 0)
    if int(error) != 0:
        log.warning("kv_arena_not_pinned", error=int(error),
                    detail="copies with the host tier are synchronous")
        torch.cuda.cudart().cudaGetLastError()  # clear it
        return False
    return True
