"""FP8 (e4m3) weights and activations for the projections (``--quantization fp8``).

- Weights: one fp32 scale per output channel, ``W ~ W_fp8 * scale[:, None]``; quantized once
  while loading (``quantize_per_channel``, plain torch).
- Activations: one fp32 scale per token (row), computed in the step (``quantize_per_token``,
  one Triton launch: the row's absolute max, then the scaled cast), so nothing needs
  calibrating.
- ``fp8_linear``: ``x [M, K] @ W^T`` on the FP8 tensor cores through ``torch._scaled_mm`` with
  row-wise scales (the per-token scale of x, the per-channel scale of W), the output in x's
  dtype. At decode sizes the skinny GEMM (kernels/skinny_gemm.py) reads the FP8 weight and
  multiplies it with x in x's own dtype instead (weight-only FP8: half the bytes of bf16, no
  activation rounding); ``services/worker/ops.py`` chooses.
- ``fp8_linear_ref``: the same math in fp32 on any device (activations quantized as the
  kernel quantizes them, or not), what the kernels are tested against and what the CPU runs.

e4m3 (``torch.float8_e4m3fn``) holds magnitudes up to 448 with 3 mantissa bits; scales map each
row's or channel's absolute max onto 448.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# the smallest scale: a row or channel of zeros quantizes to zeros instead of 0 / 0
MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (any float dtype; stacked experts: [E, N, K]) -> (weight_fp8
    [..., N, K], scale [..., N] fp32), rounded to nearest."""
    amax = weight.abs().amax(dim=-1).float()  # [..., N]
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    weight_fp8 = (weight.float() / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return weight_fp8, scale


def dequantize_per_channel(weight_fp8: torch.Tensor, scale: torch.Tensor,
                           dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(weight_fp8 [..., N, K], scale [..., N]) -> weight [..., N, K] in dtype."""
    return (weight_fp8.float() * scale.float()[..., None]).to(dtype)


@triton.jit
def _quantize_per_token_kernel(x_ptr, out_ptr, scale_ptr, K, x_stride, out_stride,
                               FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr,
                               BLOCK: tl.constexpr):
    """One program per row: the row's absolute max (pass 1), then x / scale clamped to the
    e4m3 range and cast (pass 2)."""
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    x_row = x_ptr + row * x_stride
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(0, K, BLOCK):
        x = tl.load(x_row + start + offs, mask=start + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    for start in range(0, K, BLOCK):
        mask = start + offs < K
        x = tl.load(x_row + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
        tl.store(out_ptr + row * out_stride + start + offs,
                 q.to(out_ptr.dtype.element_ty), mask=mask)


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) -> (x_fp8 [M, K] contiguous, scale [M, 1] fp32)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with a contiguous last dim, not {tuple(x.shape)}")
    m, k = x.shape
    out = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    if m > 0:
        block = min(4096, triton.next_power_of_2(max(k, 16)))
        _quantize_per_token_kernel[(m,)](x, out, scale, k, x.stride(0), out.stride(0),
                                         FP8_MAX=FP8_MAX, MIN_SCALE=MIN_SCALE, BLOCK=block,
                                         num_warps=4 if block <= 1024 else 8)
    return out, scale


def quantize_per_token_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What ``quantize_per_token`` computes, in torch."""
    amax = x.abs().amax(dim=1, keepdim=True).float()  # [M, 1]
    scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def scaled_mm_serves(weight: torch.Tensor) -> bool:
    """Whether ``fp8_linear`` can run a [N, K] FP8 weight: CUDA, and both dims multiples of 16
    (what the row-wise scaled GEMM requires)."""
    n, k = weight.shape
    return weight.is_cuda and n % 16 == 0 and k % 16 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (bf16/fp16, CUDA), weight [N, K] FP8, weight_scale [N] fp32 -> [M, N] in x's
    dtype: x quantized per token, one row-wise scaled FP8 GEMM (fp32 accumulation)."""
    x_fp8, x_scale = quantize_per_token(x)
    out = torch._scaled_mm(x_fp8, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, -1),
                           out_dtype=x.dtype)
    return out if bias is None else out.add_(bias)


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                   bias: torch.Tensor | None = None, quantize_x: bool = True) -> torch.Tensor:
    """``fp8_linear`` in fp32 (``quantize_x`` False: the weight-only FP8 of the skinny GEMM),
    rounded to x's dtype."""
    x_float = x.float()
    if quantize_x:
        x_fp8, x_scale = quantize_per_token_ref(x)
        x_float = x_fp8.float() * x_scale
    out = F.linear(x_float, dequantize_per_channel(weight, weight_scale),
                   None if bias is None else bias.float())
    return out.to(x.dtype)
