"""How much GPU memory the KV cache may take.

The worker loads the weights, runs one profiling forward at the largest step it will be sent
(``max_num_batched_tokens`` prompt tokens, ``max_num_seqs`` sampled rows) and the sampler's
top-k/top-p sort over those rows against a scratch cache, captures the largest CUDA graphs
(decode and piecewise) to measure what the graphs' pools and static buffers take, and gives
the cache what is left of ``gpu_memory_utilization`` of the card after the weights, that
activation peak, the graphs and a small reserve. Everything the step loop needs afterwards fits in memory the caching allocator
already holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from kernels.paged_attention_ref import allocate_kv_cache
from kernels.sampling import sample_tokens
from services.worker.cuda_graphs import (DecodeGraphs, LoraCapture, PiecewiseGraphs,
                                         verify_graphs)
from services.worker.draft_model import MAX_GRAPH_BATCH
from services.worker.model import AttentionMetadata, Transformer

log = structlog.get_logger()

RESERVE_BYTES = 512 * 2**20  # the smaller graphs, cuBLAS workspaces, fragmentation


@dataclass(frozen=True)
class MemoryProfile:
    total_bytes: int
    used_before_cache_bytes: int  # weights, CUDA context and anything else on the card
    peak_activation_bytes: int  # a forward at the largest step, then sampling its rows
    cuda_graph_bytes: int  # the largest decode and piecewise graphs' pools, static buffers
    kv_cache_bytes: int


def kv_bytes_per_block(model: Transformer, block_size: int, dtype: torch.dtype) -> int:
    config = model.config
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * dtype.itemsize


@torch.inference_mode()
def profile_kv_cache_bytes(model: Transformer, *, num_tokens: int, num_sampled: int,
                           max_model_len: int, block_size: int, gpu_memory_utilization: float,
                           device: torch.device, dtype: torch.dtype,
                           graph_batch_size: int | None = None,
                           graph_num_tokens: int = 0,
                           kv_dtype: torch.dtype | None = None,
                           draft: Transformer | None = None,
                           num_speculative_tokens: int = 0,
                           lora_capture: LoraCapture = None) -> MemoryProfile:
    """graph_batch_size: the largest decode batch captured as a CUDA graph (None: no graphs);
    graph_num_tokens: the largest step captured as piecewise graphs (0: none); kv_dtype: the
    cache's (None: dtype); draft: speculative decoding's draft model (its weights are
    loaded; its decode graphs are measured here too); num_speculative_tokens: K, verify steps'
    graphs captured for K + 1 tokens a sequence (0: none); lora_capture: LoRA's, the decode
    and piecewise graphs with the deltas measured too (cuda_graphs.py)."""
    config = model.config
    seq_lens = [min(max_model_len, num_tokens - start) for start in range(0, num_tokens, max_model_len)]
    num_blocks = sum(-(-n // block_size) for n in seq_lens)
    scratch = allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                                config.head_dim, kv_dtype or dtype, device)
    model.bind_kv_cache(scratch)
    metadata = prefill_metadata(seq_lens, block_size, num_sampled, device)
    input_ids = torch.randint(0, config.vocab_size, (num_tokens,), device=device)
    positions = torch.cat([torch.arange(n) for n in seq_lens]).to(device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    logits = model(input_ids, positions, metadata)  # [num_sampled, vocab_size]
    _sample_with_filters(logits)
    torch.cuda.synchronize()
    peak_activation = torch.cuda.max_memory_allocated(device) - baseline
    del logits, metadata, input_ids, positions
    cuda_graph_bytes = _cuda_graph_bytes(model, graph_batch_size, graph_num_tokens,
                                         max_model_len, block_size, device,
                                         num_speculative_tokens, lora_capture) \
        if graph_batch_size else 0
    if draft is not None and graph_batch_size:
        draft.bind_kv_cache(allocate_kv_cache(  # graphs capture over block 0 only
            draft.config.num_layers, 1, block_size, draft.config.num_kv_heads,
            draft.config.head_dim, dtype, device))
        cuda_graph_bytes += _cuda_graph_bytes(draft, min(graph_batch_size, MAX_GRAPH_BATCH), 0,
                                              max_model_len, block_size, device)
        draft.bind_kv_cache(None)
    model.bind_kv_cache(None)
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    kv_cache_bytes = int(total * gpu_memory_utilization) - used - peak_activation \
        - cuda_graph_bytes - RESERVE_BYTES
    profile = MemoryProfile(total, used, peak_activation, cuda_graph_bytes, kv_cache_bytes)
    log.info("memory_profiled", **{k: getattr(profile, k) for k in profile.__dataclass_fields__})
    if kv_cache_bytes <= 0:
        raise ValueError(
            f"no memory left for the KV cache: {used / 2**30:.1f} GiB in use after loading, "
            f"{peak_activation / 2**30:.1f} GiB activation peak, of "
            f"{gpu_memory_utilization:.0%} of {total / 2**30:.1f} GiB; raise "
            "--gpu-memory-utilization or lower --max-num-batched-tokens or --max-num-seqs")
    return profile


def prefill_metadata(seq_lens: list[int], block_size: int, num_sampled: int,
                     device: torch.device) -> AttentionMetadata:
    """A step of whole prompts of these lengths over consecutive blocks from block 0, sampling
    the first num_sampled rows (a scratch cache's forward: the profile, KV calibration)."""
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
    return AttentionMetadata(
        slot_mapping=torch.cat(slot_mapping).to(device), block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=query_start_loc.to(device),
        logits_indices=torch.arange(min(num_sampled, sum(seq_lens)), device=device),
        max_query_len=max(seq_lens), max_seq_len=max(seq_lens))


def _sample_with_filters(logits: torch.Tensor) -> None:
    """The sampler's largest workspace: every row drawn through the top-k/top-p sort."""
    num_rows, device = logits.shape[0], logits.device
    sample_tokens(logits, torch.ones(num_rows, device=device),
                  torch.full((num_rows,), 50, dtype=torch.int64, device=device),
                  torch.full((num_rows,), 0.9, device=device),
                  torch.zeros(num_rows, dtype=torch.int64, device=device),
                  torch.zeros(num_rows, dtype=torch.int64, device=device))


def _cuda_graph_bytes(model: Transformer, batch_size: int, num_tokens: int, max_model_len: int,
                      block_size: int, device: torch.device, num_speculative_tokens: int = 0,
                      lora_capture: LoraCapture = None) -> int:
    """GPU memory the graphs keep: capture the largest decode bucket and the largest piecewise
    bucket (the smaller ones share their pools) on the scratch cache, and count what stays
    allocated."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info(device)[0]
    graphs = DecodeGraphs(model, batch_size, -(-max_model_len // block_size), max_model_len,
                          device, lora_capture=lora_capture)
    graphs.capture([graphs.buckets[-1]])
    mixed = None
    if num_tokens:
        mixed = PiecewiseGraphs(model, num_tokens, device, lora_capture=lora_capture)
        mixed.capture([mixed.buckets[-1]])
    verify = None
    if num_speculative_tokens:
        verify = verify_graphs(model, batch_size, num_speculative_tokens, block_size,
                               max_model_len, device)
        verify.capture([verify.buckets[-1]])
    torch.cuda.empty_cache()
    graph_bytes = free_before - torch.cuda.mem_get_info(device)[0]
    del graphs, mixed, verify
    torch.cuda.empty_cache()
    return max(0, graph_bytes)
