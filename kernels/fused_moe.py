"""The Mixture-of-Experts MLP: each token's top-k experts' SwiGLU MLPs, weighted and summed.

``fused_moe(x, w13, w2, topk_weights, topk_ids)`` = for each token t,
``sum_k topk_weights[t, k] * w2[e] @ (silu(w13[e, :I] @ x_t) * (w13[e, I:] @ x_t))``,
e = topk_ids[t, k] (kernels/moe_routing.py's ``route`` makes weights and ids). On CUDA:

1. align (kernels/moe_routing.py): the (token, k) pairs grouped by expert, each expert's share
   padded to BLOCK_M, block -> expert; one launch, no host sync.
2. gate_up: a program per (block, column tile) gathers its pairs' x rows and multiplies them by
   its expert's gate rows j and up rows I + j of the same columns; SwiGLU in the epilogue,
   rounded as the two-kernel path rounds it (kernels/skinny_tiles.py's ``silu_times``);
   written to ``h`` [num_pairs, I] at the pair's row.
3. down: ``h`` rows x w2[e]^T, rounded to x's dtype, times the routed weight, written to the
   pair's row of [num_tokens * top_k, hidden].
4. the sum over k, in k order in fp32, sentinel pairs (id == num_experts: a padded graph row)
   skipped -> [num_tokens, hidden]. No atomics anywhere: deterministic.

At decode sizes (16 rows or fewer with BLOCK_M 16) each touched expert is one block, so its
weights are read once per column tile: the step streams just the touched experts' bytes.
FP8 (e4m3) weights come with per-output-channel fp32 scales, applied to the fp32 sums
(weight-only: x stays in its dtype; with bf16 x the tiles meet on the fp16 tensor cores as in
kernels/skinny_tiles.py's ``fp16_dot``). Every shape the kernels see comes from the tensors'
shapes, never their values: graph-capturable. A row's numbers depend on that row alone (a
tensor-core product sums each output from its own row); with ``batch_invariant`` the launch
configs are also fixed per shape (kernels/moe_configs.py), so they hold at any batch.

``fused_moe_ref`` is the CPU path: one matmul per touched expert for each GEMM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels import pdl
from kernels.activation import silu_and_mul_ref
from kernels.fp8 import FP8_DTYPE, fp8_linear_ref
from kernels.moe_configs import MoeConfig, MoePlan, plan_for
from kernels.moe_routing import align, max_blocks
from kernels.skinny_tiles import silu_times, tile_dot, tile_masks
from kernels.split_reduce import store_rounded


def _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale) -> None:
    num_experts, two_inter, hidden = w13.shape
    if x.dim() != 2 or x.shape[1] != hidden or w2.shape != (num_experts, hidden, two_inter // 2):
        raise ValueError(f"x {tuple(x.shape)}, w13 {tuple(w13.shape)} and w2 "
                         f"{tuple(w2.shape)} do not match")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                         f"{tuple(topk_weights.shape)} must be [{x.shape[0]}, top_k]")
    quantized = w13.dtype == FP8_DTYPE
    if quantized != (w13_scale is not None) or (w2.dtype == FP8_DTYPE) != (w2_scale is not None):
        raise ValueError("FP8 weights come with their scales, other weights without")
    if not quantized and not w13.dtype == w2.dtype == x.dtype:
        raise ValueError(f"x {x.dtype}, w13 {w13.dtype}, w2 {w2.dtype}: one dtype")
    if quantized and (w13_scale.shape != w13.shape[:2] or w2_scale.shape != w2.shape[:2]):
        raise ValueError("scales must be w13_scale [E, 2 * inter], w2_scale [E, hidden]")


def _linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """x @ weight^T in x's dtype (fp32 sums); an FP8 weight dequantized, in fp32."""
    if scale is None:
        return F.linear(x, weight)
    return fp8_linear_ref(x, weight, scale, quantize_x=False)


def fused_moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                  batch_invariant: bool = False) -> torch.Tensor:
    """``fused_moe`` in torch: pairs grouped by expert (a stable sort), per touched expert one
    gate_up matmul, SwiGLU and one down matmul (rounded to x's dtype as the kernels round),
    times the routed weight; then the k contributions added in k order in fp32."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).long()  # [num_pairs]
    order = torch.sort(flat_ids, stable=True).indices  # pairs by expert, sentinels last
    counts = torch.bincount(flat_ids.clamp(0, num_experts), minlength=num_experts + 1)
    ends = counts[:num_experts].cumsum(0).tolist()
    routed_weights = topk_weights.reshape(-1, 1).float()  # [num_pairs, 1]
    contributions = x.new_zeros(num_tokens * top_k, x.shape[1])  # [num_pairs, hidden]
    start = 0
    for expert, end in enumerate(ends):
        if end == start:
            continue
        pairs = order[start:end]  # [n_e]
        start = end
        gate_up = _linear(x[pairs // top_k], w13[expert],
                          None if w13_scale is None else w13_scale[expert])  # [n_e, 2 * inter]
        down = _linear(silu_and_mul_ref(gate_up), w2[expert],
                       None if w2_scale is None else w2_scale[expert])  # [n_e, hidden]
        contributions[pairs] = (down.float() * routed_weights[pairs]).to(x.dtype)
    per_token = contributions.view(num_tokens, top_k, -1)
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for k in range(top_k):  # k order: the same sum as the kernel's
        out += per_token[:, k].float()
    return out.to(x.dtype)


@triton.jit
def _block_tile(num_blocks, N, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(block, column tile) of this program: GROUP_M blocks side by side per column tile, so
    a weight tile read once serves several blocks of one expert from L2."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group_width = GROUP_M * num_n
    first_block = (pid // group_width) * GROUP_M
    group_size = tl.minimum(num_blocks - first_block, GROUP_M)
    return first_block + (pid % group_width) % group_size, (pid % group_width) // group_size


@triton.jit
def _dot(x, w, acc, FP32_IEEE: tl.constexpr, FP16_DOT: tl.constexpr, WIDEN: tl.constexpr):
    """acc + x @ w^T. WIDEN (bf16 under the CPU interpreter, whose bf16 tl.dot is wrong): the
    tiles widened to fp32 first (bf16 products are exact in fp32: the same sums)."""
    if WIDEN:
        return tile_dot(x.to(tl.float32), w.to(tl.float32), acc, True, False)
    return tile_dot(x, w, acc, FP32_IEEE, FP16_DOT)


@triton.jit
def _block_pairs(block_expert_ptr, sorted_ptr, pid_m, num_pairs, BLOCK_M: tl.constexpr):
    """(expert of block pid_m, its [BLOCK_M] pair ids, which of them are real pairs)."""
    expert = tl.load(block_expert_ptr + pid_m)
    pairs = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return expert, pairs, pairs < num_pairs


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _gate_up_kernel(x_ptr, w_ptr, scale_ptr, h_ptr, sorted_ptr, block_expert_ptr,
                    num_pairs, num_blocks, inter, hidden, x_stride, w_stride_e, up_offset,
                    h_stride, TOP_K: tl.constexpr, HAS_SCALE: tl.constexpr, FP32_IEEE: tl.constexpr,
                    FP16_DOT: tl.constexpr, WIDEN: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, PDL: tl.constexpr):
    """h[pair, j] = silu(x_t . w13[e, j]) * (x_t . w13[e, inter + j]) for the block's pairs."""
    pid_m, pid_n = _block_tile(num_blocks, inter, BLOCK_N, GROUP_M)
    pdl.wait_then_launch_dependents(PDL)
    expert, pairs, m_mask = _block_pairs(block_expert_ptr, sorted_ptr, pid_m, num_pairs, BLOCK_M)
    if expert < 0:  # past the last real block
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < inter
    # [BLOCK_M, BLOCK_K] gathered x rows; [BLOCK_N, BLOCK_K] gate rows (up rows inter further)
    x_ptrs = x_ptr + (pairs // TOP_K).to(tl.int64)[:, None] * x_stride + offs_k[None, :]
    w_ptrs = (w_ptr + expert.to(tl.int64) * w_stride_e + offs_n.to(tl.int64)[:, None] * hidden
              + offs_k[None, :])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, hidden, BLOCK_K):
        w_mask, x_mask = tile_masks(k, offs_k, hidden, m_mask, n_mask, EVEN_K)
        x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        acc = _dot(x, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, FP32_IEEE, FP16_DOT, WIDEN)
        acc_up = _dot(x, tl.load(w_ptrs + up_offset, mask=w_mask, other=0.0), acc_up,
                      FP32_IEEE, FP16_DOT, WIDEN)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:  # per output channel: [E, 2 * inter], the up rows' after the gate rows'
        scales = scale_ptr + expert * 2 * inter + offs_n
        acc *= tl.load(scales, mask=n_mask, other=0.0)[None, :]
        acc_up *= tl.load(scales + inter, mask=n_mask, other=0.0)[None, :]
    h = silu_times(acc, acc_up, x_ptr.dtype.element_ty)
    h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * h_stride + offs_n[None, :]
    store_rounded(h_ptrs, h, x_ptr, h_ptr, m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _down_kernel(h_ptr, w_ptr, scale_ptr, routed_ptr, out_ptr, sorted_ptr, block_expert_ptr,
                 num_pairs, num_blocks, hidden, inter, h_stride, w_stride_e, out_stride,
                 HAS_SCALE: tl.constexpr, FP32_IEEE: tl.constexpr, FP16_DOT: tl.constexpr,
                 WIDEN: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                 PDL: tl.constexpr):
    """out[pair, j] = routed weight * round(h[pair] . w2[e, j]) for the block's pairs."""
    pid_m, pid_n = _block_tile(num_blocks, hidden, BLOCK_N, GROUP_M)
    pdl.wait_then_launch_dependents(PDL)
    expert, pairs, m_mask = _block_pairs(block_expert_ptr, sorted_ptr, pid_m, num_pairs, BLOCK_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < hidden
    h_ptrs = h_ptr + pairs.to(tl.int64)[:, None] * h_stride + offs_k[None, :]
    w_ptrs = (w_ptr + expert.to(tl.int64) * w_stride_e + offs_n.to(tl.int64)[:, None] * inter
              + offs_k[None, :])
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, inter, BLOCK_K):
        w_mask, h_mask = tile_masks(k, offs_k, inter, m_mask, n_mask, EVEN_K)
        h = tl.load(h_ptrs, mask=h_mask, other=0.0)
        acc = _dot(h, tl.load(w_ptrs, mask=w_mask, other=0.0), acc, FP32_IEEE, FP16_DOT, WIDEN)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_SCALE:
        acc *= tl.load(scale_ptr + expert * hidden + offs_n, mask=n_mask, other=0.0)[None, :]
    routed = tl.load(routed_ptr + pairs, mask=m_mask, other=0.0)  # [BLOCK_M] fp32
    acc = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * routed[:, None]
    out_ptrs = out_ptr + pairs.to(tl.int64)[:, None] * out_stride + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _sum_k_kernel(per_pair_ptr, ids_ptr, out_ptr, hidden, num_experts,
                  TOP_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Program (token, column block): its k contributions added in k order in fp32; a
    sentinel pair (routed nowhere, its row never written) adds nothing."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < hidden
    pdl.wait_then_launch_dependents(PDL)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(ids_ptr + token * TOP_K + k)
        routed_cols = tl.where((expert >= 0) & (expert < num_experts), hidden, 0)
        acc += tl.load(per_pair_ptr + (token * TOP_K + k) * hidden + cols,
                       mask=cols < routed_cols, other=0.0).to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def _dot_flags(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The dot's constexprs for x's and the weight's dtypes."""
    return {"FP32_IEEE": x.dtype == torch.float32,
            "FP16_DOT": weight.dtype == FP8_DTYPE and x.dtype == torch.bfloat16,
            "WIDEN": x.device.type == "cpu" and x.dtype == torch.bfloat16
            and weight.dtype != FP8_DTYPE}


def _launch_options(config: MoeConfig) -> dict:
    return {"BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k,
            "GROUP_M": config.group_m, "num_warps": config.num_warps,
            "num_stages": config.num_stages, **pdl.launch_options()}


def _launch_gemms(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, plan: MoePlan
                  ) -> torch.Tensor:
    """align, gate_up and down -> the pairs' weighted contributions [num_pairs, hidden]."""
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    inter, num_pairs = two_inter // 2, num_tokens * top_k
    sorted_pair_ids, block_expert_ids = align(topk_ids, num_experts, plan.block_m)
    num_blocks = max_blocks(num_pairs, num_experts, plan.block_m)
    h = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)  # [num_pairs, inter]
    up = plan.gate_up
    _gate_up_kernel[(num_blocks * triton.cdiv(inter, up.block_n),)](
        x, w13, w13_scale if w13_scale is not None else w13, h, sorted_pair_ids,
        block_expert_ids, num_pairs, num_blocks, inter, hidden, x.stride(0), w13.stride(0),
        inter * w13.stride(1), h.stride(0), TOP_K=top_k, HAS_SCALE=w13_scale is not None,
        **_dot_flags(x, w13),
        EVEN_K=hidden % up.block_k == 0, **_launch_options(up))
    per_pair = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    down = plan.down
    _down_kernel[(num_blocks * triton.cdiv(hidden, down.block_n),)](
        h, w2, w2_scale if w2_scale is not None else w2, topk_weights, per_pair,
        sorted_pair_ids, block_expert_ids, num_pairs, num_blocks, hidden, inter, h.stride(0),
        w2.stride(0), per_pair.stride(0), HAS_SCALE=w2_scale is not None, **_dot_flags(x, w2),
        EVEN_K=inter % down.block_k == 0, **_launch_options(down))
    return per_pair


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     batch_invariant: bool = False, plan: MoePlan | None = None) -> torch.Tensor:
    """``fused_moe`` in Triton launches (CUDA, or the interpreter on CPU tensors). ``plan``:
    the launch configs (default: kernels/moe_configs.py's for the shape and row count)."""
    _check(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    num_tokens, top_k = topk_ids.shape
    num_experts, two_inter, hidden = w13.shape
    out = torch.empty(num_tokens, hidden, dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return out
    if two_inter == 0:
        return out.zero_()
    if x.stride(1) != 1:
        x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()  # no copy for a loaded checkpoint's weights
    scales = [s.float().contiguous() if s is not None else None for s in (w13_scale, w2_scale)]
    plan = plan or plan_for(num_experts, top_k, two_inter // 2, hidden, w13.dtype,
                            None if batch_invariant else num_tokens)
    topk_ids = topk_ids.to(torch.int32).contiguous()
    per_pair = _launch_gemms(x, w13, w2, topk_weights.float().contiguous(), topk_ids, *scales,
                             plan)
    block = min(1024, triton.next_power_of_2(hidden))
    _sum_k_kernel[(num_tokens, triton.cdiv(hidden, block))](
        per_pair, topk_ids, out, hidden, num_experts, TOP_K=top_k,
        BLOCK=block, num_warps=4, **pdl.launch_options())
    return out


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None, batch_invariant: bool = False
              ) -> torch.Tensor:
    """x [num_tokens, hidden] (bf16/fp16/fp32), w13 [E, 2 * inter, hidden] (gate rows, then
    up rows), w2 [E, hidden, inter], topk_weights [num_tokens, top_k] fp32, topk_ids
    [num_tokens, top_k] int32 (``route``'s) -> [num_tokens, hidden] in x's dtype. FP8 weights
    come with per-output-channel fp32 scales w13_scale [E, 2 * inter], w2_scale [E, hidden].
    Sentinel ids (== E) contribute nothing. CUDA: the Triton kernels; CPU: ``fused_moe_ref``."""
    run = fused_moe_triton if x.is_cuda else fused_moe_ref
    return run(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale, batch_invariant)
