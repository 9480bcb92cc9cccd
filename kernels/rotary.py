"""Rotate-half ("neox") rotary embedding of queries and keys, in place (Triton).

``cos_sin_cache`` ([max_positions, head_dim] fp32) holds, for each position, cos of the
``head_dim // 2`` angles in its first half and their sin in the second; ``build_cos_sin_cache``
makes it from the model's inverse frequencies (``compute_inv_freq`` in services/worker/model.py,
which already applies the Llama-3.1 scaling).

Numerics are Hugging Face's, rounding for rounding: cos and sin are cast to the activation dtype,
then ``x * cos`` and ``rotate_half(x) * sin`` are each rounded to that dtype before the add, as the
torch expression ``x * cos + rotated * sin`` does in bf16/fp16. The Triton kernel rounds each
product the same way and is compiled without FMA contraction, so it matches the reference exactly
(in fp32 too, up to the cos/sin values, which come from the same cache).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl


@triton.jit
def _rotated_heads(x_ptr, stride_token, stride_head, token, num_heads, cos, sin, half,
                   BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
                   ROUND_PRODUCTS: tl.constexpr):
    """All heads of one token, rotated, in x's dtype: (first half, second half), each
    [BLOCK_HEADS, BLOCK_HALF], with the mask of real heads and dims. cos, sin: [1, BLOCK_HALF]
    fp32 (for ROUND_PRODUCTS, already rounded to x's dtype: the LM's numerics; without, fp32
    math rounded once: a vision tower's)."""
    dtype = x_ptr.dtype.element_ty
    heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    mask = (heads < num_heads) & (dims < half)
    first = x_ptr + token * stride_token + heads * stride_head + dims  # [BLOCK_HEADS, BLOCK_HALF]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + half, mask=mask, other=0.0).to(tl.float32)
    # ROUND_PRODUCTS: each product rounded to the activation dtype before the sum, as torch does
    if ROUND_PRODUCTS:
        out1 = (x1 * cos).to(dtype).to(tl.float32) - (x2 * sin).to(dtype).to(tl.float32)
        out2 = (x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)
    else:
        out1 = x1 * cos - x2 * sin
        out2 = x2 * cos + x1 * sin
    return out1.to(dtype), out2.to(dtype), mask


@triton.jit
def _rotate_heads(x_ptr, stride_token, stride_head, token, num_heads, cos, sin, half,
                  BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
                  ROUND_PRODUCTS: tl.constexpr):
    """Rotate all heads of one token in place. cos, sin: [1, BLOCK_HALF] fp32."""
    out1, out2, mask = _rotated_heads(x_ptr, stride_token, stride_head, token, num_heads,
                                      cos, sin, half, BLOCK_HEADS, BLOCK_HALF, ROUND_PRODUCTS)
    heads = tl.arange(0, BLOCK_HEADS)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    first = x_ptr + token * stride_token + heads * stride_head + dims
    tl.store(first, out1, mask=mask)
    tl.store(first + half, out2, mask=mask)


@triton.jit
def _cos_sin(positions_ptr, cos_sin_cache_ptr, cache_stride, token, half,
             BLOCK_HALF: tl.constexpr):
    """cos and sin of the token's position, [1, BLOCK_HALF] fp32 each."""
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    cache_row = cos_sin_cache_ptr + position * cache_stride + dims
    cos = tl.load(cache_row, mask=dims < half, other=0.0)
    sin = tl.load(cache_row + half, mask=dims < half, other=0.0)
    return cos, sin


@triton.jit
def _apply_rotary_kernel(
    query_ptr, key_ptr, positions_ptr, cos_sin_cache_ptr,
    query_stride_token, query_stride_head, key_stride_token, key_stride_head, cache_stride,
    num_heads, num_kv_heads, half,
    BLOCK_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pdl.wait_then_launch_dependents(PDL)
    cos, sin = _cos_sin(positions_ptr, cos_sin_cache_ptr, cache_stride, token, half, BLOCK_HALF)
    # cos and sin rounded to the activation dtype, as HF does before the products
    q_cos = cos.to(query_ptr.dtype.element_ty).to(tl.float32)
    q_sin = sin.to(query_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(query_ptr, query_stride_token, query_stride_head, token, num_heads,
                  q_cos, q_sin, half, BLOCK_HEADS, BLOCK_HALF, True)
    k_cos = cos.to(key_ptr.dtype.element_ty).to(tl.float32)
    k_sin = sin.to(key_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(key_ptr, key_stride_token, key_stride_head, token, num_kv_heads,
                  k_cos, k_sin, half, BLOCK_KV_HEADS, BLOCK_HALF, True)


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int) -> torch.Tensor:
    """inv_freq: [head_dim // 2] -> [max_positions, head_dim] fp32: cos then sin of each angle.

    The angles are ``position * inv_freq`` in fp32, the same product the model computes, on
    inv_freq's device (build it on the device that runs the model).
    """
    positions = torch.arange(max_positions, dtype=torch.int64, device=inv_freq.device).float()
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_positions, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1)


def _check(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    num_tokens, _, head_dim = query.shape
    if key.shape[0] != num_tokens or key.shape[2] != head_dim or positions.shape != (num_tokens,):
        raise ValueError(f"shape mismatch: query {tuple(query.shape)}, key {tuple(key.shape)}, "
                         f"positions {tuple(positions.shape)}")
    if head_dim % 2 or cos_sin_cache.shape[-1] != head_dim:
        raise ValueError(f"cos_sin_cache {tuple(cos_sin_cache.shape)} does not fit head_dim "
                         f"{head_dim} (even, rotary over the whole head)")


def apply_rotary(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> None:
    """Rotate query and key in place by their tokens' positions.

    query: [num_tokens, num_heads, head_dim]; key: [num_tokens, num_kv_heads, head_dim]
    (head_dim contiguous; token and head strides free, e.g. views split from a fused qkv output)
    positions: [num_tokens] int; cos_sin_cache: [max_positions, head_dim] fp32
    """
    _check(query, key, positions, cos_sin_cache)
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("head_dim must be contiguous in query, key and cos_sin_cache")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return
    _apply_rotary_kernel[(num_tokens,)](
        query, key, positions, cos_sin_cache,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_heads, num_kv_heads, head_dim // 2,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False,  # an FMA would skip the rounding of one product: not HF's numbers
        **pdl.launch_options(),
    )


def apply_rotary_ref(query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor) -> None:
    """Plain torch, same semantics as apply_rotary (the model's rotate-half expression)."""
    _check(query, key, positions, cos_sin_cache)
    cos, sin = cos_sin_cache[positions.long()].chunk(2, dim=-1)  # [num_tokens, head_dim // 2]
    cos, sin = torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1)
    for x in (query, key):  # cos, sin: [num_tokens, head_dim]
        x_cos, x_sin = cos.to(x.dtype)[:, None, :], sin.to(x.dtype)[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
        x.copy_(x * x_cos + rotated * x_sin)


@triton.jit
def _rotary_fp32_kernel(query_ptr, key_ptr, cos_sin_ptr, query_stride_token, query_stride_head,
                        key_stride_token, key_stride_head, cos_sin_stride, num_heads, half,
                        BLOCK_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + token * cos_sin_stride + dims
    cos = tl.load(row, mask=dims < half, other=0.0)
    sin = tl.load(row + half, mask=dims < half, other=0.0)
    _rotate_heads(query_ptr, query_stride_token, query_stride_head, token, num_heads,
                  cos, sin, half, BLOCK_HEADS, BLOCK_HALF, False)
    _rotate_heads(key_ptr, key_stride_token, key_stride_head, token, num_heads,
                  cos, sin, half, BLOCK_HEADS, BLOCK_HALF, False)


def apply_rotary_fp32(query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor) -> None:
    """Rotate query and key in place by each token's own angles, in fp32 math rounded once
    (the numerics of transformers' vision rotary, e.g. Qwen2.5-VL's tower, where the LM's
    apply_rotary rounds each product): query, key [num_tokens, num_heads, head_dim] (head_dim
    contiguous), cos_sin [num_tokens, head_dim] fp32: each token's cos, then sin, of its
    head_dim // 2 angles."""
    num_tokens, num_heads, head_dim = query.shape
    if key.shape != query.shape or cos_sin.shape != (num_tokens, head_dim) \
            or cos_sin.dtype != torch.float32:
        raise ValueError(f"query {tuple(query.shape)}, key {tuple(key.shape)}, cos_sin "
                         f"{tuple(cos_sin.shape)} {cos_sin.dtype}: not one fp32 row a token")
    if query.stride(-1) != 1 or key.stride(-1) != 1 or cos_sin.stride(-1) != 1:
        raise ValueError("head_dim must be contiguous in query, key and cos_sin")
    if num_tokens == 0:
        return
    _rotary_fp32_kernel[(num_tokens,)](
        query, key, cos_sin, query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        cos_sin.stride(0), num_heads, head_dim // 2,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        enable_fp_fusion=False)  # an FMA would round x1 * cos once less than torch does


def apply_rotary_fp32_ref(query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor
                          ) -> None:
    """Plain torch, same semantics as apply_rotary_fp32."""
    cos, sin = cos_sin.chunk(2, dim=-1)
    cos, sin = torch.cat((cos, cos), -1)[:, None], torch.cat((sin, sin), -1)[:, None]
    for x in (query, key):
        h = x.float()
        half = h.shape[-1] // 2
        rotated = torch.cat((-h[..., half:], h[..., :half]), dim=-1)
        x.copy_(h * cos + rotated * sin)
