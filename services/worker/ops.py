"""The decoder's compute ops: the Triton kernels on CUDA tensors, their plain-torch references
everywhere else (the CPU worker, and the numerics the kernels are tested against).

Each op has the kernel's signature, so the model is written once for both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import (activation, fp8, int_gemm, kv_cache, paged_attention, paged_attention_ref,
                     rms_norm as rms_norm_kernels, rotary, sampling, skinny_gemm)
from kernels.int_pack import IntWeight, int_gemm_ref
from kernels.lora import EXPAND_SILU_MAX_ROWS
from kernels.lora_delta import LoraDelta
from services.worker import cpu_attention

# ``batch_invariant`` (--batch-invariant, held by the model: ModelConfig.batch_invariant and
# passed to each op that reads it): every CUDA projection on the skinny GEMM (each row summed
# as alone, at any number of rows) and every attention launch on one tile config without
# split-KV, so a row's numbers do not depend on what else its step holds: greedy output then
# never changes with batching or speculation


def linear(x: torch.Tensor, weight: torch.Tensor | IntWeight,
           bias: torch.Tensor | None = None, weight_scale: torch.Tensor | None = None,
           out: torch.Tensor | None = None, batch_invariant: bool = False,
           lora: LoraDelta | None = None) -> torch.Tensor:
    """x [num_tokens, in_features] -> [num_tokens, out_features], as nn.Linear. Decode-sized
    batches of the shapes the skinny GEMM was measured faster on take it (batch invariant up
    to its row bound); everything else, and the CPU, F.linear. An FP8 weight comes with its
    ``weight_scale`` [out_features] (``fp8_linear``); a packed integer one is an IntWeight
    (``int_linear``). Under ``batch_invariant`` every CUDA projection takes the skinny GEMM
    (a packed one the int GEMM's decode launch). ``out``: written and returned, in x's dtype
    or fp32 (the result's values either way; the skinny GEMM stores fp32 without another
    launch). ``lora`` (CUDA): a step's adapter deltas added, the shrink inside the skinny
    GEMM's launch where it runs."""
    if isinstance(weight, IntWeight):
        result = int_linear(x, weight, bias, out, batch_invariant)
    elif x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and (
            skinny_gemm.serves(x.shape[0], weight)
            or (batch_invariant and skinny_gemm.takes(weight))):
        return skinny_gemm.skinny_gemm(x, weight, bias, weight_scale=weight_scale, out=out,
                                       lora=lora)
    else:
        result = (fp8_linear(x, weight, weight_scale, bias) if weight_scale is not None
                  else F.linear(x, weight, bias))
        result = result if out is None else out.copy_(result)
    return result if lora is None else lora.add(x, result)


def int_linear(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None,
               out: torch.Tensor | None = None, batch_invariant: bool = False) -> torch.Tensor:
    """A packed integer projection: kernels/int_gemm.py on CUDA; elsewhere the torch
    reference on its dequantized weight (tests; the CPU worker dequantizes at load). x [...,
    in_features]."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda:
        rows = rows if rows.stride(-1) == 1 else rows.contiguous()
        result = int_gemm.int_gemm(rows, weight, bias, batch_invariant=batch_invariant)
    else:
        result = int_gemm_ref(rows, weight, bias)
    result = result.view(*x.shape[:-1], weight.out_features)
    return result if out is None else out.copy_(result)


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:
    """An FP8 projection the skinny GEMM does not take: on CUDA, x quantized per token and the
    FP8 tensor cores (kernels/fp8.py); elsewhere, and for fp32 x (tests: the scaled GEMM
    writes bf16), the same math in fp32. x [..., in_features]."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.is_cuda and rows.dtype != torch.float32 and fp8.scaled_mm_serves(weight):
        out = fp8.fp8_linear(rows.contiguous(), weight, weight_scale, bias)
    else:
        out = fp8.fp8_linear_ref(rows, weight, weight_scale, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def linear_silu_and_mul(x: torch.Tensor, weight: torch.Tensor | IntWeight,
                        bias: torch.Tensor | None = None,
                        weight_scale: torch.Tensor | None = None,
                        batch_invariant: bool = False,
                        lora: LoraDelta | None = None) -> torch.Tensor:
    """SwiGLU of the fused gate_up projection: x [num_tokens, in_features], weight
    [2 * intermediate_size, in_features] -> [num_tokens, intermediate_size]. Where the skinny
    GEMM serves it, one launch with SwiGLU in its epilogue (bitwise the two ops). ``lora``
    (CUDA): a step's adapter deltas in before the SwiGLU; at decode sizes on the skinny GEMM
    the SwiGLU then runs in the expand's launch."""
    if lora is not None:
        if (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and isinstance(weight, torch.Tensor)
                and x.shape[0] <= EXPAND_SILU_MAX_ROWS and skinny_gemm.serves(x.shape[0], weight)):
            return skinny_gemm.skinny_gemm_lora_silu_and_mul(x, weight, bias, lora, weight_scale)
        return silu_and_mul(linear(x, weight, bias, weight_scale, batch_invariant=batch_invariant,
                                   lora=lora))
    # (not under --batch-invariant: the gated launch's config may tile K otherwise than the
    # plain launch's at rows it does not serve)
    if (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and not batch_invariant
            and isinstance(weight, torch.Tensor)
            and skinny_gemm.serves_gated(x.shape[0], weight)):
        return skinny_gemm.skinny_gemm_silu_and_mul(x, weight, bias, weight_scale=weight_scale)
    return silu_and_mul(linear(x, weight, bias, weight_scale, batch_invariant=batch_invariant))


def greedy_token_ids(logits: torch.Tensor) -> torch.Tensor:
    """logits [num_rows, vocab_size] -> each row's argmax [num_rows] int64, the lowest id
    among equals (on CUDA two launches, kernels/sampling.py, not torch's one block a row)."""
    if logits.is_cuda and logits.dim() == 2 and logits.stride(-1) == 1:
        return sampling.greedy_token_ids(logits)
    return logits.argmax(dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [..., dim] -> normed, or with a residual: (norm(x + residual), x + residual)."""
    op = rms_norm_kernels.rms_norm if x.is_cuda else rms_norm_kernels.rms_norm_ref
    return op(x, weight, eps, residual)


def linear_add_rms_norm(x: torch.Tensor, weight: torch.Tensor | IntWeight,
                        bias: torch.Tensor | None,
                        residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                        weight_scale: torch.Tensor | None = None, batch_invariant: bool = False,
                        lora: LoraDelta | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection into the residual stream and the RMSNorm after it: x [num_tokens,
    in_features] -> (norm(linear(x) + residual), linear(x) + residual), the sum written into
    residual [num_tokens, out_features] in place. Where ``norm_in_reduce`` holds, the add and
    the norm run in the skinny GEMM's split-K reduce (bitwise the two ops, one launch less);
    everywhere else, the two ops. ``lora`` (CUDA): a step's adapter deltas, added to the
    residual before the norm (on the skinny GEMM, the shrink inside its launch)."""
    if isinstance(weight, IntWeight) and x.dim() == 2 and norm_in_reduce(
            x.shape[0], weight, residual, norm_weight):
        if lora is not None:
            lora.add(x, residual)
        return int_gemm.int_gemm_add_rms_norm(x if x.stride(1) == 1 else x.contiguous(),
                                              weight, bias, residual, norm_weight, eps)
    if x.dim() == 2 and x.stride(1) == 1 and norm_in_reduce(x.shape[0], weight, residual,
                                                            norm_weight):
        return skinny_gemm.skinny_gemm_add_rms_norm(x, weight, bias, residual, norm_weight, eps,
                                                    weight_scale=weight_scale, lora=lora)
    if lora is not None:
        lora.add(x, residual)
    return rms_norm(linear(x, weight, bias, weight_scale, batch_invariant=batch_invariant),
                    norm_weight, eps, residual)


def linear_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    weight_scale: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [num_tokens, in_features] -> (partial, the bias still to add): the skinny GEMM's fp32
    split-K partials [split_k, num_tokens, out_features] and the bias where it splits K at
    this size, else the projection [num_tokens, out_features] (bias in) and None. For a reduce
    that rounds the splits itself (kernels/all_reduce_rms_norm.py)."""
    if (x.is_cuda and x.dim() == 2 and x.stride(1) == 1 and isinstance(weight, torch.Tensor)
            and skinny_gemm.splits_k(x.shape[0], weight)):
        return skinny_gemm.skinny_gemm_partials(x, weight, weight_scale), bias
    return linear(x, weight, bias, weight_scale), None


def norm_in_reduce(num_tokens: int, weight: torch.Tensor | IntWeight, residual: torch.Tensor,
                   norm_weight: torch.Tensor) -> bool:
    """Whether ``linear_add_rms_norm`` of num_tokens rows takes the one-reduce path: CUDA
    and a size the skinny GEMM splits K at (o_proj and down
    at decode batch sizes); see ``skinny_gemm.serves_add_rms_norm`` (a packed integer
    weight: ``int_gemm.serves_add_rms_norm``)."""
    if isinstance(weight, IntWeight):
        return residual.is_cuda and int_gemm.serves_add_rms_norm(num_tokens, weight, residual,
                                                                  norm_weight)
    return residual.is_cuda and skinny_gemm.serves_add_rms_norm(num_tokens, weight, residual,
                                                                 norm_weight)


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> None:
    """Rotate query [num_tokens, num_heads, head_dim] and key [.., num_kv_heads, ..] in place."""
    op = rotary.apply_rotary if query.is_cuda else rotary.apply_rotary_ref
    op(query, key, positions, cos_sin_cache)


def apply_rotary_fp32(query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """In place, each token by its own cos/sin row, fp32 math (a vision tower's rotary)."""
    op = rotary.apply_rotary_fp32 if query.is_cuda else rotary.apply_rotary_fp32_ref
    op(query, key, cos_sin)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[num_tokens, 2 * intermediate_size] -> [num_tokens, intermediate_size]."""
    op = activation.silu_and_mul if gate_up.is_cuda else activation.silu_and_mul_ref
    return op(gate_up)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim] to their slots; an FP8 cache holds
    them divided by k_scale and v_scale."""
    op = kv_cache.write_kv_cache if key.is_cuda else paged_attention_ref.write_kv_cache_ref
    op(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)


def rotary_and_write_kv_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                              key_cache: torch.Tensor, value_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> None:
    """apply_rotary then write_kv_cache (one kernel on CUDA): query [num_tokens, num_heads,
    head_dim] and key are rotated in place; the rotated keys and the values go to their slots."""
    op = (kv_cache.rotary_and_write_kv_cache if query.is_cuda
          else kv_cache.rotary_and_write_kv_cache_ref)
    op(query, key, value, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
       k_scale, v_scale)


def attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              metadata, scale: float,
              decode_context: cpu_attention.DecodeContext | None = None,
              out: torch.Tensor | None = None, k_scale: float = 1.0,
              v_scale: float = 1.0, batch_invariant: bool = False) -> torch.Tensor:
    """Causal paged attention of the step's queries [num_tokens, num_heads, head_dim]
    (written into ``out`` when given); an FP8 cache's scales k_scale and v_scale.

    On CPU, ``decode_context`` (the layer's copy of its decode rows' context) spares the
    decodes a gather of their whole context each step; without it, the reference."""
    if not query.is_cuda and key_cache.dtype == paged_attention_ref.FP8_KV_DTYPE:
        result = paged_attention_ref.paged_attention_ref(  # (tests: the worker refuses it)
            query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, scale, k_scale, v_scale)
        return result if out is None else out.copy_(result)
    if not query.is_cuda:
        result = cpu_attention.attention(query, key_cache, value_cache, metadata, scale,
                                         decode_context)
        return result if out is None else out.copy_(result)
    if out is None:  # (allocated here, not in the planning too)
        out = torch.empty_like(query)
    # planned at the step's first layer, kept on its metadata for the layers after it
    plan = metadata.attention_plan
    if plan is None or not plan.fits(query, key_cache, value_cache, out, batch_invariant):
        plan = metadata.attention_plan = paged_attention.plan_attention(
            query, key_cache, value_cache, metadata.block_tables, metadata.seq_lens,
            metadata.query_start_loc, max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len, num_decodes=metadata.num_decodes, out=out,
            batch_invariant=batch_invariant)
    return plan.run(query, key_cache, value_cache, scale, out=out, k_scale=k_scale,
                    v_scale=v_scale)
