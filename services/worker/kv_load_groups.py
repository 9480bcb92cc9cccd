"""Loads from the host arena in layer groups (``--kv-load-layer-groups``, kv_tiers.py): what
is copied in which order, and what the forward waits for before each layer's attention.
Host code only: no CUDA call here.

A load of G groups copies layers [0, L/G) of all its blocks first, then [L/G, 2L/G), ...,
and records an event after each group's last scatter. A forward that reads the loading
blocks waits before layer l's attention for the event of l's group only, so its first
layers run while the later ones still cross the link. G = 1 is one group of every layer:
the copies of an ungrouped load, waited for as a whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch


def layer_groups(num_layers: int, num_groups: int) -> list[tuple[int, int]]:
    """Layers [first, end) of each group, in order, as even as can be (at most one group a
    layer)."""
    if num_groups < 1:
        raise ValueError(f"num_groups must be at least 1, not {num_groups}")
    num_groups = min(num_groups, num_layers)
    return [(group * num_layers // num_groups, (group + 1) * num_layers // num_groups)
            for group in range(num_groups)]


def group_chunk_blocks(staging_blocks: int, groups: list[tuple[int, int]]) -> int:
    """Blocks of a group that a staging buffer of ``staging_blocks`` whole blocks holds (of
    the largest group: every group's chunks are the same)."""
    largest = max(end - first for first, end in groups)
    return staging_blocks * groups[-1][1] // largest


@dataclass(frozen=True)
class LoadChunk:
    """One staging buffer's worth of a load: blocks [first, first + num_blocks) of the load's
    ids, the layers of group ``group``."""

    buffer: int  # which of the two staging buffers (they alternate, chunk by chunk)
    group: int
    first: int
    num_blocks: int
    slot_runs: list[tuple[int, int, int]]  # (index within the chunk, first slot, length)


def load_chunks(runs_per_chunk: list[list[tuple[int, int, int]]], chunk_size: int,
                num_blocks: int, num_groups: int) -> list[LoadChunk]:
    """The chunks of a load in issue order: every chunk of group 0, then of group 1, ...;
    ``runs_per_chunk`` is ``chunked_runs(slot_ids, chunk_size)``."""
    chunks: list[LoadChunk] = []
    for group in range(num_groups):
        for first, slot_runs in zip(range(0, num_blocks, chunk_size), runs_per_chunk):
            chunks.append(LoadChunk(len(chunks) % 2, group, first,
                                    min(chunk_size, num_blocks - first), slot_runs))
    return chunks


@dataclass(frozen=True)
class Copy2D:
    """``height`` rows of ``width`` bytes (cudaMemcpy2DAsync), offsets in bytes from the
    start of the staging buffer (dst) and of the arena's slots (src)."""

    dst_offset: int
    dst_pitch: int
    src_offset: int
    src_pitch: int
    width: int
    height: int


def group_copies(slot_runs: list[tuple[int, int, int]], layers: tuple[int, int],
                 layer_nbytes: int, slot_nbytes: int) -> list[Copy2D]:
    """A chunk's copies of one group: per run of consecutive slots, the group's bytes of
    each slot (a row) into consecutive staging rows ``[n, end - first, 2, block_size, ...]``."""
    first, end = layers
    width = (end - first) * layer_nbytes
    return [Copy2D(index * width, width, slot_id * slot_nbytes + first * layer_nbytes,
                   slot_nbytes, width, length) for index, slot_id, length in slot_runs]


@dataclass
class LoadCopy:
    """Blocks being written by a load on the load stream."""

    block_ids: frozenset[int]
    done: torch.cuda.Event
    group_done: tuple[torch.cuda.Event, ...] = ()  # per layer group, in order (G > 1)
    layer_groups: tuple[int, ...] = ()  # per layer: its group (G > 1)

    def first_layer_waits(self) -> Iterable[tuple[int, torch.cuda.Event]]:
        """(first layer of a group, its event): later layers of a group need no wait of
        their own, the stream already waits."""
        for layer, group in enumerate(self.layer_groups):
            if layer == 0 or self.layer_groups[layer - 1] != group:
                yield layer, self.group_done[group]


def load_waits(loads: Iterable[LoadCopy], touched_ids: set[int], written_ids: set[int],
               num_layers: int, by_layer: bool
               ) -> tuple[list[torch.cuda.Event], list[list[torch.cuda.Event]] | None]:
    """What a step touching ``touched_ids`` (reads and writes) waits for: events to wait on
    before it starts (whole loads), and per layer the events its attention waits on (None:
    none). Per layer only with ``by_layer`` (the forward can wait between layers), for a
    grouped load, and when the step writes none of its blocks: a layer's K/V is written
    before its attention, so a write into a loading block waits for the whole load."""
    whole: list[torch.cuda.Event] = []
    per_layer: list[list[torch.cuda.Event]] | None = None
    for load in loads:
        if touched_ids.isdisjoint(load.block_ids):
            continue
        if by_layer and load.group_done and written_ids.isdisjoint(load.block_ids):
            if per_layer is None:
                per_layer = [[] for _ in range(num_layers)]
            for layer, event in load.first_layer_waits():
                per_layer[layer].append(event)
        else:
            whole.append(load.done)
    return whole, per_layer
