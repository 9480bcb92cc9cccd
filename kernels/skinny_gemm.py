"""Skinny GEMM for decode-sized batches: ``y[M, N] = x[M, K] @ W[N, K]^T (+ bias)`` (Triton).

At batch 1..16 a projection is a matrix-vector product: every weight byte is read once and used
for at most 16 rows, so the time is the weight's bytes over memory bandwidth, plus the ramp and
tail of one launch. This kernel is a plain weight stream.

- W is row-major ``[N, K]`` as ``nn.Linear`` stores it; x ``[M, K]`` with a contiguous last dim.
  bf16, fp16 or fp32 in, fp32 accumulation, the output in x's dtype (as F.linear).
- one program per ``BLOCK_N`` output columns (and per K split): it walks K in ``BLOCK_K`` tiles,
  a ``[BLOCK_N, BLOCK_K]`` weight tile and x padded to 16 rows (masked loads: the pad costs no
  memory traffic), multiplied on the tensor cores (``tl.dot``; fp32 in ieee precision, not tf32).
  (A version on the FMA units, one row of x at a time, lost to this at every shape on the H200,
  and so did programmatic dependent launch with an L2 prefetch of the first weight tiles.)
- **batch invariant and deterministic**: a row's result depends only on that row. The launch
  config is chosen per (N, K) alone, never per M, and M is no constexpr nor specialized on:
  every M runs the same compiled kernel, and a tensor-core product computes each output from its
  own row and column. More than 16 rows run as tiles of 16 (one program per row tile and
  column tile, the row tiles of a column tile side by side: its weight tile is read from
  memory once and from L2 after), each row summed as it is alone: what ``--batch-invariant``
  (services/worker/ops.py) runs every projection of every step with. With ``split_k`` > 1
  each split writes an fp32 partial and kernels/split_reduce.py adds them in split order;
  no atomics anywhere. (Reducing in the
  same launch, by the last program of each column tile to arrive at a counter, was tried: on
  the H200 it cost o_proj 0.3 us more than the second launch saved and a decode step 0.05 ms.)
- ``skinny_gemm_silu_and_mul``: the gate_up projection with SwiGLU in its epilogue (a program
  takes the gate rows of its columns and the matching up rows), rounded as the two kernels
  round it: one launch instead of two.
- ``skinny_gemm_add_rms_norm``: a projection with K split (o_proj, down) followed by the
  decoder's residual add and RMSNorm: its reduce takes one program per row, adds the row to
  the residual and normalizes it with kernels/rms_norm.py's code, launched as that kernel
  launches a row, so the result is bitwise the two ops' and the norm's own launch goes. The
  worker takes it wherever ``serves_add_rms_norm`` holds (on one H200, batch-1 decode of
  Llama-3.1-8B 4.62 -> 4.55 ms/token in two alternating pairs).
- FP8 weights (``--quantization fp8``, kernels/fp8.py): each tile is read as FP8 and widened to
  fp16 for the product (``fp16_dot``; with fp16 or fp32 x, to x's dtype), and a column's sum
  is multiplied by its weight scale: half the bytes a decode step streams, x unrounded.
- LoRA (``lora``, a kernels/lora_delta.py ``LoraDelta``): where the adapter plan says
  ``beside``, the LoRA shrink's programs (kernels/lora.py) follow the GEMM's in the grid of the
  same launch, so y is ready with the GEMM's output and only the expand follows; on the H200
  that beat the two LoRA launches after the GEMM for qkv, o_proj and gate_up (under a register
  cap) at decode sizes (docs/lora.md). ``skinny_gemm_lora_silu_and_mul``: gate_up with the
  deltas, its SwiGLU in the expand's launch.
- the kernel's steps on a tile are device functions in kernels/skinny_tiles.py.
- CUDA-graph capturable: the grid and the scratch depend on shapes only.
- with PDL on (kernels/pdl.py), each launch (the reduce's too) is a programmatic dependent
  launch: a program loads its first weight tile, then waits for the previous kernel, so in a
  decode step the stream starts while the kernel before it drains (the prefetch above was
  measured between back-to-back GEMMs only).

kernels/skinny_configs.py holds the launch configs swept on the H200 per shape and dtype, and
per shape the most rows at which each was measured faster than the alternative; the worker
uses it only there (``serves``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl, split_reduce
from kernels.fp8 import FP8_DTYPE, dequantize_per_channel
from kernels.lora import lora_shrink, shrink_program
from kernels.lora_delta import LoraDelta, ShrinkBeside
from kernels.rms_norm import MAX_SINGLE_PASS
from kernels.skinny_tiles import (first_tile_then_wait, row_and_column_tile, tile_dot,
                                  tile_masks, write_tile)
from kernels.skinny_configs import (CONFIGS, FP8_CONFIGS, FP8_GATED_CONFIGS,  # noqa: F401
                                    GATED_CONFIGS, SkinnyConfig, config_for, default_config,
                                    gated_config_for, gated_table, table)

MAX_M = 16  # rows of x a program multiplies (x padded to a multiple of this many)


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel can run a weight at all (any number of rows): a contiguous CUDA
    bf16/fp16 or FP8 one. What ``--batch-invariant`` runs every projection with."""
    return (weight.is_cuda and weight.dtype in (torch.bfloat16, torch.float16, FP8_DTYPE)
            and weight.is_contiguous())


def serves(num_rows: int, weight: torch.Tensor) -> bool:
    """Whether the worker should use the skinny GEMM: a CUDA bf16/fp16 or FP8 weight of a
    swept shape, at most its ``max_m`` rows (where it beat cuBLAS, or for FP8 the scaled FP8
    GEMM, on the H200)."""
    return _serves(num_rows, weight, table(weight.dtype))


def _serves(num_rows: int, weight: torch.Tensor, configs: dict) -> bool:
    if not takes(weight):
        return False
    config = configs.get(tuple(weight.shape))
    return config is not None and 0 < num_rows <= config.max_m


@triton.jit
def _gemm_program(
    x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, partial_ptr, pid0,
    M, N, K, x_stride, w_stride, up_offset, out_stride_m, partial_stride_split,
    partial_stride_m, k_per_split,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    FP32_IEEE: tl.constexpr, FP16_DOT: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):
    """The GEMM's program (column tile, K split) of index pid0 along the grid's first axis."""
    pid_m, pid_n = row_and_column_tile(pid0, M, BLOCK_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    k_start = pid_k * k_per_split
    k_end = tl.minimum(K, k_start + k_per_split)
    # [BLOCK_N, BLOCK_K] weight tile (and, gated, the up rows N further on) and
    # [BLOCK_M, BLOCK_K] rows of x, K contiguous
    w_ptrs = w_ptr + offs_n.to(tl.int64)[:, None] * w_stride + (k_start + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[:, None] * x_stride + (k_start + offs_k)[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_loop = k_start
    if PDL:
        acc, acc_up = first_tile_then_wait(w_ptrs, x_ptrs, up_offset, k_start, offs_k, k_end,
                                            m_mask, n_mask, acc, acc_up, EVEN_K, FP32_IEEE,
                                            FP16_DOT, GATED, PDL)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
        k_loop += BLOCK_K
    for k in range(k_loop, k_end, BLOCK_K):
        w_mask, x_mask = tile_masks(k, offs_k, k_end, m_mask, n_mask, EVEN_K)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        w = tl.load(w_ptrs, mask=w_mask, other=0.0)
        acc = tile_dot(x, w, acc, FP32_IEEE, FP16_DOT)
        if GATED:
            w_up = tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0)
            acc_up = tile_dot(x, w_up, acc_up, FP32_IEEE, FP16_DOT)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    write_tile(acc, acc_up, x_ptr, bias_ptr, scale_ptr, out_ptr, partial_ptr, pid_k, offs_m,
                offs_n, m_mask, n_mask, N, out_stride_m, partial_stride_split, partial_stride_m,
                HAS_BIAS, HAS_SCALE, SPLIT_K, GATED)


# one compiled kernel for every M (batch invariance), and for every LoRA step
@triton.jit(do_not_specialize=["M", "lora_split_len", "lora_max_pairs", "y_stride_split",
                               "lora_programs", "gemm_columns"])
def _skinny_gemm_kernel(
    x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, partial_ptr,
    M, N, K, x_stride, w_stride, up_offset, out_stride_m, partial_stride_split,
    partial_stride_m, k_per_split,
    a_ptr, lora_rows_ptr, y_ptr, lora_width, lora_split_len, lora_max_pairs, a_stride_slot,
    y_stride_split, lora_splits, lora_programs, gemm_columns,
    HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN_K: tl.constexpr,
    FP32_IEEE: tl.constexpr, FP16_DOT: tl.constexpr, SPLIT_K: tl.constexpr,
    GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, LORA: tl.constexpr, LORA_BLOCK_M: tl.constexpr,
    LORA_BLOCK_W: tl.constexpr, LORA_BLOCK_K: tl.constexpr, LORA_STAGES: tl.constexpr,
    WIDEN: tl.constexpr, PDL: tl.constexpr,
):
    """Program (column tile, K split): ``_gemm_program``. GATED: W holds 2N rows (gate, then
    up), out silu(gate) * up. HAS_SCALE: W is FP8, each row's sum times its scale
    (kernels/fp8.py). PDL: it waits for the previous kernel after its first weight tile
    (kernels/pdl.py). LORA: the grid's columns past the GEMM's ``gemm_columns`` are the LoRA
    shrink's programs (kernels/lora.py ``shrink_program``, ``lora_programs`` of them over
    ``lora_splits`` splits of K; the rest only wait): y = x @ a[slot]^T runs beside the GEMM,
    not after it."""
    pid0 = tl.program_id(0)
    if LORA and pid0 >= gemm_columns:
        flat = (pid0 - gemm_columns) * SPLIT_K + tl.program_id(1)
        # (a program past the shrink's finds no rows: its tile starts past the buffer)
        tile = tl.where(flat < lora_programs, flat // lora_splits, lora_max_pairs)
        shrink_program(x_ptr, a_ptr, lora_rows_ptr, y_ptr, K, lora_width, lora_split_len,
                       lora_max_pairs, x_stride, a_stride_slot, y_stride_split, tile,
                       flat % lora_splits, FP32_IEEE, WIDEN, LORA_BLOCK_M, LORA_BLOCK_W,
                       LORA_BLOCK_K, LORA_STAGES, PDL)
    else:
        _gemm_program(x_ptr, w_ptr, bias_ptr, scale_ptr, out_ptr, partial_ptr, pid0, M, N, K,
                      x_stride, w_stride, up_offset, out_stride_m, partial_stride_split,
                      partial_stride_m, k_per_split, HAS_BIAS, HAS_SCALE, EVEN_K, FP32_IEEE,
                      FP16_DOT, SPLIT_K, GATED, BLOCK_M, BLOCK_N, BLOCK_K, PDL)


def _check_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    weight_scale: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not match")
    if x.stride(1) != 1 or not weight.is_contiguous():
        raise ValueError("x needs a contiguous last dim and weight must be contiguous")
    if weight_scale is not None:
        if weight.dtype != FP8_DTYPE or not x.dtype.is_floating_point or x.element_size() < 2:
            raise ValueError(f"a weight scale goes with an FP8 weight and bf16/fp16/fp32 x, "
                             f"not {weight.dtype} and {x.dtype}")
        if (weight_scale.shape != weight.shape[:1] or weight_scale.dtype != torch.float32
                or not weight_scale.is_contiguous()):
            raise ValueError(f"weight_scale must be contiguous [{weight.shape[0]}] fp32")
    elif x.dtype != weight.dtype:
        raise ValueError(f"x is {x.dtype}, weight {weight.dtype}")
    if bias is not None and (bias.shape != weight.shape[:1] or not bias.is_contiguous()):
        raise ValueError(f"bias {tuple(bias.shape)} must be contiguous [{weight.shape[0]}]")


def _split(k: int, config: SkinnyConfig) -> tuple[int, int]:
    """(K per split, number of splits): whole BLOCK_K tiles per split, so the number may come
    out below config.split_k for a small K."""
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), config.block_k) * config.block_k
    return k_per_split, triton.cdiv(k, k_per_split)


def _lora_args(x: torch.Tensor, lora: LoraDelta | None, split_k: int, gemm_columns: int
               ) -> tuple[ShrinkBeside | None, int, tuple, dict]:
    """(the shrink's outputs or None, grid columns it takes, its runtime arguments and its
    constexprs) for the GEMM's launch; without LoRA, placeholders of its dtypes."""
    if lora is None:
        return None, 0, (x, x, x, 0, 0, 0, 0, 0, 1, 0, gemm_columns), dict(
            LORA=False, LORA_BLOCK_M=16, LORA_BLOCK_W=16, LORA_BLOCK_K=16, LORA_STAGES=1,
            WIDEN=False)
    shrink = lora.beside(x)
    columns = triton.cdiv(shrink.num_programs, split_k)
    args = (lora.a, lora.lora_rows, shrink.y, lora.a.shape[1], shrink.split_len,
            (lora.lora_rows.numel() - 1) // 2, lora.a.stride(0), shrink.y.stride(0),
            shrink.num_splits, shrink.num_programs, gemm_columns)
    return shrink, columns, args, dict(
        LORA=True, LORA_BLOCK_M=shrink.block_m, LORA_BLOCK_W=shrink.block_w,
        LORA_BLOCK_K=shrink.block_k, LORA_STAGES=shrink.num_stages,
        WIDEN=x.device.type == "cpu" and x.dtype == torch.bfloat16)


def _launch_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                 weight_scale: torch.Tensor | None, out: torch.Tensor | None,
                 config: SkinnyConfig, gated: bool, lora: LoraDelta | None = None
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The GEMM launch alone -> (partial, y). partial: when K is split, the fp32 partials
    [split_k, M, N] with the bias not added (``out`` [M, N], which may then be None, is not
    written); else None, out written (bias in). y: with ``lora``, its shrink's partial sums,
    run by programs of the same launch (``lora.expand`` adds the deltas), else None."""
    m, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    k_per_split, split_k = _split(k, config)
    num_tiles = triton.cdiv(n, config.block_n)
    partial = out  # unused without a split
    if split_k > 1:
        partial = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    if out is None:
        if split_k == 1:
            raise ValueError(f"{config} does not split K = {k}: the GEMM needs an out")
        out = x  # a pointer of x's dtype, never written: split launches write the partials
    gemm_columns = num_tiles * triton.cdiv(m, MAX_M)
    shrink, lora_columns, lora_args, lora_constexprs = _lora_args(x, lora, split_k,
                                                                  gemm_columns)
    _skinny_gemm_kernel[(lora_columns + gemm_columns, split_k)](
        x, weight, bias if bias is not None else weight,
        weight_scale if weight_scale is not None else weight, out, partial,
        m, n, k, x.stride(0), weight.stride(0), n * weight.stride(0) if gated else 0,
        out.stride(0),
        partial.stride(0) if split_k > 1 else 0, partial.stride(1) if split_k > 1 else 0,
        k_per_split, *lora_args,
        HAS_BIAS=bias is not None and split_k == 1, HAS_SCALE=weight_scale is not None,
        EVEN_K=k % config.block_k == 0,
        FP32_IEEE=x.dtype == torch.float32,
        FP16_DOT=weight.dtype == FP8_DTYPE and x.dtype == torch.bfloat16,
        SPLIT_K=split_k, GATED=gated, BLOCK_M=MAX_M,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, **lora_constexprs,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options(),
        **({"maxnreg": shrink.max_registers} if shrink is not None and shrink.max_registers
           and x.is_cuda else {}),
    )
    return (partial if split_k > 1 else None), (shrink.y if shrink is not None else None)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            weight_scale: torch.Tensor | None, out: torch.Tensor, config: SkinnyConfig,
            gated: bool, norm: tuple | None = None, lora: LoraDelta | None = None) -> None:
    """One launch writing out [M, N] (N = weight rows, or half of them when gated), and the
    reduce when K is split; ``weight_scale`` [weight rows] with an FP8 weight. With ``norm`` =
    (residual, norm_weight, eps) (split K only) the reduce adds each row to the residual, in
    place, and writes its RMSNorm to out instead. With ``lora`` its deltas are added: into
    out, or with ``norm`` into the residual before the reduce (the shrink in the GEMM's
    launch where its plan has ``beside``, the expand after it; else the two LoRA launches
    after the GEMM, or with ``norm`` before it)."""
    beside = lora if lora is not None and lora.plan.beside else None
    if lora is not None and beside is None and norm is not None:
        lora.add(x, norm[0])
    partial, y = _launch_gemm(x, weight, bias, weight_scale, out, config, gated, beside)
    split_k = partial.shape[0] if partial is not None else 1
    if split_k > 1 and norm is not None:
        residual, norm_weight, eps = norm
        if beside is not None:
            beside.expand(y, residual)
        split_reduce.reduce_splits_add_rms_norm(partial, bias, residual, norm_weight, out, eps)
        return
    if split_k > 1:
        split_reduce.reduce_splits(partial, bias, x, out)
    if beside is not None:
        beside.expand(y, out)
    elif lora is not None:
        lora.add(x, out)


def skinny_gemm_partials(x: torch.Tensor, weight: torch.Tensor,
                         weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ weight [N, K]^T as ``config_for(N, K)``'s splits of K leave it: fp32
    partials [split_k, M, N], no bias, for a reduce elsewhere (kernels/all_reduce_rms_norm.py;
    ``splits_k(num_rows, weight)`` must hold)."""
    _check_operands(x, weight, None, weight_scale)
    n, k = weight.shape
    return _launch_gemm(x, weight, None, weight_scale, None, config_for(n, k, weight.dtype),
                        gated=False)[0]


def splits_k(num_rows: int, weight: torch.Tensor) -> bool:
    """Whether the worker runs num_rows of this weight on the skinny GEMM with K split."""
    n, k = weight.shape
    return serves(num_rows, weight) and _split(k, config_for(n, k, weight.dtype))[1] > 1


def serves_add_rms_norm(num_rows: int, weight: torch.Tensor, residual: torch.Tensor,
                        norm_weight: torch.Tensor) -> bool:
    """Whether the worker should run a projection, its residual add and the RMSNorm after it
    as ``skinny_gemm_add_rms_norm``: a shape and row count ``serves`` takes whose config
    splits K, a row the norm holds in registers, one dtype and device."""
    if not serves(num_rows, weight):
        return False
    n, k = weight.shape
    return (_split(k, config_for(n, k, weight.dtype))[1] > 1 and n <= MAX_SINGLE_PASS
            and residual.shape == (num_rows, n) and residual.stride(1) == 1
            and norm_weight.shape == (n,) and norm_weight.is_contiguous()
            and residual.dtype == norm_weight.dtype
            and weight.dtype in (residual.dtype, FP8_DTYPE)
            and residual.device == norm_weight.device == weight.device)


def serves_gated(num_rows: int, weight: torch.Tensor) -> bool:
    """``serves`` for the fused gate_up + SwiGLU launch (``GATED_CONFIGS``, or
    ``FP8_GATED_CONFIGS`` for an FP8 weight)."""
    return _serves(num_rows, weight, gated_table(weight.dtype))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                config: SkinnyConfig | None = None, out: torch.Tensor | None = None,
                weight_scale: torch.Tensor | None = None, lora: LoraDelta | None = None
                ) -> torch.Tensor:
    """x: [M, K] (last dim contiguous; any M, in tiles of MAX_M rows), weight: [N, K]
    contiguous, bias: [N] or None -> [M, N] in x's dtype. ``config``: the launch (default:
    ``config_for(N, K)``). An FP8 weight comes with ``weight_scale`` [N] fp32 (per output
    channel, kernels/fp8.py). ``out`` may be fp32 for bf16/fp16 x: the values rounded to x's
    dtype, stored widened (logits straight into an fp32 buffer, no conversion launch).
    ``lora``: the step's adapter deltas added (its shrink inside this launch); out in x's
    dtype then."""
    _check_operands(x, weight, bias, weight_scale)
    m, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    elif out.shape != (m, n) or out.stride(1) != 1 or out.dtype not in (x.dtype, torch.float32):
        raise ValueError(f"out must be [{m}, {n}] {x.dtype} or float32 with a contiguous "
                         "last dim")
    if m == 0 or n == 0:
        return out
    if k == 0:
        out = out.zero_() if bias is None else out.copy_(bias.expand(m, n))
        return out if lora is None else lora.add(x, out)
    _launch(x, weight, bias, weight_scale, out, config or config_for(n, k, weight.dtype),
            gated=False, lora=lora)
    return out


def skinny_gemm_add_rms_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             config: SkinnyConfig | None = None,
                             weight_scale: torch.Tensor | None = None,
                             lora: LoraDelta | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """``rms_norm(skinny_gemm(x, weight, bias), norm_weight, eps, residual)`` with the add and the
    norm in the split-K reduce, bitwise the same: x [M, K], weight [N, K], residual [M, N]
    (last dim contiguous; ``residual += y`` in place), norm_weight [N], all of x's dtype ->
    (normed [M, N], residual). ``config`` (default ``config_for(N, K)``) must split K and N be
    at most kernels/rms_norm.py's MAX_SINGLE_PASS. An FP8 weight comes with ``weight_scale``.
    ``lora``: the step's adapter deltas go into the residual before the reduce."""
    _check_operands(x, weight, bias, weight_scale)
    m, k = x.shape
    n = weight.shape[0]
    config = config or config_for(n, k, weight.dtype)
    if k == 0 or _split(k, config)[1] < 2:
        raise ValueError(f"the norm runs in the split reduce: {config} does not split K = {k}")
    if n > MAX_SINGLE_PASS:
        raise ValueError(f"{n} columns: the norm holds at most {MAX_SINGLE_PASS} in one pass")
    if residual.shape != (m, n) or residual.stride(1) != 1 or residual.dtype != x.dtype:
        raise ValueError(f"residual must be [{m}, {n}] {x.dtype} with a contiguous last dim")
    if (norm_weight.shape != (n,) or not norm_weight.is_contiguous()
            or norm_weight.dtype != x.dtype):
        raise ValueError(f"norm_weight must be contiguous [{n}] {x.dtype}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m > 0 and n > 0:
        _launch(x, weight, bias, weight_scale, out, config, gated=False,
                norm=(residual, norm_weight, eps), lora=lora)
    return out, residual


def skinny_gemm_silu_and_mul(x: torch.Tensor, weight: torch.Tensor,
                             bias: torch.Tensor | None = None,
                             config: SkinnyConfig | None = None,
                             weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of a fused gate_up projection in one launch: x [M, K], weight [2 * d, K] (gate
    rows then up rows), bias [2 * d] or None -> [M, d] = silu(gate) * up, rounded as
    ``silu_and_mul(skinny_gemm(x, weight, bias))`` rounds it (bitwise the same).
    ``config``: its block_n counts output columns (default: ``gated_config_for(2 * d, K)``).
    An FP8 weight comes with ``weight_scale`` [2 * d]."""
    _check_operands(x, weight, bias, weight_scale)
    m, k = x.shape
    d = weight.shape[0] // 2
    if weight.shape[0] != 2 * d or k == 0:
        raise ValueError(f"weight {tuple(weight.shape)}: needs an even number of rows and K > 0")
    config = config or gated_config_for(2 * d, k, weight.dtype)
    if config.split_k != 1:
        raise ValueError("the gated GEMM does not split K")
    out = torch.empty(m, d, dtype=x.dtype, device=x.device)
    if m > 0 and d > 0:
        _launch(x, weight, bias, weight_scale, out, config, gated=True)
    return out


def skinny_gemm_lora_silu_and_mul(x: torch.Tensor, weight: torch.Tensor,
                                  bias: torch.Tensor | None, lora: LoraDelta,
                                  weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """SwiGLU of a gate_up projection with a step's adapter deltas (``lora``), at most
    kernels/lora.py's EXPAND_SILU_MAX_ROWS rows: the projection on the plain launch (the
    shrink beside it where its plan says so, else after it), then the expand and SwiGLU in one
    launch -> [M, d]: ``silu_and_mul(skinny_gemm(x, weight, bias, lora=lora))``."""
    _check_operands(x, weight, bias, weight_scale)
    m, k = x.shape
    n = weight.shape[0]
    config = config_for(n, k, weight.dtype)
    gate_up = torch.empty(m, n, dtype=x.dtype, device=x.device)
    beside = lora if lora.plan.beside else None
    partial, y = _launch_gemm(x, weight, bias, weight_scale, gate_up, config, False, beside)
    if partial is not None:
        split_reduce.reduce_splits(partial, bias, x, gate_up)
    if beside is None:
        y = lora_shrink(x, lora.a, lora.lora_rows, lora.plan.shrink)
    return lora.expand_silu_and_mul(y, gate_up)


def skinny_gemm_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                    weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch: F.linear in fp32 (an FP8 weight dequantized), rounded to x's dtype."""
    weight = (weight.float() if weight_scale is None
              else dequantize_per_channel(weight, weight_scale))
    return F.linear(x.float(), weight, None if bias is None else bias.float()).to(x.dtype)
