"""paged_attention_ref and write_kv_cache_ref against dense causal attention on contiguous K/V."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.paged_attention_ref import allocate_kv_cache, paged_attention_ref, write_kv_cache_ref


def dense_causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                           scale: float) -> torch.Tensor:
    """query: [q_len, num_heads, head_dim] at the last q_len positions of
    keys, values: [seq_len, num_kv_heads, head_dim]. Computed in fp64."""
    q_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    keys = keys.repeat_interleave(group, dim=1).double()  # [seq_len, num_heads, head_dim]
    values = values.repeat_interleave(group, dim=1).double()
    scores = torch.einsum("qhd,khd->hqk", query.double(), keys) * scale  # [num_heads, q_len, seq_len]
    query_positions = torch.arange(seq_len - q_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_positions, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).float()


def make_batch(seqs: list[tuple[int, int]], block_size: int, num_heads: int, num_kv_heads: int,
               head_dim: int, seed: int = 0):
    """seqs: (seq_len, q_len) per sequence. Fills a shuffled paged cache with each full context."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks_per_seq = [math.ceil(seq_len / block_size) for seq_len, _ in seqs]
    num_blocks = sum(num_blocks_per_seq) + 3  # a few blocks nobody uses
    block_order = torch.randperm(num_blocks, generator=gen).tolist()
    kv_cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim,
                                 torch.float32, "cpu")
    key_cache, value_cache = kv_cache[0, 0], kv_cache[0, 1]
    max_blocks = max(num_blocks_per_seq)
    block_tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    queries, contexts = [], []
    for i, ((seq_len, q_len), n) in enumerate(zip(seqs, num_blocks_per_seq)):
        block_ids = [block_order.pop() for _ in range(n)]
        block_tables[i, :n] = torch.tensor(block_ids)
        keys = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        values = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        positions = torch.arange(seq_len)
        slots = torch.tensor(block_ids)[positions // block_size] * block_size + positions % block_size
        write_kv_cache_ref(keys, values, key_cache, value_cache, slots)
        queries.append(torch.randn(q_len, num_heads, head_dim, generator=gen))
        contexts.append((keys, values))
    q_lens = torch.tensor([q_len for _, q_len in seqs])
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.long), q_lens.cumsum(0)]).int()
    seq_lens = torch.tensor([seq_len for seq_len, _ in seqs], dtype=torch.int32)
    query = torch.cat(queries)  # [num_tokens, num_heads, head_dim]
    return query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, contexts


SEQ_SETS = {
    "one_token": [(1, 1)],
    "prompt_at_block_boundary": [(16, 16)],
    "prompt_odd": [(37, 37)],
    "chunk_after_context": [(29, 6)],
    "decodes": [(16, 1), (17, 1), (5, 1), (48, 1)],
    "mixed": [(40, 7), (9, 9), (23, 1), (1, 1), (64, 1), (33, 32), (15, 2)],
    "decodes_then_chunks": [(16, 1), (5, 1), (30, 30), (20, 3)],
    "long_chunk_after_context": [(290, 270), (40, 1)],
}


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (6, 2), (8, 2)])
@pytest.mark.parametrize("seqs_name", list(SEQ_SETS))
def test_paged_attention_matches_dense(block_size, num_heads, num_kv_heads, seqs_name):
    seqs, head_dim = SEQ_SETS[seqs_name], 24
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, contexts = make_batch(
        seqs, block_size, num_heads, num_kv_heads, head_dim)
    scale = head_dim ** -0.5
    out = paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc, scale)
    assert out.shape == query.shape
    starts = query_start_loc.tolist()
    for i, (keys, values) in enumerate(contexts):
        expected = dense_causal_attention(query[starts[i]:starts[i + 1]], keys, values, scale)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], expected, atol=1e-5, rtol=1e-5)


def test_write_kv_cache_puts_tokens_in_their_slots():
    block_size, num_kv_heads, head_dim = 4, 2, 3
    kv_cache = allocate_kv_cache(2, 5, block_size, num_kv_heads, head_dim, torch.float32, "cpu")
    key = torch.randn(3, num_kv_heads, head_dim)
    value = torch.randn(3, num_kv_heads, head_dim)
    slot_mapping = torch.tensor([13, 0, 7])  # block 3 offset 1, block 0 offset 0, block 1 offset 3
    write_kv_cache_ref(key, value, kv_cache[1, 0], kv_cache[1, 1], slot_mapping)
    torch.testing.assert_close(kv_cache[1, 0, 3, 1], key[0])
    torch.testing.assert_close(kv_cache[1, 1, 0, 0], value[1])
    torch.testing.assert_close(kv_cache[1, 0, 1, 3], key[2])
    assert kv_cache[0].abs().sum() == 0  # the other layer's views are untouched
    assert kv_cache[1].count_nonzero() == 2 * 3 * num_kv_heads * head_dim
