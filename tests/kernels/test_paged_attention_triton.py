"""The Triton paged_attention against paged_attention_ref and dense fp64 attention.

On CPU this runs under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 before any
kernel module is imported); shapes stay small. The `gpu` tests use real model shapes.
Note: the interpreter (Triton 3.9) computes tl.dot on bf16 inputs from their raw bits, so bf16 is
checked on the GPU only; fp16 runs on both.
"""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import (AttentionConfig, choose_num_segments,
                                     decode_workspace_numel, default_config, paged_attention,
                                     workspace_numel)
from kernels.paged_attention_ref import paged_attention_ref
from tests.kernels.test_paged_attention import dense_causal_attention, make_batch

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SEQ_SETS = {  # (seq_len, q_len) per sequence
    "single_decode": [(37, 1)],
    "many_decodes": [(16, 1), (17, 1), (5, 1), (48, 1), (1, 1), (100, 1), (33, 1), (15, 1)],
    "prompt": [(33, 33)],
    "prompt_odd_long": [(100, 100)],
    "chunk_after_context": [(100, 17)],
    "chunks": [(29, 6), (64, 16), (15, 15), (80, 18)],  # (80, 18): first query at 62
    "mixed": [(40, 7), (9, 9), (23, 1), (1, 1), (64, 1), (33, 32), (15, 2)],
    # block (16) and key-tile (64) edges: a decode's last key at 62, 63, 64, 126
    "block_boundaries": [(16, 16), (32, 1), (17, 1), (15, 15), (48, 16), (8, 1), (63, 1), (64, 1),
                         (65, 1), (127, 1)],
}
SMALL_TILES = AttentionConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


def run(seqs, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32,
        dense=False, **kwargs):
    """The kernel's output (written over a NaN-poisoned buffer), the reference's, and optionally
    dense fp64 attention per sequence; all fp32."""
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, contexts = make_batch(
        seqs, block_size, num_heads, num_kv_heads, head_dim)
    query, key_cache, value_cache = (t.to(dtype) for t in (query, key_cache, value_cache))
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    returned = paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                               query_start_loc, scale, max_query_len=max(q for _, q in seqs),
                               max_seq_len=max(s for s, _ in seqs), out=out, **kwargs)
    assert returned is out and out.dtype == dtype
    assert not out.isnan().any(), "some output elements were never written"
    ref = paged_attention_ref(query.float(), key_cache.float(), value_cache.float(), block_tables,
                              seq_lens, query_start_loc, scale)
    expected = None
    if dense:
        starts = query_start_loc.tolist()
        expected = torch.cat([dense_causal_attention(query[starts[i]:starts[i + 1]], keys, values,
                                                     scale)
                              for i, (keys, values) in enumerate(contexts)])
    return out.float(), ref, expected


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("seqs_name", list(SEQ_SETS))
def test_matches_reference_and_dense(seqs_name):
    out, ref, dense = run(SEQ_SETS[seqs_name], dense=True)
    assert rel_error(out, ref) < 1e-4
    assert rel_error(out, dense) < 1e-4


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (6, 2), (4, 1), (8, 1)])
@pytest.mark.parametrize("seqs_name", ["many_decodes", "mixed"])
def test_gqa_ratios(num_heads, num_kv_heads, seqs_name):
    out, ref, _ = run(SEQ_SETS[seqs_name], num_heads, num_kv_heads)
    assert rel_error(out, ref) < 1e-4


@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_block_sizes(block_size):
    out, ref, _ = run(SEQ_SETS["block_boundaries"] + [(100, 1)], block_size=block_size)
    assert rel_error(out, ref) < 1e-4


def test_padded_head_dim():
    out, ref, dense = run(SEQ_SETS["mixed"], head_dim=80, dense=True)
    assert rel_error(out, ref) < 1e-4 and rel_error(out, dense) < 1e-4


@pytest.mark.parametrize("num_segments", [2, 4, 8])
def test_split_kv_decodes(num_segments):
    out, ref, _ = run(SEQ_SETS["many_decodes"], 6, 2, num_segments=num_segments)
    assert rel_error(out, ref) < 1e-4


def test_split_kv_mixed_and_more_segments_than_blocks():
    # 8 segments of a 1-token context: most segments are empty and must weigh nothing
    out, ref, _ = run(SEQ_SETS["mixed"], 4, 1, num_segments=8)
    assert rel_error(out, ref) < 1e-4


def test_a_short_chunk_after_a_long_context_splits_it():
    """A prefix-cache hit's last chunk (few queries, long context) runs split-KV unforced."""
    from kernels.attention_configs import CHUNK_CONFIG, PREFILL_CONFIG, choose_chunk_segments

    assert choose_chunk_segments(1, 16, 16, 16384, 4, 8, CHUNK_CONFIG, 132) == 64
    assert choose_chunk_segments(1, 8192, 8192, 8192, 4, 8, PREFILL_CONFIG, 132) == 1
    assert choose_chunk_segments(1, 512, 512, 1024, 4, 8, PREFILL_CONFIG, 132) == 1  # ratio 2
    assert choose_chunk_segments(16, 8192, 512, 16384, 4, 8, PREFILL_CONFIG, 132) == 1  # full GPU
    seqs = [(1200, 1), (1500, 7), (900, 3)]  # a decode first, then two short chunks
    assert choose_chunk_segments(2, 10, 7, 1500, 2, 2, CHUNK_CONFIG, 16) > 1
    out, ref, _ = run(seqs, 4, 2, num_decodes=1)
    assert rel_error(out, ref) < 1e-4


def test_small_tiles_search_sequences():
    # 16-row tiles hold 2 queries of a group of 8: programs must find their sequence on device
    seqs = SEQ_SETS["mixed"] + [(100, 17)]
    out, ref, _ = run(seqs, 8, 1, chunk_config=SMALL_TILES, decode_config=SMALL_TILES)
    assert rel_error(out, ref) < 1e-4


def test_small_tiles_many_sequences_span_search_chunks(monkeypatch):
    import kernels.paged_attention as pa

    monkeypatch.setattr(pa, "SEQ_CHUNK", 4)  # several vector loads per sequence search
    seqs = [(9, 3), (20, 5), (3, 3), (40, 2), (17, 9), (8, 8), (30, 4), (12, 6), (5, 2), (33, 7)]
    out, ref, _ = run(seqs, 4, 1, chunk_config=SMALL_TILES)
    assert rel_error(out, ref) < 1e-4


def test_decodes_first_as_their_own_launch():
    seqs = [(23, 1), (1, 1), (64, 1), (40, 7), (9, 9), (33, 32), (15, 2)]
    out, ref, _ = run(seqs, num_decodes=3)
    assert rel_error(out, ref) < 1e-4
    out, ref, _ = run(seqs, num_decodes=3, num_segments=2, chunk_config=SMALL_TILES)
    assert rel_error(out, ref) < 1e-4


def test_fp16():
    out, ref, _ = run(SEQ_SETS["mixed"], dtype=torch.float16)
    assert rel_error(out, ref) < 2e-3
    out, ref, _ = run(SEQ_SETS["many_decodes"], dtype=torch.float16, num_segments=4)
    assert rel_error(out, ref) < 2e-3


def test_upper_bounds_and_padding_sequences():
    """A graph-padded batch: bounds above the real lengths, and empty sequences at the end."""
    seqs = [(37, 1), (5, 1), (64, 1)]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _ = make_batch(
        seqs, 16, 4, 2, 64)
    ref = paged_attention_ref(query, key_cache, value_cache, block_tables, seq_lens,
                              query_start_loc, 0.125)
    block_tables = torch.cat([block_tables, torch.zeros_like(block_tables[:2])])
    seq_lens = torch.cat([seq_lens, torch.zeros(2, dtype=seq_lens.dtype)])
    query_start_loc = torch.cat([query_start_loc, query_start_loc[-1:].repeat(2)])
    for num_segments in (None, 4):
        out = torch.full_like(query, float("nan"))
        paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                        0.125, max_query_len=1, max_seq_len=4096, out=out,
                        num_segments=num_segments)
        assert rel_error(out, ref) < 1e-4


def test_workspace_given_or_too_small():
    seqs = SEQ_SETS["many_decodes"]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _ = make_batch(
        seqs, 16, 4, 2, 64)
    args = (query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 0.125)
    kwargs = dict(max_query_len=1, max_seq_len=100, num_segments=4)
    numel = workspace_numel(len(seqs), 4, 64, 4)
    workspace = torch.full((numel,), float("nan"))
    out = paged_attention(*args, workspace=workspace, **kwargs)
    assert rel_error(out, paged_attention_ref(*args)) < 1e-4
    with pytest.raises(ValueError, match="workspace"):
        paged_attention(*args, workspace=workspace[:-1], **kwargs)


def test_bad_inputs_are_refused():
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _ = make_batch(
        [(5, 1)], 16, 6, 4, 64)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                        0.1, max_query_len=1, max_seq_len=5)
    with pytest.raises(ValueError, match="power of 2"):
        paged_attention(query[:, :4], key_cache, value_cache, block_tables, seq_lens,
                        query_start_loc, 0.1, max_query_len=1, max_seq_len=5, num_segments=3)


def test_host_side_choices():
    assert choose_num_segments(64, 8, 16384, 132) == 1  # 512 programs fill 132 SMs already
    assert choose_num_segments(1, 8, 16384, 132) == 64  # 8 programs -> 512
    assert choose_num_segments(16, 8, 16384, 132) == 4  # 128 programs -> 512
    assert choose_num_segments(1, 8, 1024, 132) == 16  # no piece under MIN_SEGMENT_LEN
    assert choose_num_segments(1, 8, 100, 132) == 1
    assert default_config(1, 4, torch.bfloat16).block_m == 16
    assert default_config(1, 32, torch.bfloat16).block_m == 32  # the group must fit a tile
    assert default_config(512, 4, torch.bfloat16).block_m == 128
    assert default_config(512, 4, torch.float32).block_n <= 32
    assert workspace_numel(3, 8, 80, 1) == 0 and workspace_numel(3, 8, 80, 4) == 3 * 8 * 4 * 130
    assert decode_workspace_numel(1, 8, 2, 64, 1024, "cpu") == 8 * 16 * 66  # 16 "SMs" on CPU


# ---------------------------------------------------------------------------------------------
# GPU: real shapes (run on the device machine: pytest -m gpu tests/kernels)
# ---------------------------------------------------------------------------------------------

MODELS = {"llama-3.1-8b": (32, 8, 128), "qwen3-0.6b": (16, 8, 128)}  # heads, kv heads, head_dim
GPU_TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-4}


def gpu_batch(seqs, num_heads, num_kv_heads, head_dim, dtype, block_size=16, seed=0):
    """Random paged cache on the GPU with shuffled blocks; (seq_len, q_len) per sequence."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for seq_len, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 7
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen,
                        device="cuda").to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device="cuda").int()
    block_tables = torch.zeros(len(seqs), max(blocks_per_seq), dtype=torch.int32, device="cuda")
    first = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = order[first:first + n]
        first += n
    q_lens = torch.tensor([q for _, q in seqs], device="cuda")
    query_start_loc = torch.cat([q_lens.new_zeros(1), q_lens.cumsum(0)]).int()
    seq_lens = torch.tensor([s for s, _ in seqs], dtype=torch.int32, device="cuda")
    query = torch.randn(int(q_lens.sum()), num_heads, head_dim, generator=gen,
                        device="cuda").to(dtype)
    return query, cache[0], cache[1], block_tables, seq_lens, query_start_loc


def check_gpu(seqs, model, dtype, **kwargs):
    num_heads, num_kv_heads, head_dim = MODELS[model]
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = gpu_batch(
        seqs, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = torch.full_like(query, float("nan"))
    paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
                    max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs),
                    out=out, **kwargs)
    assert not out.isnan().any()
    ref = paged_attention_ref(query.float(), key_cache.float(), value_cache.float(), block_tables,
                              seq_lens, query_start_loc, scale)
    assert rel_error(out.float(), ref) < GPU_TOLERANCE[dtype]


GPU_CASES = {
    "decode_b1_16k": [(16384, 1)],
    "decode_b1_1k": [(1000, 1)],
    "decode_b64_4k": [(4096 - 7 * i, 1) for i in range(64)],
    "decode_b64_mixed_lengths": [(17 + 255 * i, 1) for i in range(64)],
    "prompts": [(2048, 2048)] * 2 + [(777, 777)],
    "chunk_after_8k": [(8192 + 512, 512)],
    "hit_chunk_after_16k": [(16384, 16)],  # a prefix hit's last chunk: split unforced
    "decodes_and_hit_chunks": [(2000 + i, 1) for i in range(4)] + [(16000, 16), (5000, 9)],
    "mixed": [(3000 + i, 1) for i in range(30)] + [(1500, 1500), (9000, 512), (100, 33)],
}


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("case", list(GPU_CASES))
def test_gpu_real_shapes(case, model, dtype):
    seqs = GPU_CASES[case]
    check_gpu(seqs, model, dtype)
    num_decodes = next((i for i, (_, q_len) in enumerate(seqs) if q_len != 1), len(seqs))
    if 0 < num_decodes < len(seqs):
        check_gpu(seqs, model, dtype, num_decodes=num_decodes)


@gpu
@needs_cuda
@pytest.mark.parametrize("num_segments", [2, 8, 64])
def test_gpu_split_kv_forced(num_segments):
    check_gpu([(16384, 1), (5000, 1), (3, 1), (700, 1)], "llama-3.1-8b", torch.bfloat16,
              num_segments=num_segments)


@gpu
@needs_cuda
def test_gpu_fp32():
    check_gpu([(3000, 1), (40, 1), (1000, 300)], "qwen3-0.6b", torch.float32)


@gpu
@needs_cuda
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_cuda_graph_replay(batch):
    """Capture a decode step once, then replay it on new lengths, tables and queries in place."""
    num_heads, num_kv_heads, head_dim = MODELS["llama-3.1-8b"]
    max_seq_len, dtype = 8192, torch.bfloat16
    inputs = gpu_batch([(max_seq_len, 1)] * batch, num_heads, num_kv_heads, head_dim, dtype)
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc = inputs
    out = torch.empty_like(query)
    kwargs = dict(max_query_len=1, max_seq_len=max_seq_len, out=out)
    numel = decode_workspace_numel(batch, num_heads, num_kv_heads, head_dim, max_seq_len, "cuda")
    workspace = torch.empty(numel, dtype=torch.float32, device="cuda")

    def step():
        paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                        head_dim ** -0.5, workspace=workspace, **kwargs)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        seq_lens.copy_(torch.randint(1, max_seq_len + 1, (batch,), generator=gen, device="cuda"))
        shuffled = block_tables.flatten()[torch.randperm(block_tables.numel(), generator=gen,
                                                         device="cuda")]
        block_tables.copy_(shuffled.view_as(block_tables))
        query.normal_(generator=gen)
        out.fill_(float("nan"))
        graph.replay()
        ref = paged_attention_ref(query.float(), key_cache.float(), value_cache.float(),
                                  block_tables, seq_lens, query_start_loc, head_dim ** -0.5)
        assert rel_error(out.float(), ref) < GPU_TOLERANCE[dtype]


def test_batch_invariant_rows_are_the_same_bits_in_any_step():
    """batch_invariant: one sequence's last 5 queries give the same bits as one chunk, as five
    decodes alone, and beside other decodes and chunks (which otherwise change the split-KV
    segments and the tile configs)."""
    gen = torch.Generator().manual_seed(9)
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 64, 16
    key_cache, value_cache = (torch.randn(24, block_size, num_kv_heads, head_dim, generator=gen)
                              .to(torch.float16) for _ in range(2))
    table_a, table_b = list(range(19)), list(range(19, 23))  # A: 300 tokens, B: 60
    queries_a = torch.randn(5, num_heads, head_dim, generator=gen).to(torch.float16)
    query_b = torch.randn(1, num_heads, head_dim, generator=gen).to(torch.float16)

    def attend(parts):  # parts: (queries, seq_len, block table) in step order
        query = torch.cat([q for q, _, _ in parts])
        q_lens = [q.shape[0] for q, _, _ in parts]
        width = max(len(t) for _, _, t in parts)
        tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in parts],
                              dtype=torch.int32)
        starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        seq_lens = torch.tensor([s for _, s, _ in parts], dtype=torch.int32)
        return paged_attention(query, key_cache, value_cache, tables, seq_lens, starts,
                               head_dim ** -0.5, max_query_len=max(q_lens),
                               max_seq_len=int(seq_lens.max()),
                               num_decodes=sum(n == 1 for n in q_lens), batch_invariant=True)

    chunk = attend([(queries_a, 300, table_a)])
    for i in range(5):
        alone = attend([(queries_a[i:i + 1], 296 + i, table_a)])
        assert torch.equal(alone[0], chunk[i]), i
    beside = attend([(query_b, 60, table_b)] * 5 + [(queries_a[4:], 300, table_a)]
                    + [(query_b, 60, table_b)] * 2)
    assert torch.equal(beside[5], chunk[4])
    mixed = attend([(query_b, 60, table_b), (queries_a, 300, table_a)])
    assert torch.equal(mixed[1:], chunk)
