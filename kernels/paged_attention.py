"""Paged attention in Triton: ``paged_attention_ref`` without a host-device sync. The cache layout
and the varlen batch rule it follows are set out in kernels/paged_attention_ref.py (the reference).

The kernel (``paged_attention``; its code in kernels/paged_attention_kernels.py):

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
from dataclasses import dataclass

import torch
import triton

from kernels import pdl
from kernels.attention_configs import (FP8_MIN_SEGMENT_LEN, MIN_SEGMENT_LEN,
                                       AttentionConfig, choose_chunk_segments,
                                       choose_num_segments, default_config)
from kernels.paged_attention_kernels import _combine_segments_kernel, _paged_attention_kernel
from kernels.paged_attention_ref import FP8_KV_DTYPE
from kernels.repeated_launch import RepeatedLaunch

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
    if out is None:
        out = torch.empty_like(query)
    plan = plan_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                          max_query_len=max_query_len, max_seq_len=max_seq_len, out=out,
                          num_decodes=num_decodes, num_segments=num_segments,
                          decode_config=decode_config, chunk_config=chunk_config,
                          batch_invariant=batch_invariant)
    return plan.run(query, key_cache, value_cache, scale, out=out, workspace=workspace,
                    k_scale=k_scale, v_scale=v_scale)


def plan_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   block_tables: torch.Tensor, seq_lens: torch.Tensor,
                   query_start_loc: torch.Tensor, *, max_query_len: int, max_seq_len: int,
                   out: torch.Tensor | None = None, num_decodes: int = 0,
                   num_segments: int | None = None, decode_config: AttentionConfig | None = None,
                   chunk_config: AttentionConfig | None = None,
                   batch_invariant: bool = False) -> AttentionPlan:
    """The launches ``paged_attention`` makes for this step's sequences (arguments as there),
    planned once to run for every layer: ``AttentionPlan.run`` with each layer's query, caches,
    out and scales, while ``AttentionPlan.fits`` them."""
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _check_inputs(query, key_cache, value_cache, block_tables, query_start_loc, num_seqs)
    if out is None:  # what run allocates when given none: its strides are planned
        out = torch.empty_like(query)
    plan = AttentionPlan(query, key_cache, value_cache, out, batch_invariant)
    if num_tokens == 0 or num_seqs == 0:
        return plan
    if max_query_len <= 1:
        num_decodes = num_seqs
    if not 0 <= num_decodes <= num_seqs:
        raise ValueError(f"num_decodes={num_decodes} with {num_seqs} sequences")
    fp8 = key_cache.dtype == FP8_KV_DTYPE
    group = num_heads // key_cache.shape[2]
    tensors = (query, key_cache, value_cache, out)
    if batch_invariant:
        num_segments = 1
        decode_config = chunk_config = default_config(1, group, query.dtype, fp8)
    if num_decodes > 0:
        segments = num_segments or choose_num_segments(
            num_decodes, key_cache.shape[2], max_seq_len, _sm_count(query.device),
            FP8_MIN_SEGMENT_LEN if fp8 else MIN_SEGMENT_LEN)
        plan.parts.append(_plan_part(
            *tensors, block_tables[:num_decodes], seq_lens[:num_decodes],
            query_start_loc[:num_decodes + 1], min(num_decodes, num_tokens), 1, segments,
            decode_config or default_config(1, group, query.dtype, fp8)))
    if num_decodes < num_seqs:
        config = chunk_config or default_config(max_query_len, group, query.dtype, fp8)
        segments = num_segments or choose_chunk_segments(
            num_seqs - num_decodes, num_tokens - num_decodes, max_query_len, max_seq_len,
            group, key_cache.shape[2], config, _sm_count(query.device))
        plan.parts.append(_plan_part(
            *tensors, block_tables[num_decodes:], seq_lens[num_decodes:],
            query_start_loc[num_decodes:], num_tokens, max_query_len, segments, config))
    return plan


class AttentionPlan:
    """One step's attention launches (the decodes', the chunks'), planned from one layer's
    tensors and run for each layer with its own: between two layers' attentions the host
    only launches (kernels/repeated_launch.py). Planning and Triton's binder at every layer
    cost ~0.2 ms a layer: a step of 7 decodes and a 60-token chunk (8B, H200) took 10.5 ms
    to launch, now 3.0 (its GPU time 6.2 ms)."""

    def __init__(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                 out: torch.Tensor, batch_invariant: bool) -> None:
        self.layouts = tuple(_layout(t) for t in (query, key_cache, value_cache))
        self.out_layout = _layout(out)
        self.batch_invariant = batch_invariant
        self.pdl = pdl.enabled()  # (a CUDA graph keeps what its capture's launches read)
        self.parts: list[_PlannedPart] = []

    def fits(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             out: torch.Tensor | None, batch_invariant: bool) -> bool:
        """Whether these tensors take the planned launches: the same shapes, strides, dtypes
        and 16-byte alignment (all that Triton specializes them on), the same switches."""
        return (self.layouts == (_layout(query), _layout(key_cache), _layout(value_cache))
                and (out is None or _layout(out) == self.out_layout)
                and batch_invariant == self.batch_invariant and pdl.enabled() == self.pdl)

    def run(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
            scale: float, *, out: torch.Tensor | None = None,
            workspace: torch.Tensor | None = None, k_scale: float = 1.0,
            v_scale: float = 1.0) -> torch.Tensor:
        """The attention of one layer (arguments as ``paged_attention``'s) -> out."""
        if out is None:
            out = torch.empty_like(query)
        fp8 = key_cache.dtype == FP8_KV_DTYPE
        # the key scale folds into the softmax's, the value scale into the output (1: exact)
        qk_scale = scale * (k_scale if fp8 else 1.0) * LOG2E
        for part in self.parts:
            partials = part.partials(workspace, out)
            part.attention(query_ptr=query, key_cache_ptr=key_cache, value_cache_ptr=value_cache,
                           out_ptr=out, qk_scale=qk_scale, v_scale=v_scale if fp8 else 1.0,
                           **partials)
            if part.combine is not None:
                part.combine(out_ptr=out, **partials)
        return out


def _layout(tensor: torch.Tensor) -> tuple:
    return (tensor.shape, tensor.stride(), tensor.dtype, tensor.device,
            tensor.data_ptr() % 16 == 0)


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


@dataclass
class _PlannedPart:
    """The launches over one contiguous run of sequences: the attention and, split, the
    combine; their split-KV scratch comes from the run's workspace or is allocated per run."""
    attention: RepeatedLaunch
    combine: RepeatedLaunch | None
    workspace_numel: int
    num_rows: int  # partial rows: tokens x heads x segments
    head_dim_p2: int

    def partials(self, workspace: torch.Tensor | None, out: torch.Tensor) -> dict:
        """The split-KV scratch arguments (unused unless split: out stands in)."""
        if self.combine is None:
            return {"part_acc_ptr": out, "part_max_ptr": out, "part_sum_ptr": out}
        numel, rows, width = self.workspace_numel, self.num_rows, self.head_dim_p2
        if workspace is None:
            workspace = torch.empty(numel, dtype=torch.float32, device=out.device)
        elif workspace.dtype != torch.float32 or workspace.numel() < numel:
            raise ValueError(f"workspace needs {numel} fp32 elements")
        return {"part_acc_ptr": workspace[:rows * width],
                "part_max_ptr": workspace[rows * width:rows * (width + 1)],
                "part_sum_ptr": workspace[rows * (width + 1):numel]}


def _plan_part(query, key_cache, value_cache, out, block_tables, seq_lens, query_start_loc,
               num_tokens, max_query_len, num_segments, config) -> _PlannedPart:
    """The launches over a contiguous run of sequences (and the combine, if split).

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
    options = pdl.launch_options()
    launch_pdl = {"launch_pdl": options.pop("launch_pdl")}
    # per-layer arguments (None here) come with each run
    attention = RepeatedLaunch(_paged_attention_kernel, (num_tiles, num_kv_heads, num_segments), dict(
        query_ptr=None, key_cache_ptr=None, value_cache_ptr=None, block_tables_ptr=block_tables,
        seq_lens_ptr=seq_lens, query_start_loc_ptr=query_start_loc, out_ptr=None,
        part_acc_ptr=None, part_max_ptr=None, part_sum_ptr=None, qk_scale=None, v_scale=None,
        num_seqs=num_seqs, stride_q_tok=query.stride(0), stride_q_head=query.stride(1),
        stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
        stride_k_blk=key_cache.stride(0), stride_k_tok=key_cache.stride(1),
        stride_k_head=key_cache.stride(2), stride_v_blk=value_cache.stride(0),
        stride_v_tok=value_cache.stride(1), stride_v_head=value_cache.stride(2),
        stride_bt_seq=block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, BLOCK_SIZE=block_size,
        BLOCK_M=config.block_m, BLOCK_Q=block_q, BLOCK_N=config.block_n,
        ONE_TILE_PER_SEQ=one_tile_per_seq, SEQ_CHUNK=SEQ_CHUNK, NUM_SEGMENTS=num_segments,
        SCALED_V=key_cache.dtype == FP8_KV_DTYPE,  # (never by value: one variant a cache dtype)
        FP16_DOTS=(key_cache.dtype, query.dtype) == (FP8_KV_DTYPE, torch.bfloat16),
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", **options),
        dict(num_warps=config.num_warps, num_stages=config.num_stages, **launch_pdl))
    combine = None
    if num_segments > 1:
        combine = RepeatedLaunch(_combine_segments_kernel, (num_tokens, num_heads), dict(
            out_ptr=None, part_acc_ptr=None, part_max_ptr=None, part_sum_ptr=None,
            query_start_loc_ptr=query_start_loc, num_seqs=num_seqs,
            stride_o_tok=out.stride(0), stride_o_head=out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P2=head_dim_p2, NUM_SEGMENTS=num_segments, **options),
            dict(num_warps=COMBINE_NUM_WARPS, **launch_pdl))
    return _PlannedPart(attention, combine, workspace_numel(num_tokens, num_heads, head_dim,
                                                            num_segments),
                        num_tokens * num_heads * num_segments, head_dim_p2)
