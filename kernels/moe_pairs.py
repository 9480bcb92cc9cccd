"""The Mixture-of-Experts MLP at decode sizes: one program per (token, k) pair, no align.

At a few tokens (batch-1 decode: 8 pairs of 8 experts for Qwen3-30B-A3B) the grouped path of
kernels/fused_moe.py spends more time in its small launches (align, the sum over k) and in
padding each touched expert's one row to a 16-row tile than in reading the experts' bytes.
Here, with the same result per pair up to the dot's summation order:

1. gate_up: a program per (pair, column tile) reads its expert's gate and up rows of the
   tile once and dots them with its token's x row in fp32 (multiply, then a sum over K: a
   GEMV, no tensor cores), SwiGLU in the epilogue rounded as fused_moe rounds it -> h.
2. down: a program per (token, column tile) takes its token's k pairs in k order: each
   h row dotted with its expert's w2 rows, rounded to x's dtype, times the routed weight,
   rounded again (fused_moe's per-pair contribution), added in fp32; the sum rounded once.
   A sentinel pair (id outside [0, E): a padded graph row, another rank's expert) adds
   nothing. No atomics, no host sync, shapes from the tensors only: graph-capturable.

FP8 weights' per-output-channel scales multiply the fp32 sums, as in fused_moe. A token's
numbers depend on that token alone, but not bitwise on the grouped path's (another summation
order): ``fused_moe`` takes this path only below ``MAX_TOKENS`` rows and never with
``batch_invariant``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.skinny_tiles import silu_times

MAX_TOKENS = 4  # rows at which fused_moe takes this path (the lease's sweep sets it)
GATE_UP_BLOCK_N, GATE_UP_BLOCK_K = 32, 256
DOWN_BLOCK_N, DOWN_BLOCK_K = 16, 256  # (16: 128 programs over Qwen3's 2,048 columns)


@triton.jit
def _row_dot(x_ptr, w_ptrs, offs_k, n_mask, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N] fp32: the weight rows at w_ptrs (K contiguous values each) dotted with the
    K values at x_ptr (rows outside n_mask: 0, their weights not read)."""
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        x = tl.load(x_ptr + k + offs_k, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs + k, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    return acc


@triton.jit
def _pair_gate_up_kernel(x_ptr, w_ptr, scale_ptr, ids_ptr, h_ptr, num_experts, inter, hidden,
                         x_stride, w_stride_e, h_stride, TOP_K: tl.constexpr,
                         HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr):
    """h[pair, j] = silu(x_t . w13[e, j]) * (x_t . w13[e, inter + j]), e the pair's expert."""
    pair = tl.program_id(0).to(tl.int64)
    pdl.wait_then_launch_dependents(PDL)
    expert = tl.load(ids_ptr + pair)
    if (expert < 0) | (expert >= num_experts):  # routed nowhere: its h row is never read
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter
    x_row = x_ptr + (pair // TOP_K) * x_stride
    w_ptrs = (w_ptr + expert.to(tl.int64) * w_stride_e + offs_n.to(tl.int64)[:, None] * hidden
              + offs_k[None, :])
    gate = _row_dot(x_row, w_ptrs, offs_k, n_mask, hidden, BLOCK_N, BLOCK_K)
    up = _row_dot(x_row, w_ptrs + inter * hidden, offs_k, n_mask, hidden, BLOCK_N, BLOCK_K)
    if HAS_SCALE:  # per output channel: [E, 2 * inter], the up rows' after the gate rows'
        scales = scale_ptr + expert * 2 * inter + offs_n
        gate *= tl.load(scales, mask=n_mask, other=0.0)
        up *= tl.load(scales + inter, mask=n_mask, other=0.0)
    h = silu_times(gate, up, x_ptr.dtype.element_ty)
    tl.store(h_ptr + pair * h_stride + offs_n, h.to(h_ptr.dtype.element_ty), mask=n_mask)


@triton.jit
def _pair_down_kernel(h_ptr, w_ptr, scale_ptr, ids_ptr, routed_ptr, out_ptr, num_experts,
                      hidden, inter, h_stride, w_stride_e, out_stride, TOP_K: tl.constexpr,
                      HAS_SCALE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
    """out[t, j] = sum over k of round(routed * round(h[pair] . w2[e, j])), k in order."""
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < hidden
    pdl.wait_then_launch_dependents(PDL)
    total = tl.zeros([BLOCK_N], dtype=tl.float32)
    dtype = h_ptr.dtype.element_ty
    for k in tl.static_range(TOP_K):
        pair = token * TOP_K + k
        expert = tl.load(ids_ptr + pair)
        routed_here = (expert >= 0) & (expert < num_experts)
        expert = tl.where(routed_here, expert, 0)
        # a sentinel pair's dot runs over nothing: none of its weights are read
        k_end = tl.where(routed_here, inter, 0)
        w_ptrs = (w_ptr + expert.to(tl.int64) * w_stride_e
                  + offs_n.to(tl.int64)[:, None] * inter + offs_k[None, :])
        acc = _row_dot(h_ptr + pair * h_stride, w_ptrs, offs_k, n_mask, k_end, BLOCK_N, BLOCK_K)
        if HAS_SCALE:
            acc *= tl.load(scale_ptr + expert * hidden + offs_n, mask=n_mask, other=0.0)
        routed = tl.where(routed_here, tl.load(routed_ptr + pair), 0.0)
        total += (acc.to(dtype).to(tl.float32) * routed).to(dtype).to(tl.float32)
    tl.store(out_ptr + token * out_stride + offs_n, total.to(out_ptr.dtype.element_ty),
             mask=n_mask)


def pairs_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None,
              w2_scale: torch.Tensor | None) -> torch.Tensor:
    """fused_moe's result on this path: x [num_tokens, hidden] contiguous rows, w13, w2
    contiguous, topk_weights fp32 and topk_ids int32 [num_tokens, top_k] contiguous, the
    scales fp32 (FP8) or None -> [num_tokens, hidden] in x's dtype."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter = two_inter // 2
    h = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    options = {"num_warps": 4, **pdl.launch_options()}
    _pair_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, GATE_UP_BLOCK_N))](
        x, w13, w13_scale if w13_scale is not None else w13, topk_ids, h, num_experts, inter,
        hidden, x.stride(0), w13.stride(0), h.stride(0), TOP_K=top_k,
        HAS_SCALE=w13_scale is not None, BLOCK_N=GATE_UP_BLOCK_N, BLOCK_K=GATE_UP_BLOCK_K,
        **options)
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    _pair_down_kernel[(num_tokens, triton.cdiv(hidden, DOWN_BLOCK_N))](
        h, w2, w2_scale if w2_scale is not None else w2, topk_ids, topk_weights, out,
        num_experts, hidden, inter, h.stride(0), w2.stride(0), out.stride(0), TOP_K=top_k,
        HAS_SCALE=w2_scale is not None, BLOCK_N=DOWN_BLOCK_N, BLOCK_K=DOWN_BLOCK_K, **options)
    return out
