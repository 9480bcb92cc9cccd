"""Tensor parallelism on the CPU: two processes over gloo give exactly one process's greedy
text on the real SmolLM2 weights (fp32), through chunked prefill, prefix-cache hits and
preemption; the weight split puts every part back together; a lost or hung rank fails the
group at once."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch
from transformers import AutoTokenizer

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.model import ModelConfig
from services.worker.tensor_parallel import TensorParallel, split_range
from services.worker.tp_group import start_group
from services.worker.tp_ranks import seed_random_draws
from services.worker.weights import fuse_hf_weights, read_safetensors
from shared.messages import NewRequestData, SamplingParams, StepPlan
from shared.models import resolve_model
from shared.sections.speculative import parse_speculative_config

NUM_NEW_TOKENS = 24


@pytest.fixture(scope="module")
def model_files():
    return resolve_model("smollm2")


def test_split_range_covers_everything_once_in_near_equal_parts():
    for total, size in [(3, 2), (9, 4), (1536, 2), (7, 7)]:
        parts = [split_range(total, size, rank) for rank in range(size)]
        assert parts[0][0] == 0 and parts[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        lengths = [end - start for start, end in parts]
        assert max(lengths) - min(lengths) <= 1


def test_rank_parts_rebuild_every_weight(model_files):
    """SmolLM2 (9 query heads over 3 KV heads) split over two ranks: 2 + 1 KV heads with their
    query heads, and the parts put back give the whole weights."""
    config = ModelConfig.from_path(model_files.path)
    weights = fuse_hf_weights(read_safetensors(model_files.path, torch.device("cpu"),
                                               torch.float32), config)
    ranks = [TensorParallel(rank=rank, size=2) for rank in range(2)]
    local = [tp.local_config(config) for tp in ranks]
    assert [(c.num_heads, c.num_kv_heads) for c in local] == [(6, 2), (3, 1)]
    head_dim, q_size = config.head_dim, config.num_heads * config.head_dim
    kv_size = config.num_kv_heads * head_dim
    for name, tensor in weights.items():
        parts = [tp.shard(name, tensor, config) for tp in ranks]
        if name.endswith("qkv_proj.weight"):
            q = torch.cat([p[:c.num_heads * head_dim] for p, c in zip(parts, local)])
            k = torch.cat([p[c.num_heads * head_dim:][:c.num_kv_heads * head_dim]
                           for p, c in zip(parts, local)])
            v = torch.cat([p[(c.num_heads + c.num_kv_heads) * head_dim:]
                           for p, c in zip(parts, local)])
            assert torch.equal(torch.cat([q, k, v]), tensor)
            assert q.shape[0] == q_size and k.shape[0] == kv_size
        elif name.endswith("gate_up_proj.weight"):
            half = [p.shape[0] // 2 for p in parts]
            gate = torch.cat([p[:h] for p, h in zip(parts, half)])
            up = torch.cat([p[h:] for p, h in zip(parts, half)])
            assert torch.equal(torch.cat([gate, up]), tensor)
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), tensor)
        elif name == "embed_tokens.weight":
            assert parts[0].shape == parts[1].shape
            assert torch.equal(torch.cat(parts)[:config.vocab_size], tensor)
        else:
            assert all(torch.equal(p, tensor) for p in parts)


def test_more_ranks_than_kv_heads_is_refused(model_files):
    config = ModelConfig.from_path(model_files.path)
    with pytest.raises(ValueError, match="exceeds the model's 3 key/value heads"):
        TensorParallel(rank=0, size=4).local_config(config)


def test_unseeded_random_draws_get_a_seed_every_rank_shares():
    greedy = NewRequestData("a", [1, 2], SamplingParams(temperature=0.0), [0])
    seeded = NewRequestData("b", [1, 2], SamplingParams(temperature=0.7, seed=5), [1])
    unseeded = NewRequestData("c", [1, 2], SamplingParams(temperature=0.7), [2])
    plan = seed_random_draws(StepPlan(step_id=0, new_requests=[greedy, seeded, unseeded],
                                      scheduled=[]))
    assert plan.new_requests[0] is greedy and plan.new_requests[1] is seeded
    assert plan.new_requests[2].sampling.seed is not None


def _generate(model_files, prompts, tensor_parallel_size: int, speculative_config: str = ""):
    engine = Engine(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=4,
                                    speculative_config=parse_speculative_config(speculative_config),
                                    admission_reserve=False),  # (so requests are preempted)
                    WorkerConfig(device="cpu", kv_cache_memory="3MiB", block_size=8,
                                 tensor_parallel_size=tensor_parallel_size), model_files)
    try:
        sampling = [SamplingParams(temperature=0.0, max_tokens=NUM_NEW_TOKENS,
                                   ignore_eos=True)] * len(prompts)
        sampling[-1] = SamplingParams(temperature=0.8, seed=11, max_tokens=NUM_NEW_TOKENS,
                                      ignore_eos=True)
        completions, stats = engine.generate(prompts, sampling)
        return [c.output_token_ids for c in completions], stats, engine.scheduler

    finally:
        engine.close()


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_two_ranks_over_gloo_generate_one_ranks_text(model_files):
    """Chunks of at most 24 tokens, a 3 MiB cache (preemption) and prompts sharing a prefix:
    both runs preempt and hit the prefix cache, and every token is the same."""
    tokenizer = AutoTokenizer.from_pretrained(model_files.path)
    shared = "The history of the Roman Empire is long and"
    texts = [shared + " complicated, and", shared + " it began", "def fibonacci(n):",
             "Write a short poem about the sea.", shared + " ended in"]
    prompts = [tokenizer(text)["input_ids"] for text in texts]
    whole, whole_stats, whole_scheduler = _generate(model_files, prompts, 1)
    split, split_stats, split_scheduler = _generate(model_files, prompts, 2)
    assert whole_stats.num_preemptions > 0 and split_stats.num_preemptions > 0
    assert whole_scheduler.num_prefix_hits > 0 and split_scheduler.num_prefix_hits > 0
    assert all(len(tokens) == NUM_NEW_TOKENS for tokens in whole)
    assert split == whole
    # n-gram drafts verified on both ranks (the greedy text stays; the seeded sampled request
    # draws by rejection sampling instead, so it is left out)
    drafted, _, scheduler = _generate(model_files, prompts, 2,
                                      '{"method": "ngram", "num_speculative_tokens": 4}')
    assert drafted[:-1] == whole[:-1]
    assert scheduler.draft_books.num_accepted_drafts > 0
    # a draft model (the served one, drafting for itself): a whole copy on each rank
    drafted, _, scheduler = _generate(model_files, prompts, 2, json.dumps(
        {"method": "draft_model", "model": str(model_files.path), "num_speculative_tokens": 3}))
    assert drafted[:-1] == whole[:-1]
    assert scheduler.draft_books.num_accepted_drafts > scheduler.draft_books.num_draft_tokens // 2


def test_a_rank_that_dies_fails_the_group_within_seconds(model_files):
    lost = []
    config = WorkerConfig(device="cpu", model=str(model_files.path), tensor_parallel_size=2)
    leader, _ = start_group(config, model_files, on_lost=lost.append)
    try:
        follower = leader._processes[0]
        os.kill(follower.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not lost and time.monotonic() < deadline:
            time.sleep(0.05)
        assert lost and "rank 1 exited" in lost[0]
    finally:
        leader.close()


def test_a_call_that_outlives_the_step_timeout_fails_the_group(model_files):
    lost = []
    config = WorkerConfig(device="cpu", model=str(model_files.path), tensor_parallel_size=2,
                          tensor_parallel_step_timeout=0.5)
    leader, _ = start_group(config, model_files, on_lost=lost.append)
    try:
        with leader.watch():  # a runner call stuck (as in a collective a rank never joins)
            deadline = time.monotonic() + 10
            while not lost and time.monotonic() < deadline:
                time.sleep(0.05)
        assert lost and "ran past 0.5 s" in lost[0]
    finally:
        for process in leader._processes:
            process.kill()
        leader.close()
