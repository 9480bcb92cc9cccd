"""Tensor parallelism's row-parallel projection tail in one kernel: each rank's partial sums
added over the ranks through GPU peer memory, then the residual add and the RMSNorm (Triton).

A tensor-parallel decode layer ends o_proj and down with the same launches: the projection's
split-K reduce where its config splits K (this rank's part, rounded), an all-reduce of the
parts, and the residual add + RMSNorm. At batch 1 each is a few microseconds of mostly
waiting, and a Llama-3.1-8B step has 64 of each. Here one program per row does them all:

1. sums this rank's split-K partials (fp32, in split order) plus the bias and rounds them to
   the activation dtype, as ``skinny_gemm``'s reduce stores its output (or takes a projection
   output already rounded: one "split");
2. pushes that part into a slot of every other rank's buffer (peer memory over NVLink),
   then raises a flag in each peer's buffer with a release store at system scope;
3. waits until every peer's flag for this row has reached this call's number (acquire, system
   scope), then adds the parts in rank order in fp32 and rounds, so every rank gets the same
   bits (those of NCCL's and the one-shot all-reduce's sum of two parts);
4. adds the residual (written back) and normalizes with kernels/rms_norm.py's single-pass code.

No barrier is reset and no buffer is cleared. A row's calls are numbered by a counter in local
memory that only its program touches (every rank makes the same calls with the same rows, so
the numbers agree), and the flags only grow: "has reached" needs no reset, and a peer that is
one call ahead cannot be missed. Slots alternate by the call number's parity: a rank writes a
peer's slot again only two calls later, after the peer has passed the call in between, which it
enters only after finishing (and reading) this one. All of it depends on shapes only, so the
kernel is captured in CUDA graphs like any other.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.rms_norm import MAX_SINGLE_PASS, add_rms_norm_row, single_pass_launch
from kernels.split_reduce import sum_splits


@triton.jit
def _all_reduce_add_rms_norm_kernel(
    partial_ptr, bias_ptr, residual_ptr, norm_weight_ptr, out_ptr, buffer_ptrs_ptr,
    call_counts_ptr, N, eps, partial_stride_split, partial_stride_m, residual_stride_m,
    out_stride_m, flags_offset,
    RANK: tl.constexpr, WORLD: tl.constexpr, MAX_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One program per row; ``buffer_ptrs_ptr`` [WORLD] int64: every rank's buffer address
    (slots [2, WORLD, MAX_ROWS, N] of out's dtype from its start, flags [FLAG_ROWS, WORLD]
    int64, call numbers, from int64 element ``flags_offset``); ``call_counts_ptr``
    [FLAG_ROWS] int64, this rank's."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    pdl.wait_then_launch_dependents(PDL)
    dtype = out_ptr.dtype.element_ty
    # this rank's part: its splits summed plus the bias, rounded as the split reduce rounds
    # (one split of dtype, a projection output already rounded, comes back as it is)
    part = sum_splits(partial_ptr, bias_ptr, row, cols, mask, partial_stride_split,
                      partial_stride_m, HAS_BIAS, SPLIT_K).to(dtype)
    call = tl.load(call_counts_ptr + row) + 1
    slot = ((call % 2) * WORLD * MAX_ROWS + row) * N  # + src * MAX_ROWS * N
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_slots = tl.load(buffer_ptrs_ptr + peer).to(tl.pointer_type(dtype))
            tl.store(peer_slots + slot + RANK * MAX_ROWS * N + cols, part, mask=mask)
    tl.debug_barrier()  # every thread's stores before the flags that publish them
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            peer_flags = tl.load(buffer_ptrs_ptr + peer).to(tl.pointer_type(tl.int64))
            tl.atomic_xchg(peer_flags + flags_offset + row * WORLD + RANK, call,
                           sem="release", scope="sys")
    own = tl.load(buffer_ptrs_ptr + RANK)
    own_flags = own.to(tl.pointer_type(tl.int64)) + flags_offset + row * WORLD
    for peer in tl.static_range(WORLD):
        if peer != RANK:
            seen = tl.atomic_add(own_flags + peer, 0, sem="acquire", scope="sys")
            while seen < call:
                seen = tl.atomic_add(own_flags + peer, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the parts arrived before any thread reads them
    own_slots = own.to(tl.pointer_type(dtype)) + slot
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for src in tl.static_range(WORLD):  # rank order: the same bits on every rank
        if src == RANK:
            total += part.to(tl.float32)
        else:
            total += tl.load(own_slots + src * MAX_ROWS * N + cols, mask=mask, other=0.0,
                             cache_modifier=".cv").to(tl.float32)
    add_rms_norm_row(total.to(dtype).to(tl.float32), residual_ptr + row * residual_stride_m,
                     norm_weight_ptr, out_ptr + row * out_stride_m, cols, mask, N, eps, True,
                     dtype)
    tl.store(call_counts_ptr + row, call)


FLAG_ROWS = 256  # rows a call may have at most (a decode step's tokens)


def buffer_bytes(world_size: int, max_part_bytes: int) -> int:
    """Bytes of one rank's buffer: slots for two calls' parts from every rank, each part of up
    to ``max_part_bytes``, then a flag a row per rank."""
    return 2 * world_size * max_part_bytes + FLAG_ROWS * world_size * 8


def max_rows(hidden_size: int, dtype: torch.dtype, max_part_bytes: int) -> int:
    """The most rows of ``hidden_size`` a call may have: its part fits a slot."""
    return min(FLAG_ROWS, max_part_bytes // (hidden_size * dtype.itemsize))


def all_reduce_add_rms_norm(partial: torch.Tensor, bias: torch.Tensor | None,
                            residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            buffer_ptrs: torch.Tensor, call_counts: torch.Tensor, rank: int,
                            max_part_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """partial: this rank's projection output, [split_k, M, N] fp32 split-K partials (bias not
    yet added) or [M, N] rounded (bias in); residual [M, N] (``+=`` the ranks' sum, in place);
    norm_weight [N] -> (normed [M, N], residual). ``buffer_ptrs`` [world] int64: the ranks'
    zeroed buffers of ``buffer_bytes(world, max_part_bytes)`` (peer memory); ``call_counts``
    [FLAG_ROWS] int64, zeros at first, this rank's alone. Every rank must make the same calls,
    with the same M <= ``max_rows`` and N."""
    splits = partial if partial.dim() == 3 else partial.unsqueeze(0)
    split_k, m, n = splits.shape
    world = buffer_ptrs.shape[0]
    rows = max_rows(n, residual.dtype, max_part_bytes)
    if m > rows or n > MAX_SINGLE_PASS or residual.shape != (m, n):
        raise ValueError(f"{m} rows of {n} (at most {rows} of {MAX_SINGLE_PASS}) against "
                         f"a residual {tuple(residual.shape)}")
    if splits.stride(2) != 1 or residual.stride(1) != 1 or not norm_weight.is_contiguous():
        raise ValueError("partial, residual and norm_weight need a contiguous last dim")
    out = torch.empty(m, n, dtype=residual.dtype, device=residual.device)
    if m == 0:
        return out, residual
    block, num_warps = single_pass_launch(n)  # as kernels/rms_norm.py launches a row
    _all_reduce_add_rms_norm_kernel[(m,)](
        splits, bias if bias is not None else norm_weight, residual, norm_weight, out,
        buffer_ptrs, call_counts, n, eps, splits.stride(0), splits.stride(1),
        residual.stride(0), out.stride(0), 2 * world * max_part_bytes // 8,
        RANK=rank, WORLD=world, MAX_ROWS=rows, HAS_BIAS=bias is not None and split_k > 1,
        SPLIT_K=split_k, BLOCK=block, num_warps=num_warps, **pdl.launch_options(),
    )
    return out, residual
