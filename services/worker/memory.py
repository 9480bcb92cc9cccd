"""How much GPU memory the KV cache may take.

The worker loads the weights, runs one profiling forward at the largest step it will be sent
(``max_num_batched_tokens`` prompt tokens, ``max_num_seqs`` sampled rows) against a scratch
cache, and gives the cache what is left of ``gpu_memory_utilization`` of the card after the
weights, that activation peak and a reserve for CUDA graphs. Everything the step loop needs
afterwards fits in memory the caching allocator already holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from kernels.paged_attention import allocate_kv_cache
from services.worker.model import AttentionMetadata, Transformer

log = structlog.get_logger()

CUDA_GRAPH_RESERVE_BYTES = 512 * 2**20  # graph pools and cuBLAS workspaces


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    used_before_cache_bytes: int  # weights, CUDA context and anything else on the card
    peak_activation_bytes: int
    kv_cache_bytes: int


def kv_bytes_per_block(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    config = model.config
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


@torch.inference_mode()
def profile_kv_cache_bytes(model: Transformer, *, num_tokens: int, num_sampled: int,
                           max_model_len: int, block_size: int, gpu_memory_utilization: float,
                           device: torch.device, dtype: torch.dtype) -> MemoryProfile:
    config = model.config
    seq_lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens)
    scratch = allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                                config.head_dim, dtype, device)
    model.bind_kv_cache(scratch)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slot_mapping, next_block = [], 0
    for row, n in enumerate(seq_lens):
        count = -(-n // block_size)
        block_tables[row, :count] = torch.arange(next_block, next_block + count)
        slot_mapping.append(torch.arange(n) + next_block * block_size)
        next_block += count
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(seq_lens).cumsum(0)
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(device), block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        logits_indices=torch.arange(min(num_sampled, num_tokens), device=device),
        max_query_len=max(seq_lens), max_seq_len=max(seq_lens))
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    model(input_ids, positions, metadata)
    torch.cuda.synchronize()
    peak_activation = torch.cuda.max_memory_allocated(device) - baseline
    model.bind_kv_cache(None)
    del scratch, metadata, input_ids, positions
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    kv_cache_bytes = int(total * gpu_memory_utilization) - used - peak_activation \
        - CUDA_GRAPH_RESERVE_BYTES
    profile = MemoryProfile(total, used, peak_activation, kv_cache_bytes)
    log.info("memory_profiled", **{k: getattr(profile, k) for k in profile.__dataclass_fields__})
    if kv_cache_bytes <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {used / 2**30:.1f} GiB in use after loading, "
            f"{peak_activation / 2**30:.1f} GiB activation peak, of "
            f"{gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB; raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens")
    return profile
