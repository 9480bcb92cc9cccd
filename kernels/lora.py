"""LoRA's shrink and expand over a step's rows, each row with its own adapter (Triton).

A step's rows carry ``token_slots`` [num_tokens] int32: the device slot of the row's adapter,
-1 for a row of the base model. For a projection with slots ``a`` [max_loras, width,
in_features] and ``b`` [max_loras, out_features, width] (lora_slots.py: width is parts *
max_rank, the scaling folded into b):

- ``lora_shrink``: y[t] = x[t] @ a[slot(t)]^T, fp32 sums ([num_tokens, width]);
- ``lora_expand``: out[t] += y[t] @ b[slot(t)]^T, in place; a base row is never read or
  written, so it keeps its bits.

Rows grouped by slot (Punica's SGMV idea): the kernels read ``lora_rows`` [1 + 2 * n] int32,
the number n of adapter rows, then their (row, slot) pairs ordered by slot (``group_rows``,
made on the host from token_slots). A program takes BLOCK_M consecutive pairs, so a tile
holds one adapter, or a few where a slot's rows end inside it: it loops over the tile's
slots, each pass masked to that slot's rows (a decode batch interleaving 8 adapters reads
each adapter's A once per tile, not once per row). The grid comes from num_tokens (in a CUDA
graph, the bucket's) and n from the device: programs past n find no slot and do nothing, so
one capture serves any mix of adapter and base rows. The count and the pairs are loaded
together (the buffer's length is known), not one after the other.

Decode has one tile of rows: a single program would read all of A. The shrink splits
in_features into ``num_splits`` ranges, each writing its partial sums ([num_splits,
num_tokens, width] fp32); the expand adds them in split order as it loads y: deterministic,
no atomics and no launch more; decode's small tiles load all the partial sums at once. Sizes
that change per step are not specialized on (Triton would compile anew per token count); the
configs change only with the row bucket (kernels/lora_configs.py).

At decode sizes the shrink's programs may run inside another launch (``shrink_program``: the
skinny GEMM's, kernels/lora_delta.py), and gate_up's expand may take the SwiGLU after it
(``lora_expand_silu_and_mul``: every row of a step of at most 16, bitwise the expand then
kernels/activation.py under the interpreter; on the GPU a rare element a last bit apart, as
Triton folds the expand's add into its product's accumulator).

Programmatic dependent launch (kernels/pdl.py): before its wait a program loads the step's
pairs (a host copy) and its first slot's first tile of A or B (slots change between steps
only), so that work overlaps the kernel before it; it touches x, y and out after the wait.

Numerics: y's sums in fp32, rounded to b's dtype for the expand's product (the torch path
rounds x @ a^T to the activations' dtype too); the product is added to out in fp32 and rounded
once. fp32 products in full precision (not tf32). Configs swept on the H200 at the 8B's rank-16
shapes (``benchmarks/gpu/lora_kernels.py --sweep``); other shapes take lora_configs.py's
default plan. Compiled for sm_90 without a GPU (tests/kernels/lora_compile.py), the rank-16
default launches at the 8B's shapes spill no register (rank 64 still spills some).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.lora_configs import ExpandConfig, ShrinkConfig, block_w, default_plan

MIN_SPLIT_K = 128  # in_features a split covers at least
MAX_SPLITS_AT_ONCE = 16  # the expand's loads of partial sums in flight together
EXPAND_SILU_MAX_ROWS = 16  # the rows (one tile) ``lora_expand_silu_and_mul`` takes


def group_rows(token_slots: np.ndarray) -> np.ndarray:
    """token_slots [num_tokens] (-1: a base row) -> lora_rows [1 + 2 * n] int32: n, then the
    n adapter rows' (row, slot) pairs ordered by slot, rows ascending within a slot."""
    rows = np.flatnonzero(token_slots >= 0)
    rows = rows[np.argsort(token_slots[rows], kind="stable")]
    lora_rows = np.empty(1 + 2 * len(rows), np.int32)
    lora_rows[0] = len(rows)
    lora_rows[1::2] = rows
    lora_rows[2::2] = token_slots[rows]
    return lora_rows


def lora_rows_of(token_slots: torch.Tensor) -> torch.Tensor:
    """``group_rows`` of a tensor, on its device (tests, one-off callers)."""
    grouped = group_rows(token_slots.cpu().numpy())
    return torch.from_numpy(grouped).to(token_slots.device)


@triton.jit
def _tile_pairs(lora_rows_ptr, tile, max_pairs, BLOCK_M: tl.constexpr):
    """(rows [BLOCK_M] int64, slots [BLOCK_M], which are pairs, first slot, last slot; first >
    last where the tile has none). The count and the pairs load at once (the buffer holds
    max_pairs), not one after the other."""
    index = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    in_buffer = index < max_pairs
    num_pairs = tl.load(lora_rows_ptr)
    rows = tl.load(lora_rows_ptr + 1 + 2 * index, mask=in_buffer, other=0).to(tl.int64)
    slots = tl.load(lora_rows_ptr + 2 + 2 * index, mask=in_buffer, other=-1)
    in_tile = index < num_pairs
    slots = tl.where(in_tile, slots, -1)
    first = tl.min(tl.where(in_tile, slots, 2**30))
    return rows, slots, in_tile, first, tl.max(slots)


@triton.jit
def _dot(x, w, acc, FP32_IEEE: tl.constexpr, WIDEN: tl.constexpr):
    """acc + x [M, K] @ w [N, K]^T on the tensor cores (fp32 in full precision). WIDEN: bf16
    under the CPU interpreter, whose bf16 tl.dot is wrong, multiplied in fp32."""
    if WIDEN:
        return tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    if FP32_IEEE:
        return tl.dot(x, tl.trans(w), acc, input_precision="ieee")
    return tl.dot(x, tl.trans(w), acc)


@triton.jit
def shrink_program(x_ptr, a_ptr, lora_rows_ptr, y_ptr, in_features, width, split_len,
                   max_pairs, x_stride, a_stride_slot, y_stride_split, tile, split,
                   FP32_IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
                   PDL: tl.constexpr):
    """One shrink program's work, (row tile, split of in_features): y[split, row] = x[row,
    split's k] @ a[slot, :, k]^T. A tile past the adapter rows (or a split past in_features)
    finds none and only waits (kernels/pdl.py). Run by ``_shrink_kernel`` and, beside a
    projection's own programs, by the skinny GEMM's launch (kernels/skinny_gemm.py)."""
    # before the wait (kernels/pdl.py): the step's pairs (a host copy) and the first slot's
    # first tile of A (slots change between steps only), while the kernel before still runs
    rows, slots, in_tile, first, last = _tile_pairs(lora_rows_ptr, tile, max_pairs, BLOCK_M)
    cols = tl.arange(0, BLOCK_W)
    col_mask = cols < width
    offs_k = tl.arange(0, BLOCK_K)
    k_start = split * split_len
    k_end = tl.minimum(k_start + split_len, in_features)
    has_rows = cols * 0 + first <= last  # (a vector: the interpreter takes no scalar mask)
    first_mask = (col_mask & has_rows)[:, None] & (k_start + offs_k < k_end)[None, :]
    a_first = tl.load(a_ptr + tl.cast(tl.minimum(first, last), tl.int64) * a_stride_slot
                      + cols[:, None] * in_features + k_start + offs_k[None, :],
                      mask=first_mask, other=0.0)
    pdl.wait_then_launch_dependents(PDL)
    y_ptrs = y_ptr + split * y_stride_split + rows[:, None] * width + cols[None, :]
    for slot in range(first, last + 1):
        chosen = in_tile & (slots == slot)
        if tl.sum(chosen.to(tl.int32)) > 0:  # (slots between two present ones may be absent)
            a_base = a_ptr + tl.cast(slot, tl.int64) * a_stride_slot + cols[:, None] * in_features
            if slot == first:  # (the first tile peeled off the loop: loaded before the wait)
                a = a_first
            else:
                a = tl.load(a_base + k_start + offs_k[None, :], mask=first_mask, other=0.0)
            x = tl.load(x_ptr + rows[:, None] * x_stride + k_start + offs_k[None, :],
                        mask=chosen[:, None] & (k_start + offs_k < k_end)[None, :], other=0.0)
            acc = _dot(x, a, tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32), FP32_IEEE, WIDEN)
            for k in tl.range(k_start + BLOCK_K, k_end, BLOCK_K, num_stages=NUM_STAGES):
                ks = k + offs_k
                k_mask = ks < k_end
                x = tl.load(x_ptr + rows[:, None] * x_stride + ks[None, :],
                            mask=chosen[:, None] & k_mask[None, :], other=0.0)
                a = tl.load(a_base + ks[None, :], mask=col_mask[:, None] & k_mask[None, :],
                            other=0.0)
                acc = _dot(x, a, acc, FP32_IEEE, WIDEN)
            # (each row is one slot's: stored by its pass, no second accumulator held)
            tl.store(y_ptrs, acc, mask=chosen[:, None] & col_mask[None, :])


@triton.jit(do_not_specialize=["split_len", "max_pairs", "y_stride_split"])
def _shrink_kernel(x_ptr, a_ptr, lora_rows_ptr, y_ptr, in_features, width, split_len,
                   max_pairs, x_stride, a_stride_slot, y_stride_split, FP32_IEEE: tl.constexpr,
                   WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr,
                   BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr, PDL: tl.constexpr):
    """Program (row tile, split): ``shrink_program``."""
    shrink_program(x_ptr, a_ptr, lora_rows_ptr, y_ptr, in_features, width, split_len,
                   max_pairs, x_stride, a_stride_slot, y_stride_split, tl.program_id(0),
                   tl.program_id(1), FP32_IEEE, WIDEN, BLOCK_M, BLOCK_W, BLOCK_K, NUM_STAGES,
                   PDL)


@triton.jit(do_not_specialize=["num_splits", "max_pairs", "y_stride_split"])
def _expand_kernel(y_ptr, b_ptr, lora_rows_ptr, out_ptr, out_features, width, num_splits,
                   max_pairs, y_stride_split, out_stride, b_stride_slot,
                   FP32_IEEE: tl.constexpr, WIDEN: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr, SPLITS_AT_ONCE: tl.constexpr,
                   PDL: tl.constexpr):
    """Program (row tile, column tile): out[row, cols] += (sum of y's splits) @ b[slot, cols]^T."""
    tile, n_tile = tl.program_id(0), tl.program_id(1)
    # before the wait: the pairs and the first slot's tile of B (as the shrink's A)
    rows, slots, in_tile, first, last = _tile_pairs(lora_rows_ptr, tile, max_pairs, BLOCK_M)
    cols_w = tl.arange(0, BLOCK_W)
    w_mask = cols_w < width
    offs_n = n_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_features
    b_tile = offs_n[:, None] * width + cols_w[None, :]
    b_mask = n_mask[:, None] & w_mask[None, :]
    b_first = tl.load(b_ptr + tl.cast(tl.minimum(first, last), tl.int64) * b_stride_slot
                      + b_tile, mask=b_mask & (offs_n * 0 + first <= last)[:, None], other=0.0)
    pdl.wait_then_launch_dependents(PDL)
    y = _summed_y(y_ptr, rows, in_tile, cols_w, w_mask, width, num_splits, y_stride_split,
                  BLOCK_M, BLOCK_W, SPLITS_AT_ONCE).to(b_ptr.dtype.element_ty)
    out_ptrs = out_ptr + rows[:, None] * out_stride + offs_n[None, :]
    for slot in range(first, last + 1):
        chosen = in_tile & (slots == slot)
        if tl.sum(chosen.to(tl.int32)) > 0:
            if slot == first:
                b = b_first
            else:
                b = tl.load(b_ptr + tl.cast(slot, tl.int64) * b_stride_slot + b_tile,
                            mask=b_mask, other=0.0)
            delta = _dot(y, b, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), FP32_IEEE,
                         WIDEN)
            out_mask = chosen[:, None] & n_mask[None, :]  # (this slot's rows alone)
            out = tl.load(out_ptrs, mask=out_mask, other=0.0).to(tl.float32)
            tl.store(out_ptrs, (out + delta).to(out_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def _summed_y(y_ptr, rows, in_tile, cols_w, w_mask, width, num_splits, y_stride_split,
              BLOCK_M: tl.constexpr, BLOCK_W: tl.constexpr, SPLITS_AT_ONCE: tl.constexpr):
    """y's partial sums of the tile's rows added in split order ([BLOCK_M, BLOCK_W] fp32)."""
    y_ptrs = y_ptr + rows[:, None] * width + cols_w[None, :]
    y_mask = in_tile[:, None] & w_mask[None, :]
    y = tl.zeros((BLOCK_M, BLOCK_W), dtype=tl.float32)
    for split0 in range(0, num_splits, SPLITS_AT_ONCE):  # (in split order: the same sum
        for j in tl.static_range(SPLITS_AT_ONCE):       # every run; loads in flight together)
            y += tl.load(y_ptrs + (split0 + j) * y_stride_split,
                         mask=y_mask & (cols_w * 0 + split0 + j < num_splits)[None, :],
                         other=0.0)
    return y


@triton.jit(do_not_specialize=["num_tokens", "num_splits", "max_pairs", "y_stride_split"])
def _expand_silu_kernel(y_ptr, b_ptr, lora_rows_ptr, gate_up_ptr, out_ptr, num_tokens, d,
                        width, num_splits, max_pairs, y_stride_split, gate_up_stride,
                        out_stride, b_stride_slot, FP32_IEEE: tl.constexpr,
                        WIDEN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_W: tl.constexpr, SPLITS_AT_ONCE: tl.constexpr,
                        PDL: tl.constexpr):
    """Program (column tile of d), every row of a step of at most BLOCK_M: out = silu(gate) *
    up of gate_up [num_tokens, 2d] with each adapter row's delta added to its gate and up
    (rounded as the expand, then kernels/activation.py, round them)."""
    # before the wait: the pairs (one tile holds them all) and the first slot's B tiles
    pair_rows, slots, in_tile, first, last = _tile_pairs(lora_rows_ptr, 0, max_pairs, BLOCK_M)
    cols_w = tl.arange(0, BLOCK_W)
    w_mask = cols_w < width
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < d
    b_tile = offs_n[:, None] * width + cols_w[None, :]  # gate's rows of B (up's d further)
    b_mask = n_mask[:, None] & w_mask[None, :] & (offs_n * 0 + first <= last)[:, None]
    b_first = b_ptr + tl.cast(tl.minimum(first, last), tl.int64) * b_stride_slot + b_tile
    b_gate = tl.load(b_first, mask=b_mask, other=0.0)
    b_up = tl.load(b_first + d * width, mask=b_mask, other=0.0)
    pdl.wait_then_launch_dependents(PDL)
    y = _summed_y(y_ptr, pair_rows, in_tile, cols_w, w_mask, width, num_splits, y_stride_split,
                  BLOCK_M, BLOCK_W, SPLITS_AT_ONCE).to(b_ptr.dtype.element_ty)
    delta_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # [pairs, columns]
    delta_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for slot in range(first, last + 1):
        chosen = in_tile & (slots == slot)
        if tl.sum(chosen.to(tl.int32)) > 0:
            if slot != first:
                b_slot = b_ptr + tl.cast(slot, tl.int64) * b_stride_slot + b_tile
                b_gate = tl.load(b_slot, mask=b_mask, other=0.0)
                b_up = tl.load(b_slot + d * width, mask=b_mask, other=0.0)
            y_slot = tl.where(chosen[:, None], y, 0.0)  # (this slot's rows alone)
            delta_gate = _dot(y_slot, b_gate, delta_gate, FP32_IEEE, WIDEN)
            delta_up = _dot(y_slot, b_up, delta_up, FP32_IEEE, WIDEN)
    # each pair's delta to its row: a 0/1 [rows, pairs] product, exact in fp32
    step_rows = tl.arange(0, BLOCK_M)
    to_row = ((step_rows[:, None] == pair_rows[None, :]) & in_tile[None, :]).to(tl.float32)
    delta_gate = tl.dot(to_row, delta_gate, input_precision="ieee")
    delta_up = tl.dot(to_row, delta_up, input_precision="ieee")
    row_mask = (step_rows < num_tokens)[:, None] & n_mask[None, :]
    base = gate_up_ptr + step_rows[:, None] * gate_up_stride + offs_n[None, :]
    dtype = out_ptr.dtype.element_ty
    gate = (tl.load(base, mask=row_mask, other=0.0).to(tl.float32) + delta_gate).to(dtype)
    up = (tl.load(base + d, mask=row_mask, other=0.0).to(tl.float32) + delta_up).to(dtype)
    gate = gate.to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # (F.silu, rounded)
    tl.store(out_ptr + step_rows[:, None] * out_stride + offs_n[None, :],
             (silu.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=row_mask)


def shrink_splits(num_tokens: int, in_features: int, config: ShrinkConfig) -> tuple[int, int]:
    """(num_splits, split_len): enough programs to spread A's read over the GPU when the
    rows make few tiles (config.target_programs), each split a multiple of block_k and at
    least MIN_SPLIT_K long."""
    num_tiles = triton.cdiv(num_tokens, config.block_m)
    num_splits = max(1, min(config.max_splits, in_features // MIN_SPLIT_K,
                            triton.cdiv(config.target_programs, num_tiles)))
    split_len = triton.cdiv(triton.cdiv(in_features, num_splits), config.block_k) * config.block_k
    return triton.cdiv(in_features, split_len), split_len


def _widen(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.bfloat16


def _max_pairs(lora_rows: torch.Tensor) -> int:
    """The (row, slot) pairs the buffer holds (the count before them)."""
    return (lora_rows.numel() - 1) // 2


def _check(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (strides {t.stride()})")


def lora_shrink(x: torch.Tensor, a: torch.Tensor, lora_rows: torch.Tensor,
                config: ShrinkConfig | None = None) -> torch.Tensor:
    """x [num_tokens, in_features], a [max_loras, width, in_features] (contiguous), lora_rows
    (``group_rows``) -> y [num_splits, num_tokens, width] fp32: per split of in_features its
    partial sums at the adapter rows (other rows unwritten); ``lora_expand`` adds them.
    config: lora_configs.py's (None: its default plan)."""
    num_tokens, in_features = x.shape
    width = a.shape[1]
    _check(x, "x")
    if not a.is_contiguous() or a.shape[2] != in_features:
        raise ValueError(f"a {tuple(a.shape)} must be contiguous [max_loras, width, "
                         f"{in_features}]")
    config = config or default_plan(num_tokens, width).shrink
    num_splits, split_len = shrink_splits(num_tokens, in_features, config)
    y = torch.empty(num_splits, num_tokens, width, dtype=torch.float32, device=x.device)
    if num_tokens:
        _shrink_kernel[(triton.cdiv(num_tokens, config.block_m), num_splits)](
            x, a, lora_rows, y, in_features, width, split_len, _max_pairs(lora_rows),
            x.stride(0), a.stride(0), y.stride(0), FP32_IEEE=x.dtype == torch.float32,
            WIDEN=_widen(x), BLOCK_M=config.block_m, BLOCK_W=block_w(width),
            BLOCK_K=config.block_k, NUM_STAGES=config.num_stages, num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl.launch_options())
    return y


def lora_expand(y: torch.Tensor, b: torch.Tensor, lora_rows: torch.Tensor,
                out: torch.Tensor, config: ExpandConfig | None = None) -> torch.Tensor:
    """out [num_tokens, out_features] += y (``lora_shrink``'s, splits summed) @ b[slot]^T at
    the adapter rows, in place; b [max_loras, out_features, width] contiguous."""
    num_splits, num_tokens, width = y.shape
    out_features = b.shape[1]
    _check(out, "out")
    if not b.is_contiguous() or b.shape[2] != width or out.shape != (num_tokens, out_features):
        raise ValueError(f"b {tuple(b.shape)}, out {tuple(out.shape)} do not fit y "
                         f"{tuple(y.shape)}")
    config = config or default_plan(num_tokens, width).expand
    tile_w = block_w(width)
    # partial sums in flight together: all of decode's small tiles, fewer of large ones
    splits_at_once = max(1, min(MAX_SPLITS_AT_ONCE, 16384 // (config.block_m * tile_w)))
    if num_tokens:
        _expand_kernel[(triton.cdiv(num_tokens, config.block_m),
                        triton.cdiv(out_features, config.block_n))](
            y, b, lora_rows, out, out_features, width, num_splits, _max_pairs(lora_rows),
            y.stride(0), out.stride(0), b.stride(0), FP32_IEEE=b.dtype == torch.float32,
            WIDEN=_widen(b), BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_W=tile_w,
            SPLITS_AT_ONCE=splits_at_once, num_warps=config.num_warps,
            num_stages=config.num_stages, **pdl.launch_options())
    return out


def lora_expand_silu_and_mul(y: torch.Tensor, b: torch.Tensor, lora_rows: torch.Tensor,
                             gate_up: torch.Tensor, config: ExpandConfig | None = None
                             ) -> torch.Tensor:
    """SwiGLU of a gate_up projection's output with its adapter rows' deltas in, one launch:
    y (``lora_shrink``'s), b [max_loras, 2d, width], gate_up [num_tokens, 2d] (the base GEMM's,
    num_tokens at most EXPAND_SILU_MAX_ROWS) -> [num_tokens, d], rounded as ``lora_expand``
    into gate_up then kernels/activation.py's silu_and_mul (gate_up is not written; bitwise
    under the interpreter, on the GPU a last bit apart in some elements: see
    tests/kernels/test_lora_beside_gemm.py)."""
    num_splits, num_tokens, width = y.shape
    d = gate_up.shape[1] // 2
    _check(gate_up, "gate_up")
    if (not b.is_contiguous() or b.shape[1:] != (2 * d, width)
            or gate_up.shape != (num_tokens, 2 * d) or num_tokens > EXPAND_SILU_MAX_ROWS):
        raise ValueError(f"b {tuple(b.shape)}, gate_up {tuple(gate_up.shape)} do not fit y "
                         f"{tuple(y.shape)} (at most {EXPAND_SILU_MAX_ROWS} rows)")
    config = config or default_plan(num_tokens, width).expand
    tile_w = block_w(width)
    out = torch.empty(num_tokens, d, dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens and d:
        _expand_silu_kernel[(triton.cdiv(d, config.block_n),)](
            y, b, lora_rows, gate_up, out, num_tokens, d, width, num_splits,
            _max_pairs(lora_rows), y.stride(0), gate_up.stride(0), out.stride(0), b.stride(0),
            FP32_IEEE=b.dtype == torch.float32, WIDEN=_widen(b),
            BLOCK_M=EXPAND_SILU_MAX_ROWS, BLOCK_N=config.block_n, BLOCK_W=tile_w,
            SPLITS_AT_ONCE=max(1, min(MAX_SPLITS_AT_ONCE, 16384 // (16 * tile_w))),
            num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options())
    return out


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, token_slots: torch.Tensor
                    ) -> torch.Tensor:
    """Plain torch: y [num_tokens, width] fp32, zeros at base rows."""
    y = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = token_slots == slot
            y[rows] = x[rows].float() @ a[slot].float().T
    return y


def lora_expand_ref(y: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
                    out: torch.Tensor) -> torch.Tensor:
    """Plain torch, as lora_expand (y [num_tokens, width], its splits summed): in place."""
    for slot in token_slots.unique().tolist():
        if slot >= 0:
            rows = token_slots == slot
            delta = y[rows].to(b.dtype).float() @ b[slot].float().T
            out[rows] = (out[rows].float() + delta).to(out.dtype)
    return out
