"""The split-K reduce of kernels/skinny_gemm.py: a split GEMM's fp32 partials [split_k, M, N]
added in split order (deterministic, batch invariant) plus the bias and rounded to the
projection's dtype, alone or followed by the decoder's residual add and RMSNorm (one program
a row, with kernels/rms_norm.py's own code, so the result is bitwise the two ops'). Tensor
parallelism's tail (kernels/all_reduce_rms_norm.py) sums this rank's splits with the same
``sum_splits``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.rms_norm import add_rms_norm_row, single_pass_launch


@triton.jit
def store_rounded(ptrs, acc, x_ptr, out_ptr, mask):
    """fp32 sums rounded to x's dtype (as F.linear), stored in out's (fp32 logits: exactly
    those values, no conversion launch after)."""
    tl.store(ptrs, acc.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def sum_splits(partial_ptr, bias_ptr, row, cols, mask, partial_stride_split, partial_stride_m,
               HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr):
    """Row ``row``'s columns ``cols`` of the split-K partials summed (fp32), plus the bias."""
    ptrs = partial_ptr + row * partial_stride_m + cols
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for split in tl.static_range(1, SPLIT_K):  # in split order: deterministic
        acc += tl.load(ptrs + split * partial_stride_split, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return acc


@triton.jit
def _reduce_splits_kernel(
    partial_ptr, bias_ptr, x_ptr, out_ptr, N, partial_stride_split, partial_stride_m,
    out_stride_m,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """Program (row, column block): the splits added in split order, rounded to x's dtype
    (``x_ptr`` is only read for its dtype), stored in out's."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    pdl.wait_then_launch_dependents(PDL)
    acc = sum_splits(partial_ptr, bias_ptr, row, cols, mask, partial_stride_split,
                     partial_stride_m, HAS_BIAS, SPLIT_K)
    store_rounded(out_ptr + row * out_stride_m + cols, acc, x_ptr, out_ptr, mask)


@triton.jit
def _reduce_splits_add_rms_norm_kernel(
    partial_ptr, bias_ptr, residual_ptr, norm_weight_ptr, out_ptr, N, eps,
    partial_stride_split, partial_stride_m, residual_stride_m, out_stride_m,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    """One program per row: the splits added in split order and rounded to the projection's
    dtype (as ``_reduce_splits_kernel`` stores them), then that row added to the residual (in
    place) and normalized by kernels/rms_norm.py's own single-pass code into out."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    pdl.wait_then_launch_dependents(PDL)
    acc = sum_splits(partial_ptr, bias_ptr, row, cols, mask, partial_stride_split,
                     partial_stride_m, HAS_BIAS, SPLIT_K)
    dtype = out_ptr.dtype.element_ty  # the projection's (and the norm's) dtype
    add_rms_norm_row(acc.to(dtype).to(tl.float32), residual_ptr + row * residual_stride_m,
                     norm_weight_ptr, out_ptr + row * out_stride_m, cols, mask, N, eps,
                     True, dtype)


def reduce_splits(partial: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor,
                  out: torch.Tensor) -> None:
    """out [M, N] = the partials [split_k, M, N] summed plus bias [N], rounded to x's dtype
    (x is only read for its dtype) and stored in out's."""
    _, m, n = partial.shape
    block = min(1024, triton.next_power_of_2(n))
    _reduce_splits_kernel[(m, triton.cdiv(n, block))](
        partial, bias if bias is not None else x, x, out, n, partial.stride(0),
        partial.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=partial.shape[0], BLOCK=block, num_warps=4,
        **pdl.launch_options(),
    )


def reduce_splits_add_rms_norm(partial: torch.Tensor, bias: torch.Tensor | None,
                               residual: torch.Tensor, norm_weight: torch.Tensor,
                               out: torch.Tensor, eps: float) -> None:
    """The reduce, then residual [M, N] += the row (in place) and out [M, N] = its RMSNorm."""
    _, m, n = partial.shape
    block, num_warps = single_pass_launch(n)  # as kernels/rms_norm.py launches a row
    _reduce_splits_add_rms_norm_kernel[(m,)](
        partial, bias if bias is not None else norm_weight, residual, norm_weight, out, n, eps,
        partial.stride(0), partial.stride(1), residual.stride(0), out.stride(0),
        HAS_BIAS=bias is not None, SPLIT_K=partial.shape[0], BLOCK=block, num_warps=num_warps,
        **pdl.launch_options(),
    )
