"""RMSNorm, optionally fused with the residual add before it (Triton).

Numerics follow Hugging Face's Llama RMSNorm exactly: normalize in fp32
(``x * rsqrt(mean(x^2) + eps)``), cast to the input dtype, THEN multiply by the weight (in the
promoted dtype of weight and input, as ``weight * normed`` does in torch). With a residual, the
sum ``x + residual`` is rounded to the input dtype first, as the decoder's ``x = x + attn(x)`` does.

Rows are normalized over the last dim; any leading shape works, so the same kernel serves the
per-head q/k norm of Qwen3 on ``[num_tokens, num_heads, head_dim]`` (also a strided view split
from a fused qkv output). One program per row: a row of up to ``MAX_SINGLE_PASS`` elements is
held in registers; longer rows take two passes over ``LOOP_BLOCK``-sized chunks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

MAX_SINGLE_PASS = 8192  # longest row normalized from registers in one pass
LOOP_BLOCK = 4096  # chunk of the two-pass loop for longer rows


@triton.jit
def add_rms_norm_row(x, residual_row, weight_ptr, out_row, cols, mask, hidden_size, eps,
                     HAS_RESIDUAL: tl.constexpr, X_DTYPE: tl.constexpr):
    """The single-pass norm of one row held in registers: x [BLOCK_SIZE] fp32 (values of
    ``X_DTYPE``, the norm's input dtype), masked past hidden_size; with HAS_RESIDUAL, the sum
    x + residual is rounded to the residual's dtype and written back first. Also the tail of
    kernels/skinny_gemm.py's split reduce, so that path rounds bitwise as this kernel: launch
    both with ``single_pass_launch``'s block and warps (the sum of squares' order follows them)."""
    if HAS_RESIDUAL:
        r = tl.load(residual_row + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + r).to(residual_row.dtype.element_ty)
        tl.store(residual_row + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / hidden_size + eps)
    normed = (x * rstd).to(X_DTYPE)  # HF: cast before the weight multiply
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = weight.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_row + cols, out.to(out_row.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, residual_ptr, out_ptr,
    x_stride_0, x_stride_1, residual_stride_0, residual_stride_1, out_stride_0, out_stride_1,
    hidden_size, eps,
    HAS_RESIDUAL: tl.constexpr, SINGLE_PASS: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    # rows are [dim 0, dim 1] of a [num_outer, num_inner, hidden_size] view
    outer = tl.program_id(0).to(tl.int64)
    inner = tl.program_id(1).to(tl.int64)
    x_row = x_ptr + outer * x_stride_0 + inner * x_stride_1
    residual_row = residual_ptr + outer * residual_stride_0 + inner * residual_stride_1
    out_row = out_ptr + outer * out_stride_0 + inner * out_stride_1
    cols = tl.arange(0, BLOCK_SIZE)
    pdl.wait_then_launch_dependents(PDL)
    if SINGLE_PASS:
        mask = cols < hidden_size
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        add_rms_norm_row(x, residual_row, weight_ptr, out_row, cols, mask, hidden_size, eps,
                         HAS_RESIDUAL, x_ptr.dtype.element_ty)
    else:
        # pass 1: the residual sum (written back) and the sum of squares
        sum_squares = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
        for start in range(0, hidden_size, BLOCK_SIZE):
            mask = start + cols < hidden_size
            x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                r = tl.load(residual_row + start + cols, mask=mask, other=0.0).to(tl.float32)
                summed = (x + r).to(residual_ptr.dtype.element_ty)
                tl.store(residual_row + start + cols, summed, mask=mask)
                x = summed.to(tl.float32)
            sum_squares += x * x
        rstd = tl.rsqrt(tl.sum(sum_squares, axis=0) / hidden_size + eps)
        tl.debug_barrier()  # pass 2 reads back the residual sums pass 1 wrote
        for start in range(0, hidden_size, BLOCK_SIZE):
            mask = start + cols < hidden_size
            if HAS_RESIDUAL:
                x = tl.load(residual_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
            normed = (x * rstd).to(x_ptr.dtype.element_ty)
            weight = tl.load(weight_ptr + start + cols, mask=mask, other=0.0)
            out = weight.to(tl.float32) * normed.to(tl.float32)
            tl.store(out_row + start + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _num_warps(block_size: int) -> int:
    return min(max(block_size // 256, 1), 16)


def single_pass_launch(hidden_size: int) -> tuple[int, int]:
    """(BLOCK_SIZE, num_warps) of a single-pass row (hidden_size <= MAX_SINGLE_PASS)."""
    block_size = triton.next_power_of_2(hidden_size)
    return block_size, _num_warps(block_size)


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """A view [num_outer, num_inner, hidden_size] of t with a contiguous last dim (never a copy)."""
    if t.stride(-1) != 1 and t.shape[-1] > 1:
        raise ValueError(f"{name}: the last dim must be contiguous (strides {t.stride()})")
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.view(-1, *t.shape[-2:])  # raises when the leading dims cannot be merged in a view


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, out: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim, optionally after adding a residual.

    x: [..., hidden_size] (last dim contiguous; e.g. [num_tokens, hidden_size] or
    [num_tokens, num_heads, head_dim] for a per-head q/k norm)
    weight: [hidden_size]
    residual: None, or like x: then ``residual = x + residual`` is written in place and the
    result is ``(rms_norm(residual), residual)``
    out: optional output like x (may be x itself: in place); dtype of weight * x
    returns: [..., hidden_size], or (normed, residual)
    """
    hidden_size = x.shape[-1]
    if weight.shape != (hidden_size,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {hidden_size}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype),
                          device=x.device)
    elif out.shape != x.shape:
        raise ValueError(f"out {tuple(out.shape)} does not match x {tuple(x.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x "
                         f"{tuple(x.shape)} {x.dtype}")
    x_rows, out_rows = _rows(x, "x"), _rows(out, "out")
    residual_rows = x_rows if residual is None else _rows(residual, "residual")
    num_outer, num_inner = x_rows.shape[:2]
    if x.numel() > 0:
        single_pass = hidden_size <= MAX_SINGLE_PASS
        if single_pass:
            block_size, num_warps = single_pass_launch(hidden_size)
        else:
            block_size, num_warps = LOOP_BLOCK, _num_warps(LOOP_BLOCK)
        _rms_norm_kernel[(num_outer, num_inner)](
            x_rows, weight, residual_rows, out_rows,
            x_rows.stride(0), x_rows.stride(1), residual_rows.stride(0), residual_rows.stride(1),
            out_rows.stride(0), out_rows.stride(1),
            hidden_size, eps,
            HAS_RESIDUAL=residual is not None, SINGLE_PASS=single_pass, BLOCK_SIZE=block_size,
            num_warps=num_warps, **pdl.launch_options(),
        )
    return out if residual is None else (out, residual)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, out: torch.Tensor | None = None
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain torch, same semantics as rms_norm (HF Llama RMSNorm numerics)."""
    if residual is not None:
        residual.copy_(x + residual)
        x = residual
    x_fp32 = x.float()
    normed = x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + eps)
    result = weight * normed.to(x.dtype)
    if out is not None:
        result = out.copy_(result)
    return result if residual is None else (result, residual)
