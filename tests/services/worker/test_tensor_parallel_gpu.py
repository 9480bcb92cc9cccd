"""Tensor parallelism on two GPUs (NCCL): the teacher-forced logits of two ranks against one
rank's on the same random weights (bf16, and fp32 where only the summation order differs), at
every position of a prompt in chunks and of decodes;
and greedy generation through the engine, whose decode steps replay CUDA graphs that hold the
all-reduces."""

from __future__ import annotations

import gc
import multiprocessing

import pytest
import torch

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.tp_group import free_port, join_group
from services.worker.weights import load_model
from kernels.paged_attention_ref import allocate_kv_cache
from tests.services.worker.conftest import dummy_preset
from shared.messages import SamplingParams
from tests.services.worker.model_checks import run_chunks

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two GPUs")]

NUM_BLOCKS, PROMPT_LEN = 64, 200


def _steps(vocab_size: int) -> list[list[tuple[list[int], int]]]:
    """A prompt in two chunks, then three decodes: one sequence."""
    ids = torch.randint(100, vocab_size, (PROMPT_LEN + 3,),
                        generator=torch.Generator().manual_seed(5)).tolist()
    return [[(ids[:120], 0)], [(ids[120:PROMPT_LEN], 120)]] + [
        [([ids[p]], p)] for p in range(PROMPT_LEN, PROMPT_LEN + 3)]


@torch.inference_mode()
def _logits(path, device: str, tp=None, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    kwargs = {} if tp is None else {"tp": tp}
    model = load_model(path, torch.device(device), dtype, seed=3, **kwargs)
    config = model.config
    model.bind_kv_cache(allocate_kv_cache(config.num_layers, NUM_BLOCKS, 4, config.num_kv_heads,
                                          config.head_dim, dtype, device))
    table = [list(range(NUM_BLOCKS))]
    logits = run_chunks(model, _steps(config.vocab_size), [table[0]], torch.device(device))
    return torch.cat(logits).float().cpu()  # [num_positions, vocab_size]


def _rank(path, rank: int, port: int) -> None:
    config = WorkerConfig(device=f"cuda:{rank}", tensor_parallel_size=2)
    tp = join_group(config, rank, 2, port)
    for dtype in (torch.bfloat16, torch.float32):
        _logits(path, config.device, tp, dtype)
    torch.distributed.destroy_process_group()


def _worst_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a, b, dim=-1).min().item()


def test_two_ranks_give_one_ranks_teacher_forced_logits(tmp_path_factory):
    path = dummy_preset(tmp_path_factory, "qwen3-0.6b").path
    whole = _logits(path, "cuda:0")
    port = free_port()
    follower = multiprocessing.get_context("spawn").Process(target=_rank, args=(path, 1, port))
    follower.start()
    try:
        config = WorkerConfig(device="cuda:0", tensor_parallel_size=2)
        tp = join_group(config, 0, 2, port)
        split = _logits(path, "cuda:0", tp)
        split_fp32 = _logits(path, "cuda:0", tp, torch.float32)
        torch.distributed.destroy_process_group()
    finally:
        follower.join(timeout=120)
    # Both bf16 runs are measured against fp32 on the same weights: on the H200, TP1 0.99982
    # and TP2 0.99981 at their worst position, so TP2 vs TP1 (0.99974) is two bf16 roundings
    # apart, not a split that loses precision. (Partials summed in fp32 and rounded once, as
    # one rank rounds its projection, gave TP2 vs TP1 0.99977 on two H200s: the other GEMM
    # shapes of a split round otherwise too; it was not kept)
    exact = _logits(path, "cuda:0", dtype=torch.float32)
    assert split.shape == whole.shape == exact.shape
    whole_error = 1 - torch.nn.functional.cosine_similarity(whole, exact, dim=-1).min().item()
    split_error = 1 - torch.nn.functional.cosine_similarity(split, exact, dim=-1).min().item()
    # In fp32 the split differs from one rank by summation order alone: issue 30's 0.9999
    worst = {"tp2_vs_tp1_fp32": _worst_cosine(split_fp32, exact),
             "tp2_vs_tp1_bf16": _worst_cosine(split, whole),
             "tp1_bf16_vs_fp32": 1 - whole_error, "tp2_bf16_vs_fp32": 1 - split_error}
    print(f"worst-position cosines over {exact.shape[0]} positions: {worst}")
    assert worst["tp2_vs_tp1_fp32"] >= 0.9999, worst
    assert split_error <= 1.25 * whole_error, worst
    assert worst["tp2_vs_tp1_bf16"] >= 0.9995, worst
    assert (split.argmax(-1) == whole.argmax(-1)).float().mean() >= 0.95


def _generate(model_files, tensor_parallel_size: int) -> list[list[int]]:
    engine = Engine(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=512),
                    WorkerConfig(device="cuda", max_num_seqs=8, max_num_batched_tokens=512,
                                 max_model_len=1024, gpu_memory_utilization=0.3,
                                 tensor_parallel_size=tensor_parallel_size), model_files)
    try:
        prompts = [torch.randint(100, 30_000, (n,), generator=torch.Generator().manual_seed(n))
                   .tolist() for n in (17, 90, 250, 400)]
        completions, _ = engine.generate(prompts, [SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True)] * len(prompts))
        return [c.output_token_ids for c in completions]
    finally:
        engine.close()


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_two_ranks_decode_through_graphs_as_one_rank(tmp_path_factory):
    """bf16 sums in another order may flip a near tie later on, so the texts are compared up
    to their first difference: a graph replaying without its all-reduce differs at once."""
    model_files = dummy_preset(tmp_path_factory, "qwen3-0.6b")
    whole = _generate(model_files, 1)
    gc.collect()
    torch.cuda.empty_cache()  # the first engine's cache and graphs leave cuda:0
    split = _generate(model_files, 2)
    prefixes = [_common_prefix(a, b) for a, b in zip(whole, split)]
    assert sum(prefixes) / len(prefixes) >= 8, (prefixes, whole, split)
