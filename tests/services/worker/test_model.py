"""The worker's Llama decoder against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kernels.paged_attention import allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.model import ModelConfig, compute_inv_freq, load_model
from services.worker.runner import ModelRunner, SequenceChunk, build_step_inputs
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import ModelFiles

BLOCK_SIZE = 4
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
VARIANTS = {
    "untied": dict(tie_word_embeddings=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "tied": dict(tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "llama3_rope": dict(tie_word_embeddings=False, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 32}),
    "mha_bias": dict(num_key_value_heads=4, attention_bias=True, mlp_bias=True,
                     tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny_checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY, **VARIANTS[request.param]})
    hf_model = LlamaForCausalLM(config).eval()
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path, safe_serialization=True)
    return path, hf_model


def run_chunks(model, steps: list[list[tuple[list[int], int]]], block_tables: list[list[int]]):
    """steps: per step, (chunk token ids, start position) per sequence -> logits of every token."""
    all_logits = []
    for step in steps:
        chunks = [SequenceChunk(token_ids=ids, start=start, block_table=table, sample=True)
                  for (ids, start), table in zip(step, block_tables)]
        input_ids, positions, metadata = build_step_inputs(chunks, BLOCK_SIZE, torch.device("cpu"))
        metadata = dataclasses.replace(metadata, logits_indices=torch.arange(len(input_ids)))
        all_logits.append(model(input_ids, positions, metadata))  # [num_tokens, vocab_size]
    return all_logits


@torch.inference_mode()
def test_logits_match_hf_for_chunked_batch(tiny_checkpoint):
    path, hf_model = tiny_checkpoint
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


def test_greedy_generation_matches_hf(tiny_checkpoint):
    path, hf_model = tiny_checkpoint
    runner = ModelRunner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="64KiB",
                                      block_size=BLOCK_SIZE), ModelFiles(name="tiny", path=path))
    prompts = [[5, 17, 33, 2, 90, 41, 7], [64, 3, 3]]
    num_new_tokens = 10
    with torch.inference_mode():
        expected = [hf_model.generate(torch.tensor([p]), do_sample=False,
                                      max_new_tokens=num_new_tokens)[0, len(p):].tolist()
                    for p in prompts]
    greedy = SamplingParams(temperature=0.0)
    new_requests = [NewRequestData(f"r{i}", p, greedy, [2 * i, 2 * i + 1])
                    for i, p in enumerate(prompts)]
    outputs: dict[str, list[int]] = {"r0": [], "r1": []}
    first = [ScheduledRequest("r0", 7), ScheduledRequest("r1", 3)]  # whole prompts
    result = runner.execute(StepPlan(0, new_requests, first))
    for step_id in range(1, num_new_tokens + 1):
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids):
            outputs[request_id].append(token_id)
        if step_id == num_new_tokens:
            break
        scheduled = [ScheduledRequest(r, 1, [4 + 2 * i + k for k in range(2)] if step_id == 1 else [])
                     for i, r in enumerate(("r0", "r1"))]
        result = runner.execute(StepPlan(step_id, [], scheduled))
    assert [outputs["r0"], outputs["r1"]] == expected


def test_legacy_rope_keys_read_like_rope_parameters():
    base = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=4096)
    scaling = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 1024}
    legacy = ModelConfig.from_dict(
        {**base, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **scaling}})
    current = ModelConfig.from_dict(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}})
    plain = ModelConfig.from_dict({**base, "rope_theta": 5e5})
    assert legacy.rope_parameters == current.rope_parameters
    assert legacy.num_kv_heads == 4 and legacy.head_dim == 16
    torch.testing.assert_close(compute_inv_freq(legacy), compute_inv_freq(current))
    assert not torch.allclose(compute_inv_freq(legacy), compute_inv_freq(plain))
