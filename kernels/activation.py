"""SwiGLU activation of the fused gate_up projection: ``silu(gate) * up`` (Triton).

Numerics follow the torch expression ``F.silu(gate) * up`` in the activation dtype: silu in fp32
rounded to that dtype, then the product in fp32 rounded again.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl

BLOCK_SIZE = 1024  # columns per program


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, x_stride_row, out_stride_row, d,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    pdl.wait_then_launch_dependents(PDL)
    gate = tl.load(x_ptr + row * x_stride_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride_row + d + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(x_ptr.dtype.element_ty)  # F.silu, rounded
    out = silu.to(tl.float32) * up
    tl.store(out_ptr + row * out_stride_row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _as_rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """[..., n] -> a [num_rows, n] view with a contiguous last dim (never a copy)."""
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dim must be contiguous (strides {t.stride()})")
    return t if t.dim() == 2 else t.view(-1, t.shape[-1])


def silu_and_mul(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., 2 * d] (gate then up) -> [..., d] = silu(gate) * up.

    out: optional [..., d] buffer of x's dtype (or another float dtype)
    """
    d = x.shape[-1] // 2
    if x.shape[-1] != 2 * d:
        raise ValueError(f"last dim {x.shape[-1]} of x is odd")
    out_shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != out_shape:
        raise ValueError(f"out {tuple(out.shape)} must be {out_shape}")
    x_rows, out_rows = _as_rows(x, "x"), _as_rows(out, "out")
    num_rows = x_rows.shape[0]
    if num_rows > 0 and d > 0:
        block = min(BLOCK_SIZE, triton.next_power_of_2(d))
        _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
            x_rows, out_rows, x_rows.stride(0), out_rows.stride(0), d, BLOCK=block,
            num_warps=4 if block >= 512 else 1, **pdl.launch_options(),
        )
    return out


def silu_and_mul_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, same semantics as silu_and_mul."""
    gate, up = x.chunk(2, dim=-1)  # [..., d] each
    result = F.silu(gate) * up
    return result if out is None else out.copy_(result)
