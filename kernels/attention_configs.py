"""paged_attention's launch policy (kernels/paged_attention.py): the tile configs swept on the
H200, which one a launch takes, and how many split-KV segments. Host ints only, so a launch
chosen here is the same under CUDA-graph capture and replay."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch options of one ``_paged_attention_kernel`` launch."""

    block_m: int  # query rows per program (query positions x GQA group); power of 2, >= 16
    block_n: int  # keys per inner-loop tile; power of 2, >= 16
    num_warps: int
    num_stages: int


# Tunables: sweep them with `benchmarks/gpu/attention_kernel.py --sweep` on the GPU.
DECODE_CONFIG = AttentionConfig(block_m=16, block_n=64, num_warps=4, num_stages=2)  # TUNE: swept on H200
CHUNK_CONFIG = AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2)  # TUNE
PREFILL_CONFIG = AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)  # TUNE
# An FP8 cache's decodes (H200, 8B heads, 64 x 16k: 700 us vs 1,190 with DECODE_CONFIG, bf16
# cache 984; batch 1 at 16k: 28 us with segments of 512 vs 34 of 256). TUNE: swept on H200
FP8_DECODE_CONFIG = AttentionConfig(block_m=16, block_n=128, num_warps=4, num_stages=5)
# and chunks, up to 64 rows a tile (4 x 2048 prompts 528 us vs 615, bf16 550; 512 after 8k 238)
FP8_CHUNK_CONFIG = AttentionConfig(block_m=64, block_n=128, num_warps=4, num_stages=3)
FP8_MIN_SEGMENT_LEN = 512
TARGET_PROGRAMS_PER_SM = 2  # TUNE: split contexts until a decode launch has this many per SM
MIN_SEGMENT_LEN = 64  # TUNE: never split a context into pieces shorter than this (tokens)
# (256: a batch-1 decode at a 1k context took 9.8 us a layer in 4 segments, 6.6 in 16 of 64; H200)
MAX_SEGMENTS = 64  # TUNE: and never into more pieces than this (a power of 2)
SPLIT_CHUNK_MIN_CONTEXT_RATIO = 4  # a chunk launch splits only with this much more context than queries


def default_config(max_query_len: int, group: int, dtype: torch.dtype,
                   fp8_cache: bool = False) -> AttentionConfig:
    """The smallest tile of rows that holds a sequence's queries, up to PREFILL_CONFIG's
    (FP8_*_CONFIG for an FP8 cache's)."""
    rows = max(16, triton.next_power_of_2(max_query_len * group))
    fp8 = fp8_cache and dtype != torch.float32
    config = (FP8_DECODE_CONFIG if rows <= 16 else FP8_CHUNK_CONFIG) if fp8 else (
        DECODE_CONFIG if rows <= 16 else CHUNK_CONFIG if rows <= 64 else PREFILL_CONFIG)
    block_m = max(min(rows, config.block_m), triton.next_power_of_2(group))
    if dtype == torch.float32:  # twice the bytes per tile: keep the pipeline in shared memory
        return AttentionConfig(max(min(block_m, 64), triton.next_power_of_2(group)),
                               min(config.block_n, 32), 4, 2)
    return AttentionConfig(block_m, config.block_n, config.num_warps, config.num_stages)


def choose_num_segments(num_seqs: int, num_kv_heads: int, max_seq_len: int, sm_count: int,
                        min_segment_len: int = MIN_SEGMENT_LEN) -> int:
    """Split-KV segments for a decode launch, from host ints only: the power of 2 that brings the
    launch to TARGET_PROGRAMS_PER_SM (rounding up: an SM holds several decode programs at once, so
    one wave of up to ~2x the target still ends together), pieces no shorter than
    min_segment_len (an FP8 cache's are longer: never more segments, so scratch sized by
    ``decode_workspace_numel`` holds them)."""
    programs = num_seqs * num_kv_heads
    wanted = -(-TARGET_PROGRAMS_PER_SM * sm_count // programs)
    cap = min(MAX_SEGMENTS, max(1, max_seq_len // min_segment_len))
    segments = triton.next_power_of_2(wanted)
    while segments > cap:
        segments //= 2
    return segments


def choose_chunk_segments(num_seqs: int, num_tokens: int, max_query_len: int,
                          max_seq_len: int, group: int, num_kv_heads: int,
                          config: AttentionConfig, sm_count: int) -> int:
    """Split-KV segments for a launch of prompt chunks: 1 unless its query tiles are too few
    to fill the GPU. A short chunk after a long cached prefix (a prefix-cache or kvstore hit:
    16 queries against 16k keys) is one tile per KV head, 8 programs on 132 SMs each reading
    the whole context, unless its context is split like a decode's. Only launches whose
    context is much longer than their queries split: their partials are small (tokens x
    heads x segments), and a prompt's first chunk keeps the order of its sums."""
    if max_seq_len < SPLIT_CHUNK_MIN_CONTEXT_RATIO * max_query_len:
        return 1
    block_q = max(1, config.block_m // group)
    num_tiles = num_seqs if max_query_len <= block_q else -(-num_tokens // block_q) + num_seqs
    return choose_num_segments(num_tiles, num_kv_heads, max_seq_len, sm_count)
