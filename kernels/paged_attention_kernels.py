"""The paged attention kernels (device side): ``_paged_attention_kernel`` and the split-KV
``_combine_segments_kernel``. How they divide the work, and the launcher that plans their
launches, are in kernels/paged_attention.py."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels import pdl


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
