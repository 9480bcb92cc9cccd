"""Paged attention in Triton: ``paged_attention_ref`` without a host-device sync. The cache layout
and the varlen batch rule it follows are set out in kernels/paged_attention_ref.py (the reference).

The kernel (``paged_attention``; design notes above ``_paged_attention_kernel``):

- one program per (tile of query rows of ONE sequence, kv head, context segment). A tile's rows are
  ``BLOCK_Q`` query positions times the GQA group: the query heads sharing a kv head are rows of one
  problem, so each K/V tile is read once per kv head, not once per query head, and a decode's
  ``group`` rows fill a 16-row tensor-core tile that would otherwise be one row and fifteen pads.
- the program walks its context in tiles of ``BLOCK_N`` keys gathered through the block table (any
  block size: each key's block id is looked up, so ``BLOCK_N`` need not match ``block_size``), with
  an online softmax in fp32 (base 2, the scale folded in). Tiles wholly below the tile's first query
  position run without a mask; only the few tiles on the causal diagonal (the last ``q_len``
  columns) and the ragged end are masked.
- a program finds its sequence without the host: with ``max_query_len <= BLOCK_Q`` (decodes, short
  chunks) program ``i`` is sequence ``i``; otherwise sequence ``i``'s tiles start at program
  ``query_start_loc[i] // BLOCK_Q + i`` and a program counts, over ``query_start_loc``, the starts
  at or before its own (one vector load per 256 sequences, no dependent-load binary search). The
  grid, ``num_tokens // BLOCK_Q + num_seqs + 1``, bounds the tile count; spare programs exit.
- split-KV (flash-decoding): when few (sequence, kv head) programs would leave SMs idle, each
  sequence's context is cut into ``num_segments`` equal BLOCK_N-aligned pieces, one program each,
  writing an unnormalised partial output with its running max and sum; ``_combine_segments_kernel``
  merges them with their log-sum-exp weights. The count comes from host ints only (num_seqs,
  num_kv_heads, max_seq_len, SM count): see ``choose_num_segments``.
- ``num_decodes`` (a host int from the scheduler, which puts decodes first) lets a mixed batch run
  as two launches: the decodes with 16-row tiles (and split-KV), the chunks with 128-row tiles, so
  decodes don't waste 7/8 of a prefill-sized tile and chunks keep their K/V reuse.
- an FP8 cache (``--kv-cache-dtype fp8``) is widened tile by tile (to fp16, one cvt a pair), dots
  accumulate in fp32; the key scale folds into the softmax's, the value scale into the output.
- nothing in the launcher reads device memory: grids, tile sizes and scratch depend on shapes and
  the host ints only, so a decode step (fixed num_tokens, num_seqs, max_query_len, max_seq_len) can
  be captured in a CUDA graph. Pass a ``workspace`` (``workspace_numel``) to keep scratch out of it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels import pdl
from kernels.attention_configs import (FP8_MIN_SEGMENT_LEN, MIN_SEGMENT_LEN,
                                       AttentionConfig, choose_chunk_segments,
                                       choose_num_segments, default_config)
from kernels.paged_attention_ref import FP8_KV_DTYPE

SEQ_CHUNK = 256  # sequences scanned per vector load when a program looks for its sequence
COMBINE_NUM_WARPS = 4
LOG2E = 1.4426950408889634


def paged_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, *, max_query_len: int,
                    max_seq_len: int, out: torch.Tensor | None = None, num_decodes: int = 0,
                    workspace: torch.Tensor | None = None, num_segments: int | None = None,
                    decode_config: AttentionConfig | None = None,
                    chunk_config: AttentionConfig | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0, batch_invariant: bool = False) -> torch.Tensor:
    """``paged_attention_ref`` in Triton, without a host-device sync (CUDA-graph capturable).

    query, out: [num_tokens, num_heads, head_dim]; the rest as in ``paged_attention_ref``.
    max_query_len, max_seq_len: host ints, upper bounds of the q_lens and seq_lens (max_query_len
        must be exact about being 1: 1 means every sequence has one query). Under graph capture
        pass the bounds the graph is for; the kernel reads the real lengths on the device.
    num_decodes: host int; the first num_decodes sequences have one query each (the scheduler's
        decodes-first order). They then run as their own launch with small tiles.
    workspace: fp32 scratch for split-KV partials, at least ``decode_workspace_numel(...)``
        elements for a decode batch (``workspace_numel`` with a forced num_segments); allocated
        here (a deterministic torch.empty, fine under capture too) when None.
    num_segments: force the split-KV segment count (a power of 2; tests and benchmarks).
    decode_config, chunk_config: override the tile configs (benchmark sweeps).
    k_scale, v_scale: an FP8 cache's scales (it holds x / scale); other caches ignore them.
    batch_invariant: every launch with the decode tile config and no split-KV, so a query row's
        output is the same bits whatever else the step holds, decode or chunk
        (``--batch-invariant``; slower on long contexts and long prompts).
    returns: out, [num_tokens, num_heads, head_dim] in the query's dtype
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, num_seqs)
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len <= 1:
        num_decodes = num_seqs
    if not 0 <= num_decodes <= num_seqs:
        raise ValueError(f"num_decodes={num_decodes} with {num_seqs} sequences")
    fp8 = key_cache.dtype == FP8_KV_DTYPE
    # the key scale folds into the softmax's, the value scale into the output (1: exact)
    args = (query, key_cache, value_cache, out, scale * (k_scale if fp8 else 1.0),
            v_scale if fp8 else 1.0, max_seq_len, workspace)
    if batch_invariant:
        num_segments = 1
        decode_config = chunk_config = default_config(1, num_heads // key_cache.shape[2],
                                                      query.dtype, fp8)
    if num_decodes > 0:
        segments = num_segments or choose_num_segments(
            num_decodes, key_cache.shape[2], max_seq_len, _sm_count(query.device),
            FP8_MIN_SEGMENT_LEN if fp8 else MIN_SEGMENT_LEN)
        _launch(*args, block_tables[:num_decodes], seq_lens[:num_decodes],
                query_start_loc[:num_decodes + 1], min(num_decodes, num_tokens), 1, segments,
                decode_config or default_config(1, num_heads // key_cache.shape[2], query.dtype,
                                                fp8))
    if num_decodes < num_seqs:
        config = chunk_config or default_config(max_query_len, num_heads // key_cache.shape[2],
                                                 query.dtype, fp8)
        segments = num_segments or choose_chunk_segments(
            num_seqs - num_decodes, num_tokens - num_decodes, max_query_len, max_seq_len,
            num_heads // key_cache.shape[2], key_cache.shape[2], config, _sm_count(query.device))
        _launch(*args, block_tables[num_decodes:], seq_lens[num_decodes:],
                query_start_loc[num_decodes:], num_tokens, max_query_len, segments, config)
    return out


def workspace_numel(num_tokens: int, num_heads: int, head_dim: int, num_segments: int) -> int:
    """fp32 elements of split-KV scratch for a launch of num_tokens queries and num_segments."""
    if num_segments <= 1:
        return 0
    return num_tokens * num_heads * num_segments * (_padded_head_dim(head_dim) + 2)


def decode_workspace_numel(num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           max_seq_len: int, device: torch.device | str) -> int:
    """Scratch for a decode launch of num_seqs sequences with the launcher's own segment count:
    what a worker preallocates per captured batch size."""
    device = torch.device(device)
    segments = choose_num_segments(num_seqs, num_kv_heads, max_seq_len, _sm_count(device))
    return workspace_numel(num_seqs, num_heads, head_dim, segments)


def _padded_head_dim(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 16  # the interpreter: any count works
    return torch.cuda.get_device_properties(device).multi_processor_count


def _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, num_seqs) -> None:
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key_cache.shape[2]
    if key_cache.shape != value_cache.shape or key_cache.shape[3] != head_dim:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)}, {tuple(value_cache.shape)} "
                         f"do not fit head_dim {head_dim}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(2) != 1 or key_cache.stride(3) != 1 or value_cache.stride(3) != 1:
        raise ValueError("query and caches need a contiguous head_dim")
    if block_tables.shape[0] < num_seqs or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("block_tables and query_start_loc must cover every sequence")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")


def _launch(query, key_cache, value_cache, out, scale, v_scale, max_seq_len, workspace,
            block_tables, seq_lens, query_start_loc, num_tokens, max_query_len, num_segments,
            config) -> None:
    """One kernel launch over a contiguous run of sequences (and the combine, if split).

    num_tokens: a bound on the tokens of these sequences (grid and scratch size).
    """
    num_heads, head_dim = query.shape[1:]
    block_size, num_kv_heads = key_cache.shape[1:3]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if config.block_m < max(16, group) or config.block_n < 16:
        raise ValueError(f"{config} is too small for a group of {group} (block_m, block_n >= 16)")
    if num_segments < 1 or num_segments & (num_segments - 1):
        raise ValueError(f"num_segments must be a power of 2, got {num_segments}")
    block_q = config.block_m // group
    one_tile_per_seq = max_query_len <= block_q
    num_tiles = num_seqs if one_tile_per_seq else num_tokens // block_q + num_seqs + 1
    head_dim_p2 = _padded_head_dim(head_dim)
    part_acc = part_max = part_sum = out  # unused unless split
    if num_segments > 1:
        numel = workspace_numel(num_tokens, num_heads, head_dim, num_segments)
        if workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=query.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < numel:
            raise ValueError(f"workspace needs {numel} fp32 elements")
        num_rows = num_tokens * num_heads * num_segments
        part_acc = workspace[:num_rows * head_dim_p2]
        part_max = workspace[num_rows * head_dim_p2:num_rows * (head_dim_p2 + 1)]
        part_sum = workspace[num_rows * (head_dim_p2 + 1):numel]
    _paged_attention_kernel[(num_tiles, num_kv_heads, num_segments)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        part_acc, part_max, part_sum, scale * LOG2E, v_scale, num_seqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_Q=block_q, BLOCK_N=config.block_n,
        ONE_TILE_PER_SEQ=one_tile_per_seq, SEQ_CHUNK=SEQ_CHUNK, NUM_SEGMENTS=num_segments,
        SCALED_V=key_cache.dtype == FP8_KV_DTYPE,  # (never by value: one variant a cache dtype)
        FP16_DOTS=(key_cache.dtype, query.dtype) == (FP8_KV_DTYPE, torch.bfloat16),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl.launch_options())
    if num_segments > 1:
        _combine_segments_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, query_start_loc, num_seqs,
            out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, NUM_SEGMENTS=num_segments,
            num_warps=COMBINE_NUM_WARPS, **pdl.launch_options())


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q: tl.constexpr, SEQ_CHUNK: tl.constexpr):
    """The sequence owning query tile `tile`: sequence i's tiles start at
    T_i = query_start_loc[i] // BLOCK_Q + i - query_start_loc[0] // BLOCK_Q (strictly increasing),
    so it is the number of i >= 1 with T_i <= tile."""
    base = tl.load(query_start_loc_ptr) // BLOCK_Q
    seq = tl.full([], 0, tl.int32)
    for first in range(1, num_seqs, SEQ_CHUNK):
        idx = first + tl.arange(0, SEQ_CHUNK)
        in_range = idx < num_seqs
        starts = tl.load(query_start_loc_ptr + idx, mask=in_range, other=0)
        tile_starts = starts // BLOCK_Q + idx - base
        seq += tl.sum((in_range & (tile_starts <= tile)).to(tl.int32), axis=0)
    return seq, tile - (tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq - base)


@triton.jit
def _load_tile(ptrs, key_ok, d_ok, MASK_KEYS: tl.constexpr, PAD_D: tl.constexpr):
    """A K or V tile; masks only where the keys run out or head_dim was padded."""
    if MASK_KEYS and PAD_D:
        tile = tl.load(ptrs, mask=key_ok & d_ok, other=0.0)
    elif MASK_KEYS:
        tile = tl.load(ptrs, mask=key_ok, other=0.0)
    elif PAD_D:
        tile = tl.load(ptrs, mask=d_ok, other=0.0)
    else:
        tile = tl.load(ptrs)
    return tile


@triton.jit
def _attend_tile(q, acc, m_i, l_i, key_start, key_end, query_pos, block_table_ptr, k_base, v_base,
                 stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, qk_scale,
                 BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_P2: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online-softmax update of the rows with keys key_start..key_start + BLOCK_N (base 2).

    q: [BLOCK_M, HEAD_DIM_P2]; acc: [BLOCK_M, HEAD_DIM_P2] fp32; m_i, l_i, query_pos: [BLOCK_M]
    """
    PAD_D: tl.constexpr = HEAD_DIM != HEAD_DIM_P2
    offs_d = tl.arange(0, HEAD_DIM_P2)
    keys = key_start + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions in the context
    key_ok = keys < key_end
    if MASKED:  # past the sequence's blocks the table row may end: don't read it
        block_ids = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0)
    else:
        block_ids = tl.load(block_table_ptr + keys // BLOCK_SIZE)
    block_ids = block_ids.to(tl.int64)
    slots = keys % BLOCK_SIZE
    k_ptrs = (k_base + (block_ids * stride_k_blk + slots * stride_k_tok)[None, :]
              + offs_d[:, None])  # [HEAD_DIM_P2, BLOCK_N]
    # an FP8 cache's tile widened to q's dtype (its scale is in qk_scale)
    k = _load_tile(k_ptrs, key_ok[None, :], (offs_d < HEAD_DIM)[:, None], MASKED, PAD_D)
    scores = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale  # [M, N] tile
    if MASKED:
        visible = (keys[None, :] <= query_pos[:, None]) & key_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v_ptrs = (v_base + (block_ids * stride_v_blk + slots * stride_v_tok)[:, None]
              + offs_d[None, :])  # [BLOCK_N, HEAD_DIM_P2]
    v = _load_tile(v_ptrs, key_ok[:, None], (offs_d < HEAD_DIM)[None, :], MASKED, PAD_D)
    # (an FP8 cache's tiles widened to q's dtype; their scales are in qk_scale and the output)
    acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# Arguments that change from step to step are not specialized on (an int divisible by 16 or
# equal to 1, a pointer 16-byte aligned: slices at num_decodes and workspace offsets vary):
# each new combination would compile another variant in the middle of serving.
@triton.jit(do_not_specialize=["num_seqs", "stride_bt_seq", "block_tables_ptr", "seq_lens_ptr",
                               "query_start_loc_ptr", "part_acc_ptr", "part_max_ptr",
                               "part_sum_ptr"])
def _paged_attention_kernel(
        query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
        query_start_loc_ptr, out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr, qk_scale, v_scale,
        num_seqs,
        stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
        stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok, stride_v_head,
        stride_bt_seq,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
        BLOCK_N: tl.constexpr, ONE_TILE_PER_SEQ: tl.constexpr, SEQ_CHUNK: tl.constexpr,
        NUM_SEGMENTS: tl.constexpr, SCALED_V: tl.constexpr, FP16_DOTS: tl.constexpr,
        DOT_PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program (tile, kv_head, segment): BLOCK_Q queries of one sequence x the GROUP query heads
    of kv_head (row r: query tile_first + r // GROUP, head kv_head * GROUP + r % GROUP), over
    its segment of the context (all of it unless split)."""
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    segment = tl.program_id(2)
    pdl.wait_then_launch_dependents(PDL)  # before the early return of spare programs
    if ONE_TILE_PER_SEQ:
        seq = tile
        tile_in_seq = 0
    else:
        seq, tile_in_seq = _find_seq(query_start_loc_ptr, num_seqs, tile, BLOCK_Q, SEQ_CHUNK)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    tile_first = tile_in_seq * BLOCK_Q  # the tile's first query, counted within the sequence
    if tile_first >= q_len:  # spare program (or an empty padding sequence)
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_M)
    query_idx = tile_first + rows // GROUP  # [BLOCK_M] within the sequence
    row_ok = (rows < BLOCK_Q * GROUP) & (query_idx < q_len)
    query_pos = seq_len - q_len + query_idx  # [BLOCK_M] position in the context
    tokens = (q_start + query_idx).to(tl.int64)  # [BLOCK_M] row of the packed batch
    heads = kv_head * GROUP + rows % GROUP  # [BLOCK_M]
    offs_d = tl.arange(0, HEAD_DIM_P2)
    d_ok = offs_d < HEAD_DIM
    q_ptrs = (query_ptr + (tokens * stride_q_tok + heads * stride_q_head)[:, None]
              + offs_d[None, :])
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_DIM_P2]
    if FP16_DOTS:  # FP8 K/V widen to fp16 in one cvt a pair (bf16: several; 1,188 vs 1,320 us)
        q = q.to(tl.float16)

    acc, m_i, l_i = _attend_segment(
        q, query_pos, seq, seq_len, q_len, tile_first, kv_head, segment, block_tables_ptr,
        key_cache_ptr, value_cache_ptr, stride_bt_seq, stride_k_blk, stride_k_tok, stride_k_head,
        stride_v_blk, stride_v_tok, stride_v_head, qk_scale, BLOCK_Q, BLOCK_SIZE, BLOCK_M,
        BLOCK_N, HEAD_DIM, HEAD_DIM_P2, NUM_SEGMENTS, DOT_PRECISION)
    if SCALED_V:  # an FP8 cache's values: sum(p * v / v_scale) * v_scale
        acc *= v_scale
    _store_rows(acc, m_i, l_i, tokens, heads, row_ok, segment, out_ptr, part_acc_ptr, part_max_ptr,
                part_sum_ptr, query_start_loc_ptr, stride_o_tok, stride_o_head, GROUP, HEAD_DIM,
                HEAD_DIM_P2, NUM_SEGMENTS)


@triton.jit
def _attend_segment(q, query_pos, seq, seq_len, q_len, tile_first, kv_head, segment,
                    block_tables_ptr, key_cache_ptr, value_cache_ptr, stride_bt_seq,
                    stride_k_blk, stride_k_tok, stride_k_head, stride_v_blk, stride_v_tok,
                    stride_v_head, qk_scale, BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                    NUM_SEGMENTS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax of a tile's rows over its program's segment of sequence seq's context for
    kv_head (all of it unless split): first the key tiles every row sees whole, unmasked, then the
    masked ones on the causal diagonal and the ragged end.

    q: [BLOCK_M, HEAD_DIM_P2]; query_pos: [BLOCK_M] position in the context
    returns: acc [BLOCK_M, HEAD_DIM_P2] fp32, unnormalised; m_i, l_i [BLOCK_M] (base 2)
    """
    # keys < full_end are visible to every row; the tile's last row sees keys < kv_end
    full_end = (seq_len - q_len + tile_first + 1) // BLOCK_N * BLOCK_N
    kv_end = seq_len - q_len + tl.minimum(tile_first + BLOCK_Q, q_len)
    if NUM_SEGMENTS == 1:
        seg_start = 0
        seg_end = kv_end
    else:  # equal BLOCK_N-aligned pieces of this sequence's context
        seg_len = tl.cdiv(tl.cdiv(seq_len, NUM_SEGMENTS), BLOCK_N) * BLOCK_N
        seg_start = segment * seg_len
        seg_end = tl.minimum(seg_start + seg_len, kv_end)

    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)  # finite: fully masked rows stay 0, not NaN
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    k_base = key_cache_ptr + kv_head * stride_k_head
    v_base = value_cache_ptr + kv_head * stride_v_head
    for key_start in range(seg_start, tl.minimum(seg_end, full_end), BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, key_start, seg_end, query_pos, block_table_ptr, k_base, v_base,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, qk_scale,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_P2, False, DOT_PRECISION)
    for key_start in range(tl.maximum(seg_start, full_end), seg_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, key_start, seg_end, query_pos, block_table_ptr, k_base, v_base,
            stride_k_blk, stride_k_tok, stride_v_blk, stride_v_tok, qk_scale,
            BLOCK_SIZE, BLOCK_N, HEAD_DIM, HEAD_DIM_P2, True, DOT_PRECISION)
    return acc, m_i, l_i


@triton.jit
def _store_rows(acc, m_i, l_i, tokens, heads, row_ok, segment, out_ptr, part_acc_ptr,
                part_max_ptr, part_sum_ptr, query_start_loc_ptr, stride_o_tok, stride_o_head,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                NUM_SEGMENTS: tl.constexpr):
    """The rows' normalised output or, split, their segment's partial for the combine.
    acc: [BLOCK_M, HEAD_DIM_P2] fp32; m_i, l_i, tokens (rows of the batch), heads, row_ok: [BLOCK_M]
    """
    offs_d = tl.arange(0, HEAD_DIM_P2)
    if NUM_SEGMENTS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_ptrs = (out_ptr + (tokens * stride_o_tok + heads * stride_o_head)[:, None]
                  + offs_d[None, :])
        d_ok = offs_d < HEAD_DIM
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partial row [token - first token of the launch, head, segment]
        num_heads = tl.num_programs(1) * GROUP
        part_rows = ((tokens - tl.load(query_start_loc_ptr)) * num_heads + heads) * NUM_SEGMENTS
        part_rows += segment
        acc_ptrs = part_acc_ptr + part_rows[:, None] * HEAD_DIM_P2 + offs_d[None, :]
        tl.store(acc_ptrs, acc, mask=row_ok[:, None])
        tl.store(part_max_ptr + part_rows, m_i, mask=row_ok)
        tl.store(part_sum_ptr + part_rows, l_i, mask=row_ok)


@triton.jit(do_not_specialize=["num_seqs", "query_start_loc_ptr", "part_acc_ptr", "part_max_ptr",
                               "part_sum_ptr"])
def _combine_segments_kernel(out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
                             query_start_loc_ptr, num_seqs, stride_o_tok, stride_o_head,
                             HEAD_DIM: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
                             NUM_SEGMENTS: tl.constexpr, PDL: tl.constexpr):
    """Program (token of the launch, head): merge the segments' partial outputs, each weighted by
    exp2(its max - the overall max); empty segments (max -1e30, sum 0) weigh nothing."""
    token_in_launch = tl.program_id(0)
    head = tl.program_id(1)
    pdl.wait_then_launch_dependents(PDL)  # before the early return of padding rows
    token = tl.load(query_start_loc_ptr) + token_in_launch
    if token >= tl.load(query_start_loc_ptr + num_seqs):  # padding rows past the last sequence
        return
    rows = (token_in_launch.to(tl.int64) * tl.num_programs(1) + head) * NUM_SEGMENTS
    rows += tl.arange(0, NUM_SEGMENTS)  # [NUM_SEGMENTS]
    seg_max = tl.load(part_max_ptr + rows)
    weights = tl.exp2(seg_max - tl.max(seg_max, axis=0))
    total = tl.sum(tl.load(part_sum_ptr + rows) * weights, axis=0)
    offs_d = tl.arange(0, HEAD_DIM_P2)
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM_P2 + offs_d[None, :])
    out = tl.sum(acc * weights[:, None], axis=0) / total  # [HEAD_DIM_P2]
    o_ptrs = out_ptr + token.to(tl.int64) * stride_o_tok + head * stride_o_head + offs_d
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
