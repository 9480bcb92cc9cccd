"""Whole KV blocks between the paged cache and a block-major staging buffer (Triton), for the
kvstore's copies (services/worker/kv_tiers.py).

The cache is layer-major, ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``,
while a host-tier slot holds one block of every layer, ``[num_layers, 2, block_size, ...]``:
a block is ``num_layers * 2`` contiguous pieces, one per layer and K/V, ``num_blocks`` pieces
apart. ``gather_blocks`` copies given blocks into consecutive slot-shaped rows of a staging
buffer (a store), ``scatter_blocks`` the reverse (a load). One program copies one piece
(32 KiB for Llama-3.1-8B) in wide words, so the copy runs at memory speed; torch's
``index_select``/``index_copy_`` on the permuted view indexed element by element and took
SM time from the forward running beside them.

``layers=(first, end)`` moves layers [first, end) only, with staging rows ``[end - first, 2,
block_size, ...]``: a load in layer groups (kv_tiers.py) scatters each group as it lands. The
cache's layers [first, end) are a contiguous slice of it, so the kernel is the same one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WORDS = 4096  # words one program moves per iteration (32 KiB of int64)


@triton.jit(do_not_specialize_on_alignment=["block_ids_ptr"])  # (a chunk's slice of the ids)
def _copy_pieces_kernel(
    cache_ptr, staging_ptr, block_ids_ptr, num_cache_blocks,
    PIECE_WORDS: tl.constexpr, NUM_PIECES: tl.constexpr, BLOCK_WORDS: tl.constexpr,
    TO_STAGING: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # the row of the staging buffer
    piece = tl.program_id(1).to(tl.int64)  # layer * 2 + (0: K, 1: V)
    block_id = tl.load(block_ids_ptr + row).to(tl.int64)
    cache = cache_ptr + (piece * num_cache_blocks + block_id) * PIECE_WORDS
    staging = staging_ptr + (row * NUM_PIECES + piece) * PIECE_WORDS
    for start in tl.range(0, PIECE_WORDS, BLOCK_WORDS):
        offs = start + tl.arange(0, BLOCK_WORDS)
        mask = offs < PIECE_WORDS
        if TO_STAGING:
            tl.store(staging + offs, tl.load(cache + offs, mask=mask), mask=mask)
        else:
            tl.store(cache + offs, tl.load(staging + offs, mask=mask), mask=mask)


def _words(kv_cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Both buffers as words (int64 where a piece allows it), and the piece's shape."""
    num_layers, two, num_cache_blocks = kv_cache.shape[:3]
    if not (kv_cache.is_contiguous() and staging.is_contiguous()):
        raise ValueError("the cache and the staging buffer must be contiguous")
    if staging.shape[1:] != (num_layers, two, *kv_cache.shape[3:]) or \
            staging.dtype != kv_cache.dtype:
        raise ValueError(f"staging {tuple(staging.shape)} {staging.dtype} does not hold blocks "
                         f"of the cache {tuple(kv_cache.shape)} {kv_cache.dtype}")
    if staging.shape[0] < block_ids.numel():
        raise ValueError(f"{block_ids.numel()} blocks for {staging.shape[0]} staging rows")
    piece_bytes = kv_cache[0, 0, 0].numel() * kv_cache.element_size()
    word = torch.int64 if piece_bytes % 8 == 0 else torch.int16 if piece_bytes % 2 == 0 \
        else torch.uint8
    return (kv_cache.view(-1).view(word), staging.view(-1).view(word),
            piece_bytes // torch.empty(0, dtype=word).element_size(), num_layers * two)


def _launch(kv_cache: torch.Tensor, staging: torch.Tensor, block_ids: torch.Tensor,
            to_staging: bool, compile_only: bool = False) -> None:
    if block_ids.numel() == 0:
        return
    cache_words, staging_words, piece_words, num_pieces = _words(kv_cache, staging, block_ids)
    block_words = min(MAX_WORDS, triton.next_power_of_2(piece_words))
    args = (cache_words, staging_words, block_ids, kv_cache.shape[2])
    constants = dict(PIECE_WORDS=piece_words, NUM_PIECES=num_pieces, BLOCK_WORDS=block_words,
                     TO_STAGING=to_staging, num_warps=8)
    grid = (block_ids.numel(), num_pieces)
    if compile_only:
        _copy_pieces_kernel.warmup(*args, grid=grid, **constants)
    else:
        _copy_pieces_kernel[grid](*args, **constants)


def compile_copies(kv_cache: torch.Tensor, staging: torch.Tensor,
                   load_layers: list[tuple[int, int] | None]) -> None:
    """Compile, without running, the kernel variants a kvstore's copies launch: a store's
    gather of every layer, and a load's scatter of every layer and of each of
    ``load_layers``' groups. Triton compiles on a first launch, which would stall the step
    that makes the first store or load (mid-run, on a machine with a cold Triton cache) for
    the compile."""
    block_ids = torch.zeros(1, dtype=torch.int64, device=kv_cache.device)
    _launch(kv_cache, staging, block_ids, to_staging=True, compile_only=True)
    for layers in {None, *load_layers}:
        sliced = layer_slice(kv_cache, layers)
        rows = staging.view(-1)[:sliced[:, :, 0].numel()].view(1, *sliced.shape[:2],
                                                                 *sliced.shape[3:])
        _launch(sliced, rows, block_ids, to_staging=False, compile_only=True)


def layer_slice(kv_cache: torch.Tensor, layers: tuple[int, int] | None) -> torch.Tensor:
    """The cache's layers [first, end) (all with None): [end - first, 2, num_blocks, ...],
    contiguous since the cache is layer-major."""
    if layers is None:
        return kv_cache
    first, end = layers
    if not 0 <= first < end <= kv_cache.shape[0]:
        raise ValueError(f"layers [{first}, {end}) outside the cache's {kv_cache.shape[0]}")
    return kv_cache[first:end]


def gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor,
                  layers: tuple[int, int] | None = None) -> None:
    """staging[i] = block ``block_ids[i]`` of every layer (of ``layers`` [first, end));
    block_ids [n] int64 on the device, staging [>= n, num_layers (end - first), 2,
    block_size, num_kv_heads, head_dim]."""
    _launch(layer_slice(kv_cache, layers), staging, block_ids, to_staging=True)


def scatter_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor,
                   layers: tuple[int, int] | None = None) -> None:
    """Block ``block_ids[i]`` of every layer (of ``layers``) = staging[i] (the reverse of
    gather_blocks)."""
    _launch(layer_slice(kv_cache, layers), staging, block_ids, to_staging=False)


def gather_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor,
                      layers: tuple[int, int] | None = None) -> None:
    n = block_ids.numel()
    staging[:n] = layer_slice(kv_cache, layers).permute(2, 0, 1, 3, 4, 5)[block_ids.long()]


def scatter_blocks_ref(kv_cache: torch.Tensor, block_ids: torch.Tensor, staging: torch.Tensor,
                       layers: tuple[int, int] | None = None) -> None:
    layer_slice(kv_cache, layers).permute(2, 0, 1, 3, 4, 5)[block_ids.long()] = \
        staging[:block_ids.numel()]
