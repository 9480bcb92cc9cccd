"""Paged KV cache and attention over it in plain torch: the layout, its allocation, the KV write
and the attention that the Triton kernels (``kernels/paged_attention.py``, ``kernels/kv_cache.py``)
must match. On CPU the worker runs them as its ops (services/worker/ops.py, cpu_attention.py).

Layout (the reference ops and the Triton kernels share it):

- one tensor for the whole cache, ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``;
  layer ``i`` gets the views ``key_cache = kv_cache[i, 0]`` and ``value_cache = kv_cache[i, 1]``,
  each ``[num_blocks, block_size, num_kv_heads, head_dim]``.
- a token's *slot* is ``block_id * block_size + offset``; ``slot_mapping[t]`` says where token ``t``
  of the step is written.
- a sequence's ``block_table`` row lists its block ids in order; rows are padded to the longest with
  any valid block id (0), since padding is gathered and then masked out.

An FP8 cache (``FP8_KV_DTYPE``) holds each layer's keys divided by its ``k_scale`` and values
by its ``v_scale`` (clamped to e4m3's range, rounded to nearest): the attention multiplies them
back, in fp32, before it uses them.

``allocate_kv_cache`` lives here, beside the layout it allocates: the layout is defined in this
module, the allocation is plain torch used on every device, and the kernel modules only read it.

Attention is over a *varlen* batch: the queries of all sequences are packed into one
``[num_tokens, num_heads, head_dim]`` tensor, sequence ``i`` owning rows
``query_start_loc[i]:query_start_loc[i + 1]``. Those queries are the LAST ``q_len`` positions of a
context of ``seq_lens[i]`` tokens whose keys and values are already in the cache (write first, then
attend). That one rule covers a whole prompt, a prompt chunk after earlier chunks or a prefix-cache
hit, and a decode step (``q_len == 1``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import FP8_DTYPE, FP8_MAX

FP8_KV_DTYPE, FP8_KV_MAX = FP8_DTYPE, FP8_MAX  # --kv-cache-dtype fp8: the weights' e4m3


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Zeroed (never NaN, so masked-out slots cannot poison a softmax-weighted sum)."""
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    return torch.zeros(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim,
                       dtype=dtype, device=device)


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """Scatter this step's keys and values into their slots (in place).

    key, value: [num_tokens, num_kv_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] (contiguous)
    slot_mapping: [num_tokens] int, block_id * block_size + offset; < 0 means skip (padding),
        as in the kernel
    k_scale, v_scale: an FP8 cache's scales (it holds x / scale); other caches ignore them
    """
    num_kv_heads, head_dim = key_cache.shape[-2:]
    if key_cache.dtype == FP8_KV_DTYPE:  # (index_copy_ has no FP8 kernel: copied as bytes)
        key = quantize_kv(key, k_scale).view(torch.uint8)
        value = quantize_kv(value, v_scale).view(torch.uint8)
        key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
    slot_mapping = slot_mapping.long()
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        slot_mapping, key, value = slot_mapping[keep], key[keep], value[keep]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x as an FP8 cache holds it: x * (1 / scale) in fp32, clamped, rounded to e4m3."""
    return (x.float() * (1.0 / scale)).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def paged_attention_ref(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                        block_tables: torch.Tensor, seq_lens: torch.Tensor,
                        query_start_loc: torch.Tensor, scale: float, k_scale: float = 1.0,
                        v_scale: float = 1.0) -> torch.Tensor:
    """Causal GQA attention of packed queries over their sequences' cached context.

    query: [num_tokens, num_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: [num_seqs, max_blocks_per_seq] int, padded with a valid block id
    seq_lens: [num_seqs] int, context length including this step's tokens
    query_start_loc: [num_seqs + 1] int, prefix sums of the per-sequence query lengths
    k_scale, v_scale: an FP8 cache's scales (the whole cache is dequantized: a reference)
    returns: [num_tokens, num_heads, head_dim]
    """
    if key_cache.dtype == FP8_KV_DTYPE:
        key_cache = (key_cache.float() * k_scale).to(query.dtype)
        value_cache = (value_cache.float() * v_scale).to(query.dtype)
    output = torch.empty_like(query)  # [num_tokens, num_heads, head_dim]
    seq_len_list = seq_lens.tolist()
    starts = query_start_loc.tolist()
    q_lens = [end - start for start, end in zip(starts[:-1], starts[1:])]
    decode_seq_ids = [i for i, q_len in enumerate(q_lens) if q_len == 1]
    if decode_seq_ids:
        num_decodes = len(decode_seq_ids)
        if decode_seq_ids[-1] == num_decodes - 1:  # decodes lead the batch: slice, don't gather
            decode_rows: slice | list[int] = slice(0, num_decodes)
            decode_tables = block_tables[:num_decodes]
        else:
            decode_rows = [starts[i] for i in decode_seq_ids]
            decode_tables = block_tables[decode_seq_ids]
        output[decode_rows] = _decode_attention(
            query[decode_rows], key_cache, value_cache, decode_tables,
            [seq_len_list[i] for i in decode_seq_ids], scale)
    for i, q_len in enumerate(q_lens):
        if q_len > 1:
            start, end = starts[i], starts[i + 1]
            output[start:end] = _chunk_attention(
                query[start:end], key_cache, value_cache, block_tables[i], seq_len_list[i], scale)
    return output


def _decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: list[int], scale: float) -> torch.Tensor:
    """One query per sequence, all sequences in one padded SDPA call.

    query: [num_decodes, num_heads, head_dim]; block_tables: [num_decodes, max_blocks_per_seq]
    returns: [num_decodes, num_heads, head_dim]
    """
    num_decodes, _, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1:3]
    max_seq_len = max(seq_lens)
    num_context_blocks = -(-max_seq_len // block_size)
    # [num_decodes * num_context_blocks]; index_select is ~4x faster than advanced indexing on CPU
    block_ids = block_tables[:, :num_context_blocks].long().flatten()
    padded_len = num_context_blocks * block_size
    context_shape = (num_decodes, padded_len, num_kv_heads, head_dim)
    # [num_decodes, num_kv_heads, padded_len, head_dim]
    keys = key_cache.index_select(0, block_ids).view(context_shape).transpose(1, 2)
    values = value_cache.index_select(0, block_ids).view(context_shape).transpose(1, 2)
    lens = torch.tensor(seq_lens, device=query.device)  # [num_decodes]
    # [num_decodes, 1, 1, padded_len]: True where the key position exists
    valid = (torch.arange(padded_len, device=query.device)[None, :] < lens[:, None])[:, None, None, :]
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    # The query heads sharing a KV head become rows of one attention problem: the CPU
    # kernel is several times faster on that than with enable_gqa.
    grouped = query.view(num_decodes, num_kv_heads, group, head_dim)
    out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=valid, scale=scale)
    return out.reshape(num_decodes, num_heads, head_dim)


def _chunk_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """The last q_len positions of one sequence attend causally to its first seq_len tokens.

    query: [q_len, num_heads, head_dim]; block_table: [max_blocks_per_seq]
    returns: [q_len, num_heads, head_dim]
    """
    q_len = query.shape[0]
    # [num_kv_heads, seq_len, head_dim]
    keys = gather_context(key_cache, block_table, seq_len).transpose(0, 1)
    values = gather_context(value_cache, block_table, seq_len).transpose(0, 1)
    queries = query.transpose(0, 1)  # [num_heads, q_len, head_dim]
    if q_len == seq_len:  # no earlier context: the plain causal mask is right
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                             enable_gqa=True)
    else:  # query j sits at position seq_len - q_len + j
        return _grouped_chunk_attention(query, keys, values, seq_len, scale)
    return out.transpose(0, 1)  # [q_len, num_heads, head_dim]


# Up to this many queries, a chunk's scores are built explicitly: the causal mask then
# touches only the last q_len columns, where SDPA's masked path scans all of them.
MAX_EXPLICIT_CHUNK = 256


def _grouped_chunk_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                             seq_len: int, scale: float) -> torch.Tensor:
    """The last q_len positions attend causally to all seq_len positions, with the query
    heads sharing a KV head folded into rows: one problem per KV head.

    query: [q_len, num_heads, head_dim]; keys, values: [num_kv_heads, seq_len, head_dim]
    returns: [q_len, num_heads, head_dim]
    """
    q_len, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[0]
    group = num_heads // num_kv_heads
    # [num_kv_heads, group * q_len, head_dim]: head h = kv_head * group + g
    rows = query.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    rows = rows.reshape(num_kv_heads, group * q_len, head_dim)
    # query j (position seq_len - q_len + j) must not see chunk key i > j
    future = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).triu(1)
    if q_len <= MAX_EXPLICIT_CHUNK:
        scores = torch.bmm(rows, keys.transpose(1, 2)).mul_(scale)  # [kv, group * q_len, seq_len]
        chunk_scores = scores.view(num_kv_heads, group, q_len, seq_len)[..., seq_len - q_len:]
        chunk_scores.masked_fill_(future, float("-inf"))
        out = torch.bmm(scores.softmax(dim=-1), values)  # [kv, group * q_len, head_dim]
    else:
        visible = torch.ones(q_len, seq_len, dtype=torch.bool, device=query.device)
        visible[:, seq_len - q_len:] = ~future
        out = F.scaled_dot_product_attention(rows, keys, values,
                                             attn_mask=visible.repeat(group, 1), scale=scale)
    out = out.view(num_kv_heads, group, q_len, head_dim).permute(2, 0, 1, 3)
    return out.reshape(q_len, num_heads, head_dim)


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first seq_len cached tokens of one sequence, contiguous.

    cache: [num_blocks, block_size, num_kv_heads, head_dim]; block_table: [max_blocks_per_seq]
    returns: [seq_len, num_kv_heads, head_dim]
    """
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    num_context_blocks = -(-seq_len // block_size)
    # [n, block_size, num_kv_heads, head_dim]
    blocks = cache.index_select(0, block_table[:num_context_blocks].long())
    return blocks.view(-1, num_kv_heads, head_dim)[:seq_len]
