"""A ModelRunner (runner.py) assembled from a WorkerConfig, one part after another, each
needing the ones before it: the device, the model (its LoRA slots, lora_slots.py, and
speculative decoding's draft model),
the KV cache the memory profile leaves room for, the worker's proposer, the sampler, the
CUDA graphs, and on one GPU the start-up warm-up of whole steps (warmup.py), which needs the
runner itself. The runner's constructor only stores what this hands it; nothing here sets
a module global (--batch-invariant travels in the model's config to the ops that read it).
"""

from __future__ import annotations

import dataclasses

from pathlib import Path

import structlog
import torch

from kernels.paged_attention_ref import FP8_KV_DTYPE, allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.cuda_graphs import capture_step_graphs, mixed_graph_tokens
from services.worker.draft_model import DraftModel, NoDraftModel, load_draft_model
from services.worker.eagle_proposer import build_eagle_proposer, load_eagle
from services.worker.qwen_images import load_any_image_encoder
from services.worker.kv_connector import usable_load_groups
from services.worker.kv_quant import resolve_kv_cache_dtype, set_fp8_kv_scales
from services.worker.lora_slots import LoraSlots, NoLora
from services.worker.memory import kv_bytes_per_block, profile_kv_cache_bytes
from services.worker.model import Transformer
from services.worker.runner import ModelRunner, StepGraphs
from services.worker.sampler import Sampler
from services.worker.staging import HostStaging
from services.worker.tp_ranks import SingleRank
from services.worker.warmup import warm_up_attention, warm_up_steps
from services.worker.weights import check_quantization, load_model, resolve_device, resolve_dtype
from shared.config import parse_size
from shared.models import ModelFiles, read_eos_token_ids

log = structlog.get_logger()


def build_runner(config: WorkerConfig, model_files: ModelFiles,
                 ranks: SingleRank = SingleRank()) -> ModelRunner:
    """The runner of ``model_files`` as ``config`` says; ``ranks``: its tensor-parallel group
    (tp_group.py; every rank builds its own, rank 0 sends each call to the others)."""
    device, dtype = _device_and_dtype(config)
    tp = dataclasses.replace(ranks.tp, expert_parallel=config.enable_expert_parallel)
    model = load_model(model_files.path, device, dtype, seed=config.seed,
                       quantization=check_quantization(model_files.path, config.quantization,
                                                       device),
                       tp=tp, batch_invariant=config.batch_invariant)
    staging = HostStaging(device) if device.type == "cuda" else None
    lora = _lora(config, model, device, dtype, staging)  # (its slots before the memory profile)
    max_model_len = model.config.usable_context_len(config.max_model_len)
    kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device)
    if kv_dtype == FP8_KV_DTYPE:  # before the profile and graphs: they use the scales
        set_fp8_kv_scales(model, config.block_size, device, dtype)
    # speculative decoding's draft model (draft_model.py): loaded before the profile, its
    # cache (in --dtype) takes a share of each block's bytes
    draft = load_draft_model(config, model.config, max_model_len, device, dtype) \
        if config.draft_model else None
    # or an EAGLE head (eagle_proposer.py), checked against the model before anything is
    # sized: its KV (one layer) and the feature cache take a share of each block too
    eagle = load_eagle(config.speculative_config, model, config.cache_dir,
                       max(config.max_num_batched_tokens, config.max_num_seqs), device, dtype) \
        if config.eagle_head else None
    bytes_per_block = kv_bytes_per_block(model, config.block_size, kv_dtype) + (
        kv_bytes_per_block(draft, config.block_size, dtype) if draft is not None else 0) + (
        _eagle_bytes_per_block(eagle[0].config, model, config.block_size, dtype)
        if eagle is not None else 0)
    # every rank the same block space: the fewest any rank's memory holds
    num_blocks = ranks.tp.agree_min(_kv_cache_budget(config, model, draft, kv_dtype,
                                                     max_model_len, device, dtype, lora)
                                    // bytes_per_block)
    if num_blocks < 1:
        raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no block "
                         f"({bytes_per_block} bytes each)")
    kv_cache = _allocate_cache(model, num_blocks, config.block_size, kv_dtype, device)
    model.bind_kv_cache(kv_cache)
    proposer = _proposer(config, model, draft, eagle, num_blocks, device, dtype, staging)
    eos_token_ids = read_eos_token_ids(model_files.path)
    runner = ModelRunner(
        ranks=ranks, model_files=model_files, model=model, device=device, dtype=dtype,
        seed=config.seed, block_size=config.block_size, max_model_len=max_model_len,
        eos_token_ids=eos_token_ids, kv_cache=kv_cache,
        kv_cache_bytes=num_blocks * bytes_per_block, staging=staging, proposer=proposer,
        sampler=_sampler(model, model_files.path, eos_token_ids, device),
        graphs=_compile(config, model, proposer, max_model_len, device, lora),
        overlap_steps=config.overlap_steps == "on" or (
            config.overlap_steps == "auto" and device.type == "cuda"),
        kv_load_groups=usable_load_groups(config, model.config.num_layers, device), lora=lora,
        images=load_any_image_encoder(model_files, device, dtype, config, ranks.tp.size))
    if device.type == "cuda" and ranks.tp.size == 1:
        warm_up_steps(runner)  # (a group's ranks take steps only once all are up)
        runner.images.warm_up()
        runner.zero_step_counts()  # the counts are serving's
    log.info("model_runner_ready", model=runner.model_name, device=runner.device,
             dtype=runner.dtype, num_blocks=runner.num_blocks, block_size=runner.block_size,
             kv_cache_bytes=runner.kv_cache_bytes, max_model_len=runner.max_model_len,
             kv_cache_dtype=runner.kv_cache_dtype_name, draft_model=config.draft_model or None)
    return runner


def _device_and_dtype(config: WorkerConfig) -> tuple[torch.device, torch.dtype]:
    """The worker's device and dtype, once the settings are checked against them."""
    if config.num_threads > 0:
        torch.set_num_threads(config.num_threads)
    if config.block_size < 1:
        raise ValueError(f"block_size must be positive, got {config.block_size}")
    device = resolve_device(config.device)
    if config.batch_invariant and device.type != "cuda":
        raise ValueError("batch_invariant needs a CUDA device (the CPU's GEMMs are torch's)")
    return device, resolve_dtype(config.dtype, device)


def _lora(config: WorkerConfig, model: Transformer, device: torch.device,
          dtype: torch.dtype, staging: HostStaging | None) -> LoraSlots | NoLora:
    """The LoRA seam: the registered adapters (each checked against the model) and their
    device slots with --enable-lora, else the null one."""
    if not config.enable_lora:
        return NoLora()
    return LoraSlots(model, config.lora_module_list, config.max_loras, config.max_lora_rank,
                     config.max_cpu_loras, device, dtype,
                     max_num_tokens=config.max_num_batched_tokens, staging=staging)


def _allocate_cache(model: Transformer, num_blocks: int, block_size: int, dtype: torch.dtype,
                    device: torch.device) -> torch.Tensor:
    """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"""
    config = model.config
    return allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                             config.head_dim, dtype, device)


def _proposer(config: WorkerConfig, model: Transformer, draft: Transformer | None, eagle,
              num_blocks: int, device: torch.device, dtype: torch.dtype,
              staging: HostStaging | None) -> NoDraftModel | DraftModel:
    """What fills draft slots: the draft model, an EAGLE head (its feature capture goes into
    the model here, before its graphs are captured) or nothing."""
    if draft is not None:
        return DraftModel(draft, config.draft_model, _allocate_cache(
            draft, num_blocks, config.block_size, dtype, device), config.block_size,
            config.max_num_batched_tokens, staging)
    if eagle is not None:
        return build_eagle_proposer(
            config.eagle_head, *eagle, model,
            _allocate_cache(eagle[0], num_blocks, config.block_size, dtype, device),
            config.block_size, config.max_num_batched_tokens, staging)
    return NoDraftModel()


def _eagle_bytes_per_block(head_config, model: Transformer, block_size: int,
                           dtype: torch.dtype) -> int:
    """An EAGLE head's KV (one layer) and the served model's features, per block."""
    return block_size * dtype.itemsize * (2 * head_config.num_kv_heads * head_config.head_dim
                                          + model.config.hidden_size)


def _kv_cache_budget(config: WorkerConfig, model: Transformer, draft: Transformer | None,
                     kv_dtype: torch.dtype, max_model_len: int, device: torch.device,
                     dtype: torch.dtype, lora: LoraSlots | NoLora) -> int:
    """Bytes for the KV caches: the flag's, 1 GiB on CPU, or what the profile of the largest
    step leaves on the GPU (memory.py)."""
    if config.kv_cache_memory != "auto":
        return parse_size(config.kv_cache_memory)
    if device.type != "cuda":
        return 1 << 30
    return profile_kv_cache_bytes(
        model, num_tokens=config.max_num_batched_tokens, num_sampled=config.max_num_seqs,
        max_model_len=max_model_len, block_size=config.block_size,
        gpu_memory_utilization=config.gpu_memory_utilization, device=device, dtype=dtype,
        kv_dtype=kv_dtype, graph_batch_size=None if config.enforce_eager else config.max_num_seqs,
        graph_num_tokens=0 if config.enforce_eager else mixed_graph_tokens(config),
        draft=draft, num_speculative_tokens=config.num_speculative_tokens,
        lora_capture=lora.graph_capture).kv_cache_bytes


def _sampler(model: Transformer, model_dir: Path, eos_token_ids: list[int],
             device: torch.device) -> Sampler:
    vocab_size = model.config.vocab_size

    def grammar_bank():
        from services.worker.structured import GrammarBank  # loads the grammar library on use

        return GrammarBank(model_dir, vocab_size, eos_token_ids)

    return Sampler(vocab_size, eos_token_ids, device, make_grammars=grammar_bank)


def _compile(config: WorkerConfig, model: Transformer, proposer: NoDraftModel | DraftModel,
             max_model_len: int, device: torch.device, lora: LoraSlots | NoLora
             ) -> StepGraphs:
    """CUDA: the attention variants compiled (the draft model's too), then the graphs of
    whole decode steps, verify steps (speculative decoding) and steps in pieces captured
    (decode and piecewise ones twice with LoRA: with and without the deltas); none with
    --enforce-eager or on the CPU."""
    if device.type != "cuda":
        return StepGraphs(None, None, None)
    warm_up_attention(model, config.block_size)
    proposer.warm_up(config.block_size)
    if config.enforce_eager:
        return StepGraphs(None, None, None)
    graphs = StepGraphs(*capture_step_graphs(model, config, max_model_len, device,
                                             lora.graph_capture))
    proposer.capture_graphs(config.max_num_seqs, max_model_len)
    return graphs
