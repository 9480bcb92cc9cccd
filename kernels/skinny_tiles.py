"""The skinny GEMM's steps on a program's tile (Triton device functions, inlined into
kernels/skinny_gemm.py's ``_skinny_gemm_kernel``, which says what the kernel does): which
tile a program takes, the masks of a K tile, the product on the tensor cores (FP8 weights
widened, or multiplied in fp16), the first tile around the PDL wait, and the tile written
(weight scales, bias, SwiGLU, the rounding; or an fp32 partial of a K split)."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import pdl
from kernels.split_reduce import store_rounded


@triton.jit
def silu_times(gate, up, dtype: tl.constexpr):
    """silu(gate) * up of fp32 tiles, rounded as the two kernels (GEMM, then
    kernels/activation.py) round it: gate and up to ``dtype``, silu to ``dtype``, the product."""
    gate = gate.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    return silu.to(tl.float32) * up.to(dtype).to(tl.float32)


@triton.jit
def tile_dot(x, w, acc, FP32_IEEE: tl.constexpr, FP16_DOT: tl.constexpr):
    """acc + x [BLOCK_M, BLOCK_K] @ w [BLOCK_N, BLOCK_K]^T on the tensor cores (fp32 in full
    precision, as cuBLAS's default; not tf32). An FP8 w is widened to x's dtype first, or with
    FP16_DOT (bf16 x) multiplied in fp16 (``fp16_dot``)."""
    if FP16_DOT:
        acc = fp16_dot(x, w, acc)
    else:
        w = w.to(x.dtype)
        if FP32_IEEE:
            acc = tl.dot(x, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w), acc)
    return acc


@triton.jit
def fp16_dot(x, w, acc):
    """acc + x @ w^T for bf16 x and an FP8 w, on the fp16 tensor cores: e4m3 widens to fp16 in
    one conversion per pair of values, to bf16 in three, and at decode sizes those conversions
    bound the kernel, not memory. Each row of the x tile is divided by the power of two that
    puts its absolute max in [2^14, 2^15): exact, and inside fp16's range, so the fp16
    products are bf16's; the tile's partial is multiplied back (also exact)."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)  # [BLOCK_M]
    biased_exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF
    scale_exp = tl.minimum(tl.maximum(biased_exp - 14, 1), 253)  # a zero row: any scale
    row_scale = (scale_exp << 23).to(tl.float32, bitcast=True)  # 2^(scale_exp - 127)
    inv_row_scale = ((254 - scale_exp) << 23).to(tl.float32, bitcast=True)
    x16 = (x * inv_row_scale[:, None]).to(tl.float16)
    return acc + tl.dot(x16, tl.trans(w.to(tl.float16))) * row_scale[:, None]


@triton.jit
def times_weight_scale(acc, scale_ptr, offs_n, n_mask, HAS_SCALE: tl.constexpr):
    """With HAS_SCALE (an FP8 weight), each column's sum times its weight scale.
    Per output channel, so scaling each split's partial scales their sum."""
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)[None, :]
    return acc


@triton.jit
def row_and_column_tile(pid0, M, BLOCK_M: tl.constexpr):
    """(row tile, column tile) of the GEMM's program ``pid0`` (along the grid's first axis):
    the programs of one column tile, one a BLOCK_M-row tile of x, run side by side (row tiles
    vary fastest), so a weight tile read once from memory serves them all from L2. At most
    BLOCK_M rows: (0, pid0)."""
    num_m_tiles = tl.cdiv(M, BLOCK_M)
    return pid0 % num_m_tiles, pid0 // num_m_tiles


@triton.jit
def tile_masks(k, offs_k, k_end, m_mask, n_mask, EVEN_K: tl.constexpr):
    """The masks of the K tile at ``k``: the weight's [BLOCK_N, BLOCK_K] and x's
    [BLOCK_M, BLOCK_K] (EVEN_K: every tile whole, rows and columns masked only)."""
    if EVEN_K:
        w_mask = n_mask[:, None]
        x_mask = m_mask[:, None]
    else:
        k_mask = (k + offs_k) < k_end
        w_mask = n_mask[:, None] & k_mask[None, :]
        x_mask = m_mask[:, None] & k_mask[None, :]
    return w_mask, x_mask


@triton.jit
def first_tile_then_wait(w_ptrs, x_ptrs, up_offset, k_start, offs_k, k_end, m_mask, n_mask,
                          acc, acc_up, EVEN_K: tl.constexpr, FP32_IEEE: tl.constexpr,
                          FP16_DOT: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
    """PDL: the first K tile, its weights loaded before the wait for the previous kernel (no
    kernel writes weights), its x after -> (acc, acc_up) with its product added."""
    w_mask, x_mask = tile_masks(k_start, offs_k, k_end, m_mask, n_mask, EVEN_K)
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if GATED:
        w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
    pdl.wait_then_launch_dependents(PDL)
    x = tl.load(x_ptrs, mask=x_mask, other=0.0)
    acc = tile_dot(x, w, acc, FP32_IEEE, FP16_DOT)
    if GATED:
        acc_up = tile_dot(x, w_up, acc_up, FP32_IEEE, FP16_DOT)
    return acc, acc_up


@triton.jit
def write_tile(acc, acc_up, x_ptr, bias_ptr, scale_ptr, out_ptr, partial_ptr, pid_k, offs_m,
                offs_n, m_mask, n_mask, N, out_stride_m, partial_stride_split, partial_stride_m,
                HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, SPLIT_K: tl.constexpr,
                GATED: tl.constexpr):
    """The program's tile of sums, times the weight scales (FP8), written: with K split as
    an fp32 partial (kernels/split_reduce.py adds them), else biased, gated and rounded."""
    acc = times_weight_scale(acc, scale_ptr, offs_n, n_mask, HAS_SCALE)
    if GATED:  # the up rows' scales follow the gate rows'
        acc_up = times_weight_scale(acc_up, scale_ptr + N, offs_n, n_mask, HAS_SCALE)
    out_mask = m_mask[:, None] & n_mask[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * out_stride_m + offs_n[None, :]
    if SPLIT_K > 1:  # an fp32 partial per split; kernels/split_reduce.py adds them
        partial_ptrs = (partial_ptr + pid_k * partial_stride_split
                        + offs_m[:, None] * partial_stride_m + offs_n[None, :])
        tl.store(partial_ptrs, acc, mask=out_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(bias_ptr + N + offs_n, mask=n_mask,
                                  other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc = silu_times(acc, acc_up, x_ptr.dtype.element_ty)
        store_rounded(out_ptrs, acc, x_ptr, out_ptr, out_mask)
