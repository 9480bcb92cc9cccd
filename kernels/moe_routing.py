"""Mixture-of-Experts routing and the align step that groups (token, k) pairs by expert.

- ``route``: router logits -> (top-k weights, expert ids). Softmax in fp32; the top k chosen on
  the fp32 logits (the softmax's order without its rounding ties), exact ties to the LOWER
  expert id, so a row's choice depends on that row alone. One Triton launch on CUDA (a program
  a row), torch on the CPU (a stable sort: equal logits keep id order). Invalid rows (a CUDA
  graph's padding) get the sentinel id ``num_experts``, which routes nowhere, and weight 0.
- ``align``: the pairs' expert ids -> ``sorted_pair_ids`` (pair ids grouped by expert, each
  expert's share padded to BLOCK_M with the out-of-range id ``num_pairs``) and
  ``block_expert_ids`` (each BLOCK_M block's expert; -1 past the real end, where a GEMM
  program exits). One Triton launch of one program, no host sync: the buffers are sized from
  the shapes alone (``max_blocks``), so it runs inside CUDA graphs. Within an expert the pairs'
  order is whatever the atomics give: a GEMM row's result never depends on its block-mates.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl

ALIGN_CHUNK = 1024  # pairs the align program takes per step
ALIGN_BLOCKS = 64  # blocks per step of its block -> expert map ([blocks, experts] compares)


def route_ref(router_logits: torch.Tensor, top_k: int, renormalize: bool,
              valid_rows: torch.Tensor | None = None, counts: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` in torch (the CPU path): a stable descending sort keeps equal logits in id
    order, so the lower id wins a tie."""
    num_tokens, num_experts = _check_route(router_logits, top_k, valid_rows)
    logits = router_logits.float()  # [num_tokens, num_experts]
    probs = torch.softmax(logits, dim=-1)
    order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :top_k]
    weights = probs.gather(1, order)  # [num_tokens, top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    ids = order.to(torch.int32)
    if valid_rows is not None:
        valid = valid_rows.bool()[:, None]
        ids = torch.where(valid, ids, torch.full_like(ids, num_experts))
        weights = torch.where(valid, weights, torch.zeros_like(weights))
    if counts is not None:  # the sentinel (num_experts) falls in a slot past the end
        flat = ids.reshape(-1).long()
        counts.add_(torch.bincount(flat, minlength=num_experts + 1)[:num_experts].to(counts.dtype))
    return weights, ids


@triton.jit
def _route_kernel(logits_ptr, valid_ptr, weights_ptr, ids_ptr, counts_ptr, num_experts,
                  logits_stride, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                  RENORMALIZE: tl.constexpr, HAS_VALID: tl.constexpr, COUNT: tl.constexpr,
                  BLOCK_E: tl.constexpr, PDL: tl.constexpr):
    """One program a row: softmax, then TOP_K rounds of (largest untaken logit, lowest id
    among equals)."""
    row = tl.program_id(0).to(tl.int64)
    offs_e = tl.arange(0, BLOCK_E)
    ks = tl.arange(0, K_PAD)
    pdl.wait_then_launch_dependents(PDL)
    logits = tl.load(logits_ptr + row * logits_stride + offs_e, mask=offs_e < num_experts,
                     other=float("-inf")).to(tl.float32)  # [BLOCK_E]
    exps = tl.where(offs_e < num_experts, tl.exp(logits - tl.max(logits, axis=0)), 0.0)
    probs = exps / tl.sum(exps, axis=0)
    taken = offs_e >= num_experts
    top_ids = tl.zeros([K_PAD], dtype=tl.int32)
    top_probs = tl.zeros([K_PAD], dtype=tl.float32)
    for i in tl.static_range(TOP_K):
        best = tl.max(tl.where(taken, float("-inf"), logits), axis=0)
        pick = tl.min(tl.where((logits == best) & ~taken, offs_e, BLOCK_E), axis=0)
        # a NaN row matches nothing: the lowest untaken id keeps ids in range
        pick = tl.where(pick < BLOCK_E, pick, tl.min(tl.where(taken, BLOCK_E, offs_e), axis=0))
        top_ids = tl.where(ks == i, pick, top_ids)
        top_probs = tl.where(ks == i, tl.sum(tl.where(offs_e == pick, probs, 0.0), axis=0),
                             top_probs)
        taken = taken | (offs_e == pick)
    if RENORMALIZE:
        top_probs = top_probs / tl.sum(tl.where(ks < TOP_K, top_probs, 0.0), axis=0)
    if HAS_VALID:
        valid = tl.load(valid_ptr + row) != 0
        top_ids = tl.where(valid, top_ids, num_experts)
        top_probs = tl.where(valid, top_probs, 0.0)
    tl.store(weights_ptr + row * TOP_K + ks, top_probs, mask=ks < TOP_K)
    tl.store(ids_ptr + row * TOP_K + ks, top_ids, mask=ks < TOP_K)
    if COUNT:  # tokens per expert (integer adds: the same sums in any order)
        tl.atomic_add(counts_ptr + top_ids, tl.full([K_PAD], 1, tl.int32),
                      mask=(ks < TOP_K) & (top_ids < num_experts))


def _check_route(router_logits: torch.Tensor, top_k: int,
                 valid_rows: torch.Tensor | None) -> tuple[int, int]:
    if router_logits.dim() != 2 or not router_logits.dtype.is_floating_point:
        raise ValueError(f"router_logits must be [num_tokens, num_experts] float, not "
                         f"{tuple(router_logits.shape)} {router_logits.dtype}")
    num_tokens, num_experts = router_logits.shape
    if not 0 < top_k <= num_experts:
        raise ValueError(f"top_k {top_k} must be in 1..{num_experts}")
    if valid_rows is not None and valid_rows.shape != (num_tokens,):
        raise ValueError(f"valid_rows must be [{num_tokens}], not {tuple(valid_rows.shape)}")
    return num_tokens, num_experts


def route_triton(router_logits: torch.Tensor, top_k: int, renormalize: bool,
                 valid_rows: torch.Tensor | None = None, counts: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``route`` in one Triton launch (CUDA, or the interpreter on CPU tensors)."""
    num_tokens, num_experts = _check_route(router_logits, top_k, valid_rows)
    device = router_logits.device
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=device)
    if num_tokens == 0:
        return weights, ids
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    valid = valid_rows.to(torch.uint8) if valid_rows is not None else ids  # ids: unused
    if counts is not None and (counts.dtype != torch.int32 or counts.shape != (num_experts,)):
        raise ValueError(f"counts must be [{num_experts}] int32, not {tuple(counts.shape)} "
                         f"{counts.dtype}")
    block_e = triton.next_power_of_2(num_experts)
    _route_kernel[(num_tokens,)](
        router_logits, valid, weights, ids, counts if counts is not None else ids, num_experts,
        router_logits.stride(0), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
        RENORMALIZE=renormalize, HAS_VALID=valid_rows is not None, COUNT=counts is not None,
        BLOCK_E=block_e,
        num_warps=1 if block_e <= 256 else 4, **pdl.launch_options())
    return weights, ids


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          valid_rows: torch.Tensor | None = None, counts: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, num_experts] (any float dtype) -> (topk_weights
    [num_tokens, top_k] fp32, topk_ids [num_tokens, top_k] int32), descending. Softmax in fp32
    over all experts; the top_k largest, ties to the lower expert id; ``renormalize``: the k
    weights divided by their sum (Mixtral, Qwen3-MoE's norm_topk_prob). ``valid_rows``
    [num_tokens] bool (None: all valid): an invalid row gets ids ``num_experts`` (routes
    nowhere) and weights 0. ``counts`` [num_experts] int32: each expert's routed pairs
    added to it (padding's not). CUDA: one Triton launch; CPU: torch."""
    if router_logits.is_cuda:
        return route_triton(router_logits, top_k, renormalize, valid_rows, counts)
    return route_ref(router_logits, top_k, renormalize, valid_rows, counts)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most BLOCK_M blocks the align step can fill, from the shapes alone: every expert's
    share padded by at most BLOCK_M - 1, and at most min(E, num_pairs) experts touched."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


@triton.jit
def _expert_counts(ids_ptr, num_pairs, num_experts, CHUNK: tl.constexpr,
                   BLOCK_E: tl.constexpr):
    """[BLOCK_E] pairs per expert (lanes from num_experts on, the sentinel's too, are 0)."""
    offs = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for start in range(0, num_pairs, CHUNK):
        ids = tl.load(ids_ptr + start + offs, mask=start + offs < num_pairs, other=num_experts)
        ids = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts)  # out of range: skip
        counts += tl.histogram(ids, BLOCK_E)
    return tl.where(tl.arange(0, BLOCK_E) < num_experts, counts, 0)


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, cursor_ptr, num_pairs, num_experts,
                  num_blocks, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr,
                  CHUNK: tl.constexpr, BLOCKS: tl.constexpr, PDL: tl.constexpr):
    """One program: count pairs per expert, pad each share to BLOCK_M, map blocks to experts,
    fill the slots with the padding id, then scatter each pair to its expert's next slot."""
    offs_e = tl.arange(0, BLOCK_E)
    offs = tl.arange(0, CHUNK)
    pdl.wait_then_launch_dependents(PDL)
    counts = _expert_counts(ids_ptr, num_pairs, num_experts, CHUNK, BLOCK_E)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)  # [BLOCK_E] each expert's end slot
    tl.store(cursor_ptr + offs_e, ends - padded, mask=offs_e < num_experts)
    total = tl.sum(padded, axis=0)
    for b in range(0, num_blocks, BLOCKS):
        blocks = b + tl.arange(0, BLOCKS)
        first_slot = blocks * BLOCK_M
        # the block's expert: how many experts end at or before its first slot
        expert = tl.sum((ends[None, :] <= first_slot[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + blocks, tl.where(first_slot < total, expert, -1),
                 mask=blocks < num_blocks)
    for s in range(0, num_blocks * BLOCK_M, CHUNK):
        tl.store(sorted_ptr + s + offs, num_pairs, mask=s + offs < num_blocks * BLOCK_M)
    tl.debug_barrier()  # the cursors and the padding fill before any scatter
    for start in range(0, num_pairs, CHUNK):
        pairs = start + offs
        ids = tl.load(ids_ptr + pairs, mask=pairs < num_pairs, other=num_experts)
        routed = (ids >= 0) & (ids < num_experts)
        slot = tl.atomic_add(cursor_ptr + ids, 1, mask=routed)
        tl.store(sorted_ptr + slot, pairs, mask=routed)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [num_tokens, top_k] int32 -> (sorted_pair_ids [max_blocks * block_m] int32,
    block_expert_ids [max_blocks] int32). Pair p = token * top_k + k. Each expert's pairs fill
    whole blocks from its first slot on, the rest of its last block holds ``num_pairs``;
    sentinel ids (``num_experts``) get no slot; blocks past the end hold -1."""
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        raise ValueError("topk_ids must be contiguous int32")
    num_pairs = topk_ids.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    device = topk_ids.device
    sorted_pair_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=device)
    if num_blocks == 0:
        return sorted_pair_ids, block_expert_ids
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)  # next slot per expert
    _align_kernel[(1,)](
        topk_ids, sorted_pair_ids, block_expert_ids, cursor, num_pairs, num_experts,
        num_blocks, BLOCK_M=block_m, BLOCK_E=triton.next_power_of_2(num_experts + 1),
        CHUNK=min(ALIGN_CHUNK, max(16, triton.next_power_of_2(num_pairs))),
        BLOCKS=ALIGN_BLOCKS, num_warps=4, **pdl.launch_options())
    return sorted_pair_ids, block_expert_ids
