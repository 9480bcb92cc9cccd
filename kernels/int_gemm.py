"""W4A16 / W8A16 GEMM (Triton): ``y[M, N] = x[M, K] @ W^T (+ bias)`` with W kept packed in
kernels/int_pack.py's layout (``IntWeight``) and dequantized in registers.

- A program takes a [BLOCK_M, BLOCK_N] output tile and walks K one tile of ``BLOCK_KW``
  packed words (BLOCK_KW * per_word inputs) at a time: the words [BLOCK_KW, BLOCK_N] are read
  once, with their groups' scales and zeros (a word's inputs share a group); for each of the
  per_word bit fields the weights w = ((q - z) * s in fp32, cast to x's dtype: the
  dequantized checkpoint's values bit for bit) are multiplied on the tensor cores
  (``tl.dot``, fp32 accumulation) with the x columns that field holds (inputs
  word * per_word + field, a strided load of x; through ``perm`` under act-order).
- **decode** (``int_gemm_decode``, 1-16 rows, what a CUDA graph's decode step runs): 16-row
  tiles, narrow column tiles, K split where N gives too few programs to fill the GPU; the
  splits' fp32 partials are added in split order by kernels/split_reduce.py (deterministic).
  Every weight byte is read from memory once per step.
- **prefill** (``int_gemm_prefill``, more rows): 64- or 128-row tiles, the column tiles of a
  band of row tiles side by side (``GROUP_M``) so a weight tile read from memory serves them
  from L2; no split.
- ``int_gemm_add_rms_norm``: a decode launch with K split (o_proj, down) whose split reduce
  also adds the residual and applies the RMSNorm after it (kernels/split_reduce.py, as the
  skinny GEMM's): bitwise the two ops, one launch less.
- bf16 and fp16 x (fp32 too, in full precision: tests), 4 and 8 bits, any group size that is
  a multiple of per_word (32, 64, 128, ...) or one group (channel-wise), zero points or
  symmetric. The launch config depends on (M bucket, N, K) only; the grid and the split
  scratch on shapes only: capturable in a CUDA graph (no host sync, no value-sized
  allocation). With PDL on (kernels/pdl.py), a programmatic dependent launch: every program
  waits for the previous kernel after its index math, before its first load (the skinny
  GEMM's prefetch of the first weight tile before the wait is not built here).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import pdl, split_reduce
from kernels.int_pack import IntWeight, int_gemm_ref  # noqa: F401  (the reference)
from kernels.rms_norm import MAX_SINGLE_PASS
from kernels.skinny_tiles import write_tile

DECODE_MAX_M = 16  # rows the decode launch serves


@dataclass(frozen=True)
class IntGemmConfig:
    block_m: int
    block_n: int
    block_kw: int  # packed words of K a tile (x per_word inputs)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8  # row tiles whose column tiles run side by side (prefill)
    # the tile's bit fields interleaved into one [BLOCK_KW * per_word, BLOCK_N] weight tile
    # and one dot with contiguous x, instead of a dot per field with x strided (TUNE: which
    # wins is unmeasured; benchmarks/gpu/int_gemm.py --sweep tries both)
    one_dot: bool = False


# (bits, N, K) -> decode config, TUNE on the GPU (benchmarks/gpu/int_gemm.py --sweep): none
# swept yet, so ``decode_config``'s rule serves every shape
DECODE_CONFIGS: dict[tuple[int, int, int], IntGemmConfig] = {}
TARGET_PROGRAMS = 264  # two waves of an H200's 132 SMs: split K until a decode launch has them


def _block_kw(bits: int) -> int:
    """16 words (128 inputs) of 4 bits or 32 words (128 inputs) of 8: the dot's K is >= 16."""
    return 16 if bits == 4 else 32


def decode_config(bits: int, n: int, k: int) -> IntGemmConfig:
    """The decode launch for a [n, k] weight: a swept one where the table has it, else 64
    columns a program and K split (in whole tiles, up to 8 ways) to ~TARGET_PROGRAMS."""
    swept = DECODE_CONFIGS.get((bits, n, k))
    if swept is not None:
        return swept
    block_n = 64 if n >= 2048 else 32
    block_kw = _block_kw(bits)
    num_tiles = triton.cdiv(n, block_n)
    num_k_tiles = triton.cdiv(triton.cdiv(k, 32 // bits), block_kw)
    split_k = max(1, min(8, num_k_tiles, TARGET_PROGRAMS // num_tiles))
    return IntGemmConfig(DECODE_MAX_M, block_n, block_kw, split_k=split_k, num_stages=4)


def prefill_config(bits: int, m: int, n: int, k: int) -> IntGemmConfig:
    """The prefill launch: 32- or 64-row tiles up to 256 rows, 128-row tiles above (TUNE).
    8 warps: with 4, 64-row tiles spilled registers under an act-order gather of x, and
    32-row ones of 8 bits at 4 stages (compiled for sm_90: tests/kernels/int_gemm_compile.py)."""
    block_kw = _block_kw(bits)
    if m <= 32:
        return IntGemmConfig(32, 64, block_kw, num_warps=8, num_stages=4, one_dot=True)
    if m <= 64:
        return IntGemmConfig(64, 64, block_kw, num_warps=8, num_stages=4, one_dot=True)
    if m <= 256:
        return IntGemmConfig(64, 128, block_kw, num_warps=8, num_stages=4, one_dot=True)
    return IntGemmConfig(128, 128, block_kw, num_warps=8, num_stages=3, one_dot=True)


@triton.jit
def _tile_ids(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row tile, column tile) of program_id(0): GROUP_M row tiles' column tiles in a band, the
    row tiles varying fastest (a weight tile then serves them from L2)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * num_n)
    first_m = band * GROUP_M
    band_m = tl.minimum(num_m - first_m, GROUP_M)
    local = pid % (GROUP_M * num_n)
    return first_m + local % band_m, local // band_m


@triton.jit
def _field_values(q):
    """Unsigned bit fields q (int32, below 2^23) as 2^23 + q in fp32, exactly: one OR and a
    bitcast instead of an int-to-float conversion (a quarter-rate instruction on Hopper)."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _dequant_dot(words, s, z, acc, x_ptr, perm_ptr, offs_m, m_mask, offs_kw, K, x_stride,
                 BITS: tl.constexpr, HAS_PERM: tl.constexpr, FP32_IEEE: tl.constexpr):
    """acc + x @ W^T over one K tile: words [BLOCK_KW, BLOCK_N] int32, s [BLOCK_KW, BLOCK_N]
    fp32 and z (2^23 + the zero in fp32, a tile or a scalar) of each word's group."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    for field in tl.static_range(PER_WORD):
        q = (words >> (field * BITS)) & MASK  # [BLOCK_KW, BLOCK_N]
        inputs = offs_kw * PER_WORD + field  # [BLOCK_KW]: the packed inputs of this field
        k_mask = inputs < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + inputs, mask=k_mask, other=0)
        else:
            cols = inputs
        x = tl.load(x_ptr + offs_m[:, None] * x_stride + cols[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_KW]
        # (2^23 + q) - (2^23 + z) is q - z exactly: the dequantized weights, bit for bit
        w = ((_field_values(q) - z) * s).to(x.dtype)
        if FP32_IEEE:
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    return acc


@triton.jit
def _dequant_dot_joined(words, s, z, acc, x_ptr, perm_ptr, offs_m, m_mask, kw, K, x_stride,
                        BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
                        FP32_IEEE: tl.constexpr, BLOCK_KW: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """``_dequant_dot`` as one dot: the fields unpacked into [BLOCK_KW, per_word, BLOCK_N],
    which row-major is [BLOCK_KW * per_word, BLOCK_N] with input word * per_word + field,
    against x's BLOCK_KW * per_word contiguous columns."""
    PER_WORD: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BLOCK_K: tl.constexpr = BLOCK_KW * PER_WORD
    shifts = tl.arange(0, PER_WORD) * BITS  # [PER_WORD]
    q = (words[:, None, :] >> shifts[None, :, None]) & MASK  # [BLOCK_KW, PER_WORD, BLOCK_N]
    if HAS_ZEROS:
        w = (_field_values(q) - z[:, None, :]) * s[:, None, :]  # [BLOCK_KW, PER_WORD, BLOCK_N]
    else:
        w = (_field_values(q) - z) * s[:, None, :]
    inputs = kw * PER_WORD + tl.arange(0, BLOCK_K)  # [BLOCK_K]: the tile's inputs in order
    k_mask = inputs < K
    if HAS_PERM:
        cols = tl.load(perm_ptr + inputs, mask=k_mask, other=0)
    else:
        cols = inputs
    x = tl.load(x_ptr + offs_m[:, None] * x_stride + cols[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
    w = tl.reshape(w, (BLOCK_K, BLOCK_N)).to(x.dtype)
    if FP32_IEEE:
        acc = tl.dot(x, w, acc, input_precision="ieee")
    else:
        acc = tl.dot(x, w, acc)
    return acc


@triton.jit(do_not_specialize=["M"])
def _int_gemm_kernel(
    x_ptr, w_ptr, scales_ptr, zeros_ptr, perm_ptr, bias_ptr, out_ptr, partial_ptr,
    M, N, K, x_stride, out_stride_m, partial_stride_split, partial_stride_m,
    words_per_split, num_words, group_words,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_PERM: tl.constexpr,
    HAS_BIAS: tl.constexpr, FP32_IEEE: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
    GROUP_M: tl.constexpr, ONE_DOT: tl.constexpr, PDL: tl.constexpr,
):
    """Program (output tile, K split). ``group_words``: packed words a group spans."""
    pid_m, pid_n = _tile_ids(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    kw_start = pid_k * words_per_split
    kw_end = tl.minimum(num_words, kw_start + words_per_split)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # PDL: the index math above ran while the previous kernel drained; x and the outputs wait
    pdl.wait_then_launch_dependents(PDL)
    for kw in range(kw_start, kw_end, BLOCK_KW):
        offs_kw = kw + tl.arange(0, BLOCK_KW)
        mask = (offs_kw < kw_end)[:, None] & n_mask[None, :]
        words = tl.load(w_ptr + offs_kw.to(tl.int64)[:, None] * N + offs_n[None, :], mask=mask,
                        other=0)  # [BLOCK_KW, BLOCK_N]
        group_ptrs = (offs_kw // group_words)[:, None] * N + offs_n[None, :]
        s = tl.load(scales_ptr + group_ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:  # 2^23 + z, as _field_values holds q
            z = tl.load(zeros_ptr + group_ptrs, mask=mask, other=0).to(tl.float32) + 8388608.0
        else:
            z = 8388608.0 + (1 << (BITS - 1))
        if ONE_DOT:
            acc = _dequant_dot_joined(words, s, z, acc, x_ptr, perm_ptr, offs_m, m_mask, kw,
                                      K, x_stride, BITS, HAS_ZEROS, HAS_PERM,
                                      FP32_IEEE, BLOCK_KW, BLOCK_N)
        else:
            acc = _dequant_dot(words, s, z, acc, x_ptr, perm_ptr, offs_m, m_mask, offs_kw, K,
                               x_stride, BITS, HAS_PERM, FP32_IEEE)
    write_tile(acc, acc, x_ptr, bias_ptr, bias_ptr, out_ptr, partial_ptr, pid_k, offs_m,
               offs_n, m_mask, n_mask, N, out_stride_m, partial_stride_split, partial_stride_m,
               HAS_BIAS, False, SPLIT_K, False)


def _check(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None) -> None:
    if x.dim() != 2 or x.shape[1] != weight.in_features or x.stride(1) != 1:
        raise ValueError(f"x {tuple(x.shape)} must be [M, {weight.in_features}] with a "
                         f"contiguous last dim")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x is {x.dtype}: bf16, fp16 or fp32")
    if weight.bits not in (4, 8) or not weight.qweight.is_contiguous():
        raise ValueError(f"{weight.bits}-bit weight: 4 or 8 bits, contiguous")
    if bias is not None and (bias.shape != (weight.out_features,) or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} must be contiguous [{weight.out_features}]")


def _split(num_words: int, config: IntGemmConfig) -> tuple[int, int]:
    """(words per split, number of splits): whole tiles per split, so the number may come out
    below config.split_k for a small K."""
    per_split = triton.cdiv(triton.cdiv(num_words, config.split_k), config.block_kw)
    words_per_split = per_split * config.block_kw
    return words_per_split, triton.cdiv(num_words, words_per_split)


def _stages(config: IntGemmConfig, x: torch.Tensor) -> int:
    """The config's pipeline depth, 2 with fp32 activations: their tiles (and the weights
    widened to fp32 for the IEEE dot) are twice bf16's, and 4 stages of 8-bit tiles asked
    for 233,472 bytes of shared memory on the H200 (its limit 232,448; 2026-12-02)."""
    return min(config.num_stages, 2) if x.dtype == torch.float32 else config.num_stages


def _launch(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None, out: torch.Tensor,
            config: IntGemmConfig, norm: tuple | None = None) -> None:
    """One launch writing out [M, N] (bias in), and the split reduce when K is split; with
    ``norm`` = (residual, norm_weight, eps) (K split only) the reduce adds each row to the
    residual, in place, and writes its RMSNorm to out instead."""
    m, k = x.shape
    n, num_words = weight.out_features, weight.qweight.shape[0]
    words_per_split, split_k = _split(num_words, config)
    partial = out
    if split_k > 1:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    group_words = (weight.group_size if weight.group_size > 0 else num_words * weight.per_word
                   ) // weight.per_word
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split_k)
    _int_gemm_kernel[grid](
        x, weight.qweight, weight.scales,
        weight.zeros if weight.zeros is not None else weight.qweight,
        weight.perm if weight.perm is not None else weight.qweight,
        bias if bias is not None else weight.scales, out, partial,
        m, n, k, x.stride(0), out.stride(0),
        partial.stride(0) if split_k > 1 else 0, partial.stride(1) if split_k > 1 else 0,
        words_per_split, num_words, group_words,
        BITS=weight.bits, HAS_ZEROS=weight.zeros is not None, HAS_PERM=weight.perm is not None,
        HAS_BIAS=bias is not None and split_k == 1, FP32_IEEE=x.dtype == torch.float32,
        SPLIT_K=split_k, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_KW=config.block_kw, GROUP_M=config.group_m, ONE_DOT=config.one_dot,
        num_warps=config.num_warps, num_stages=_stages(config, x), **pdl.launch_options(),
    )
    if split_k > 1 and norm is not None:
        residual, norm_weight, eps = norm
        split_reduce.reduce_splits_add_rms_norm(partial, bias, residual, norm_weight, out, eps)
    elif split_k > 1:
        split_reduce.reduce_splits(partial, bias, x, out)


def int_gemm(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None,
             config: IntGemmConfig | None = None, out: torch.Tensor | None = None,
             batch_invariant: bool = False) -> torch.Tensor:
    """x [M, K] (last dim contiguous) @ the packed weight -> [M, N] in x's dtype (``out``: x's
    dtype or fp32, the values rounded to x's dtype). ``config``: the launch (default: the
    decode launch up to DECODE_MAX_M rows, else the prefill one). ``batch_invariant``: the
    decode launch at any M (tiles of 16 rows; a row's sums then never depend on the others)."""
    _check(x, weight, bias)
    m = x.shape[0]
    n, k = weight.shape
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} or float32, last dim contiguous")
    if m == 0 or n == 0:
        return out
    if config is None:
        config = (decode_config(weight.bits, n, k) if m <= DECODE_MAX_M or batch_invariant
                  else prefill_config(weight.bits, m, n, k))
    _launch(x, weight, bias, out, config)
    return out


def serves_add_rms_norm(num_rows: int, weight: IntWeight, residual: torch.Tensor,
                        norm_weight: torch.Tensor) -> bool:
    """Whether ``int_gemm_add_rms_norm`` takes num_rows: the decode launch splits K there, a
    row the norm holds in registers, one dtype and device."""
    n, k = weight.shape
    config = decode_config(weight.bits, n, k)
    return (weight.qweight.is_cuda and 0 < num_rows <= DECODE_MAX_M
            and _split(weight.qweight.shape[0], config)[1] > 1 and n <= MAX_SINGLE_PASS
            and residual.shape == (num_rows, n) and residual.stride(1) == 1
            and residual.dtype in (torch.bfloat16, torch.float16)
            and norm_weight.shape == (n,) and norm_weight.is_contiguous()
            and residual.dtype == norm_weight.dtype
            and residual.device == norm_weight.device == weight.qweight.device)


def int_gemm_add_rms_norm(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None,
                          residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          config: IntGemmConfig | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(int_gemm(x, weight, bias), norm_weight, eps, residual)`` with the add and the
    norm in the split-K reduce, bitwise the same: x [M, K], residual [M, N] (``residual += y``
    in place), norm_weight [N], all of x's dtype -> (normed [M, N], residual). ``config``
    (default: the decode launch) must split K."""
    _check(x, weight, bias)
    m = x.shape[0]
    n, k = weight.shape
    config = config or decode_config(weight.bits, n, k)
    if _split(weight.qweight.shape[0], config)[1] < 2 or n > MAX_SINGLE_PASS:
        raise ValueError(f"the norm runs in the split reduce: {config} does not split K = {k} "
                         f"or {n} columns are more than one pass holds")
    if residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != x.dtype:
        raise ValueError(f"residual must be [{m}, {n}] {x.dtype} with a contiguous last dim")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m > 0:
        _launch(x, weight, bias, out, config, norm=(residual, norm_weight, eps))
    return out, residual


def int_gemm_decode(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The decode launch (``decode_config``) at any M."""
    n, k = weight.shape
    return int_gemm(x, weight, bias, decode_config(weight.bits, n, k))


def int_gemm_prefill(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The prefill launch (``prefill_config``) at any M."""
    n, k = weight.shape
    return int_gemm(x, weight, bias, prefill_config(weight.bits, x.shape[0], n, k))
