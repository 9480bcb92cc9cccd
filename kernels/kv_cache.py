"""Scatter this step's keys and values into the paged KV cache (Triton).

Same semantics as ``write_kv_cache_ref`` in ``kernels/paged_attention_ref.py`` (the reference,
with the cache layout): a token whose slot is negative is skipped, so padding tokens of a CUDA-graph
batch can carry slot -1 and write nothing.

``rotary_and_write_kv_cache`` also rotates the token's query and key first (kernels/rotary.py's
numerics): one launch a layer instead of two.

An FP8 cache (``torch.float8_e4m3fn``, ``--kv-cache-dtype fp8``) stores ``x * (1 / scale)``
clamped to e4m3's range and rounded to nearest, with one scale for a layer's keys and one for
its values (services/worker/kv_quant.py chooses them); any other cache gets an exact cast.

One program per token copies all of its KV heads; key and value may be strided views (split from a
fused qkv output) as long as head_dim is contiguous. The launcher never reads device data on the
host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.paged_attention_ref import FP8_KV_DTYPE, FP8_KV_MAX, write_kv_cache_ref
from kernels.rotary import _check as _check_rotary
from kernels.rotary import _cos_sin, _rotate_heads, _rotated_heads, apply_rotary_ref

_E4M3_MAX = tl.constexpr(FP8_KV_MAX)


@triton.jit
def _to_cache(x, inv_scale, cache_ptr, FP8: tl.constexpr):
    """x as the cache stores it: scaled, clamped and rounded into e4m3 (FP8), else cast."""
    if FP8:
        x = tl.clamp(x.to(tl.float32) * inv_scale, -_E4M3_MAX, _E4M3_MAX)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_offset, cache_stride_head,
    num_kv_heads, head_dim, block_size, k_inv_scale, v_inv_scale,
    BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pdl.wait_then_launch_dependents(PDL)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding token: nothing is read or written
        heads = tl.arange(0, BLOCK_HEADS)[:, None]  # [BLOCK_HEADS, 1]
        dims = tl.arange(0, BLOCK_DIM)[None, :]  # [1, BLOCK_DIM]
        mask = (heads < num_kv_heads) & (dims < head_dim)
        block_id = slot // block_size
        block_offset = slot % block_size
        cache_offsets = (block_id * cache_stride_block + block_offset * cache_stride_offset
                         + heads * cache_stride_head + dims)  # [BLOCK_HEADS, BLOCK_DIM]
        key = tl.load(key_ptr + token * key_stride_token + heads * key_stride_head + dims,
                      mask=mask)
        tl.store(key_cache_ptr + cache_offsets, _to_cache(key, k_inv_scale, key_cache_ptr, FP8),
                 mask=mask)
        value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims,
                        mask=mask)
        tl.store(value_cache_ptr + cache_offsets,
                 _to_cache(value, v_inv_scale, value_cache_ptr, FP8), mask=mask)


def _check_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
              value_cache: torch.Tensor) -> None:
    _, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape or key_cache.shape != value_cache.shape:
        raise ValueError(f"shape mismatch: key {tuple(key.shape)}, value {tuple(value.shape)}, "
                         f"caches {tuple(key_cache.shape)}, {tuple(value_cache.shape)}")
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache {tuple(key_cache.shape)} does not hold "
                         f"[{num_kv_heads}, {head_dim}] heads")
    if key_cache.stride() != value_cache.stride():
        raise ValueError("key_cache and value_cache must have the same strides")
    if key.stride(-1) != 1 or value.stride(-1) != 1 or key_cache.stride(-1) != 1:
        raise ValueError("head_dim must be contiguous in key, value and the caches")


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter this step's keys and values into their slots (in place).

    key, value: [num_tokens, num_kv_heads, head_dim] (head_dim contiguous; other strides free)
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (same strides)
    slot_mapping: [num_tokens] int32 or int64, block_id * block_size + offset; < 0 means skip
    k_scale, v_scale: an FP8 cache's scales (the cache holds x / scale); others ignore them
    """
    _check_kv(key, value, key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim, key_cache.shape[1], 1.0 / k_scale, 1.0 / v_scale,
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_DIM=triton.next_power_of_2(head_dim), FP8=key_cache.dtype == FP8_KV_DTYPE,
        **pdl.launch_options(),
    )


@triton.jit
def _rotary_write_kv_cache_kernel(
    query_ptr, key_ptr, value_ptr, positions_ptr, cos_sin_cache_ptr,
    key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    query_stride_token, query_stride_head, key_stride_token, key_stride_head,
    value_stride_token, value_stride_head, cos_sin_stride,
    cache_stride_block, cache_stride_offset, cache_stride_head,
    num_heads, num_kv_heads, head_dim, block_size, k_inv_scale, v_inv_scale,
    BLOCK_HEADS: tl.constexpr, BLOCK_KV_HEADS: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_DIM: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):
    """Program per token: rotate its query heads and key heads in place (as
    ``_apply_rotary_kernel``), and write the rotated keys and the values to its slot."""
    token = tl.program_id(0).to(tl.int64)
    pdl.wait_then_launch_dependents(PDL)
    half = head_dim // 2
    cos, sin = _cos_sin(positions_ptr, cos_sin_cache_ptr, cos_sin_stride, token, half, BLOCK_HALF)
    # cos and sin rounded to the activation dtype, as HF does before the products
    q_cos = cos.to(query_ptr.dtype.element_ty).to(tl.float32)
    q_sin = sin.to(query_ptr.dtype.element_ty).to(tl.float32)
    _rotate_heads(query_ptr, query_stride_token, query_stride_head, token, num_heads,
                  q_cos, q_sin, half, BLOCK_HEADS, BLOCK_HALF, True)
    k_cos = cos.to(key_ptr.dtype.element_ty).to(tl.float32)
    k_sin = sin.to(key_ptr.dtype.element_ty).to(tl.float32)
    key1, key2, half_mask = _rotated_heads(key_ptr, key_stride_token, key_stride_head, token,
                                           num_kv_heads, k_cos, k_sin, half, BLOCK_KV_HEADS,
                                           BLOCK_HALF, True)
    kv_heads = tl.arange(0, BLOCK_KV_HEADS)[:, None]  # [BLOCK_KV_HEADS, 1]
    half_dims = tl.arange(0, BLOCK_HALF)[None, :]  # [1, BLOCK_HALF]
    key_first = key_ptr + token * key_stride_token + kv_heads * key_stride_head + half_dims
    tl.store(key_first, key1, mask=half_mask)  # the rotated key in place too, as the two ops
    tl.store(key_first + half, key2, mask=half_mask)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is a padding token: nothing is written to the cache
        cache_row = ((slot // block_size) * cache_stride_block
                     + (slot % block_size) * cache_stride_offset)
        key_cache_first = key_cache_ptr + cache_row + kv_heads * cache_stride_head + half_dims
        tl.store(key_cache_first, _to_cache(key1, k_inv_scale, key_cache_ptr, FP8), mask=half_mask)
        tl.store(key_cache_first + half, _to_cache(key2, k_inv_scale, key_cache_ptr, FP8),
                 mask=half_mask)
        dims = tl.arange(0, BLOCK_DIM)[None, :]  # [1, BLOCK_DIM]
        mask = (kv_heads < num_kv_heads) & (dims < head_dim)
        value = tl.load(value_ptr + token * value_stride_token + kv_heads * value_stride_head
                        + dims, mask=mask)
        tl.store(value_cache_ptr + cache_row + kv_heads * cache_stride_head + dims,
                 _to_cache(value, v_inv_scale, value_cache_ptr, FP8), mask=mask)


def rotary_and_write_kv_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                              positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                              key_cache: torch.Tensor, value_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, k_scale: float = 1.0,
                              v_scale: float = 1.0) -> None:
    """``apply_rotary(query, key, ...)`` then ``write_kv_cache(key, value, ...)`` in one launch
    (the same numbers: rotary's rounding, then the cache's cast).

    query: [num_tokens, num_heads, head_dim]; key, value: [num_tokens, num_kv_heads, head_dim]
    (head_dim contiguous; e.g. views split from a fused qkv output); positions: [num_tokens];
    cos_sin_cache: [max_positions, head_dim] fp32; caches and slot_mapping as in
    ``write_kv_cache`` (a negative slot writes nothing), k_scale and v_scale too
    """
    _check_rotary(query, key, positions, cos_sin_cache)
    _check_kv(key, value, key_cache, value_cache)
    if query.stride(-1) != 1 or cos_sin_cache.stride(-1) != 1:
        raise ValueError("head_dim must be contiguous in query and cos_sin_cache")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return
    _rotary_write_kv_cache_kernel[(num_tokens,)](
        query, key, value, positions, cos_sin_cache, key_cache, value_cache, slot_mapping,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), cos_sin_cache.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_heads, num_kv_heads, head_dim, key_cache.shape[1], 1.0 / k_scale, 1.0 / v_scale,
        BLOCK_HEADS=triton.next_power_of_2(num_heads),
        BLOCK_KV_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2),
        BLOCK_DIM=triton.next_power_of_2(head_dim), FP8=key_cache.dtype == FP8_KV_DTYPE,
        enable_fp_fusion=False,  # an FMA would skip the rounding of one product: not HF's numbers
        **pdl.launch_options(),
    )


def rotary_and_write_kv_cache_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                  positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                                  key_cache: torch.Tensor, value_cache: torch.Tensor,
                                  slot_mapping: torch.Tensor, k_scale: float = 1.0,
                                  v_scale: float = 1.0) -> None:
    """Plain torch: the two reference ops."""
    apply_rotary_ref(query, key, positions, cos_sin_cache)
    write_kv_cache_ref(key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
