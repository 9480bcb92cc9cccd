"""Scatter this step's keys and values into the paged KV cache (Triton).

Same semantics as ``write_kv_cache_ref`` in ``kernels/paged_attention.py`` (the reference), plus one
rule the reference does not have: a token whose slot is negative is skipped, so padding tokens of a
CUDA-graph batch can carry slot -1 and write nothing.

One program per token copies all of its KV heads; key and value may be strided views (split from a
fused qkv output) as long as head_dim is contiguous. The launcher never reads device data on the
host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_offset, cache_stride_head,
    num_kv_heads, head_dim, block_size,
    BLOCK_HEADS: tl.constexpr, BLOCK_DIM: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
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
        tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
        value = tl.load(value_ptr + token * value_stride_token + heads * value_stride_head + dims,
                        mask=mask)
        tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty),
                 mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                   value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter this step's keys and values into their slots (in place).

    key, value: [num_tokens, num_kv_heads, head_dim] (head_dim contiguous; other strides free)
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (same strides)
    slot_mapping: [num_tokens] int32 or int64, block_id * block_size + offset; < 0 means skip
    """
    num_tokens, num_kv_heads, head_dim = key.shape
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
    if num_tokens == 0:
        return
    _write_kv_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        num_kv_heads, head_dim, key_cache.shape[1],
        BLOCK_HEADS=triton.next_power_of_2(num_kv_heads),
        BLOCK_DIM=triton.next_power_of_2(head_dim),
    )
