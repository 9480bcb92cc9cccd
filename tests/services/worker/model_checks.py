"""Checks shared by the model tests: run the flotilla model over chunked, paged steps and compare it
with a Hugging Face model on the same weights (logits, and greedy generation through ModelRunner)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch

from kernels.paged_attention_ref import allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.weights import load_model
from services.worker.runner import ModelRunner, SequenceChunk, build_step_inputs
from services.worker.runner_build import build_runner
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import ModelFiles

BLOCK_SIZE = 4


def run_chunks(model, steps: list[list[tuple[list[int], int]]], block_tables: list[list[int]],
               device: torch.device = torch.device("cpu")):
    """steps: per step, (chunk token ids, start position) per sequence -> logits of every token."""
    all_logits = []
    for step in steps:
        chunks = [SequenceChunk(token_ids=ids, start=start, block_table=table, sample=True)
                  for (ids, start), table in zip(step, block_tables)]
        input_ids, positions, metadata = build_step_inputs(chunks, BLOCK_SIZE, device)
        metadata = dataclasses.replace(metadata, logits_indices=torch.arange(len(input_ids),
                                                                             device=device))
        all_logits.append(model(input_ids, positions, metadata))  # [num_tokens, vocab_size]
    return all_logits


@torch.inference_mode()
def assert_chunked_logits_match_hf(path: Path, hf_model) -> None:
    """One batch mixing a prompt chunk after earlier context, a whole prompt's end and a decode:
    every token's logits equal the HF model's on the whole sequence (fp32, CPU)."""
    model = load_model(path, torch.device("cpu"), torch.float32)
    config = model.config
    model.bind_kv_cache(allocate_kv_cache(config.num_layers, 16, BLOCK_SIZE, config.num_kv_heads,
                                          config.head_dim, torch.float32, "cpu"))
    gen = torch.Generator().manual_seed(1)
    seq_a = torch.randint(0, config.vocab_size, (13,), generator=gen).tolist()
    seq_b = torch.randint(0, config.vocab_size, (6,), generator=gen).tolist()
    # step 1: 7 tokens of a, all 5 prompt tokens of b; step 2: the rest of a, b's 6th token (a decode)
    steps = [[(seq_a[:7], 0), (seq_b[:5], 0)], [(seq_a[7:], 7), (seq_b[5:], 5)]]
    block_tables = [[9, 2, 14, 5], [0, 11]]  # scattered blocks
    step1, step2 = run_chunks(model, steps, block_tables)
    expected_a = hf_model(torch.tensor([seq_a])).logits[0]  # [13, vocab_size]
    expected_b = hf_model(torch.tensor([seq_b])).logits[0]
    got_a = torch.cat([step1[:7], step2[:6]])
    got_b = torch.cat([step1[7:], step2[6:]])
    torch.testing.assert_close(got_a, expected_a, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got_b, expected_b, atol=1e-4, rtol=1e-4)
    assert got_a.argmax(-1).tolist() == expected_a.argmax(-1).tolist()


@torch.inference_mode()
def hf_greedy(hf_model, prompts: list[list[int]], num_new_tokens: int) -> list[list[int]]:
    return [hf_model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=num_new_tokens)
            [0, len(p):].tolist() for p in prompts]


def runner_greedy(runner: ModelRunner, prompts: list[list[int]], num_new_tokens: int
                  ) -> list[list[int]]:
    """Whole prompts in step 0, then one decode per request per step; blocks handed out as the
    tokens need them (interleaved between requests, so each block table is scattered)."""
    greedy = SamplingParams(temperature=0.0)
    request_ids = [f"r{i}" for i in range(len(prompts))]
    free_blocks = list(range(runner.num_blocks - 1, -1, -1))
    block_ids: dict[str, list[int]] = {r: [] for r in request_ids}

    def new_blocks(request_id: str, num_tokens: int) -> list[int]:
        num_missing = math.ceil(num_tokens / BLOCK_SIZE) - len(block_ids[request_id])
        new = [free_blocks.pop() for _ in range(num_missing)]
        block_ids[request_id] += new
        return new

    new_requests = [NewRequestData(r, p, greedy, new_blocks(r, len(p)))
                    for r, p in zip(request_ids, prompts)]
    scheduled = [ScheduledRequest(r, len(p)) for r, p in zip(request_ids, prompts)]
    result = runner.execute(StepPlan(0, new_requests, scheduled))
    outputs: dict[str, list[int]] = {r: [] for r in request_ids}
    for step_id in range(1, num_new_tokens + 1):
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids):
            outputs[request_id].append(token_id)
        if step_id == num_new_tokens:
            break
        scheduled = [ScheduledRequest(r, 1, new_blocks(r, len(p) + step_id))
                     for r, p in zip(request_ids, prompts)]
        result = runner.execute(StepPlan(step_id, [], scheduled))
    return [outputs[r] for r in request_ids]


def greedy_tokens(runner: ModelRunner, prompt: list[int], num_tokens: int,
                  block_ids: list[int], params: SamplingParams | None = None) -> list[int]:
    """One request's first ``num_tokens`` tokens on ``block_ids``: its prompt in one step,
    then one plain decode step a token (greedy unless ``params``)."""
    params = params or SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    result = runner.execute(StepPlan(0, [NewRequestData("r", prompt, params, block_ids)],
                                     [ScheduledRequest("r", len(prompt))]))
    tokens = list(result.sampled_token_ids)
    for step_id in range(1, num_tokens):
        tokens += runner.execute(StepPlan(step_id, [], [ScheduledRequest("r", 1)])
                                 ).sampled_token_ids
    return tokens


def make_runner(path: Path, kv_cache_memory: str = "256KiB") -> ModelRunner:
    return build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory=kv_cache_memory,
                                    block_size=BLOCK_SIZE), ModelFiles(name="tiny", path=path))
