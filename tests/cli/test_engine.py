"""The in-process engine: greedy outputs equal transformers' generate() on the same weights,
with prompts chunked over several steps and more requests than fit in the cache at once."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import ModelFiles

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=None)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    torch.manual_seed(0)
    hf_model = LlamaForCausalLM(LlamaConfig(**TINY)).eval()
    path = tmp_path_factory.mktemp("tiny-llama")
    hf_model.save_pretrained(path, safe_serialization=True)
    return ModelFiles(name="tiny-llama", path=path), hf_model


def hf_greedy(hf_model, prompt: list[int], num_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=num_new_tokens,
                                min_new_tokens=num_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def test_engine_greedy_equals_transformers_under_chunking_and_preemption(tiny_model):
    model_files, hf_model = tiny_model
    # 8 blocks of 16 tokens: room for about two of these requests at a time.
    worker_config = WorkerConfig(device="cpu", dtype="float32", kv_cache_memory=str(
        8 * 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * 16 * 4))
    scheduler_config = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8,
                                       admission_reserve=False)  # (so some are preempted)
    engine = Engine(scheduler_config, worker_config, model_files)
    assert engine.runner.num_blocks == 8
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 256, (n,), generator=generator).tolist() for n in (5, 40, 17, 33)]
    num_new_tokens = 12
    sampling = [SamplingParams(max_tokens=num_new_tokens, temperature=0.0, ignore_eos=True)
                for _ in prompts]
    completions, stats = engine.generate(prompts, sampling)
    assert [c.output_token_ids for c in completions] == [
        hf_greedy(hf_model, prompt, num_new_tokens) for prompt in prompts]
    assert all(c.finish_reason == "length" for c in completions)
    assert stats.num_steps > num_new_tokens  # prompts of 40 tokens take two 24-token steps
    assert stats.num_preemptions > 0


def test_overlapped_steps_equal_one_step_at_a_time(tiny_model):
    """Steps queued before the previous one is read back (the GPU path, here forced on CPU)
    give exactly the tokens of one step at a time: requests that stop early (a stop token) while
    their next step is already queued, a seeded draw, a logprobs request (its steps wait for
    the one before), chunked prompts and preemption."""
    model_files, hf_model = tiny_model
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(1, 256, (n,), generator=generator).tolist()
               for n in (5, 40, 17, 33, 9, 26)]
    stop_at = hf_greedy(hf_model, prompts[0], 12)[4]  # request 0 stops at its 5th token
    sampling = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                               stop_token_ids=[stop_at]),
                SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=10, temperature=0.9, top_k=40, seed=11,
                               ignore_eos=True),
                SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, logprobs=2),
                SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=13, temperature=0.0, ignore_eos=True, min_tokens=4)]
    outputs = {}
    for overlap in (False, True):
        worker_config = WorkerConfig(device="cpu", dtype="float32", kv_cache_memory=str(
            10 * 2 * TINY["num_hidden_layers"] * 16 * TINY["num_key_value_heads"] * 16 * 4))
        engine = Engine(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8,
                                        admission_reserve=False), worker_config, model_files)
        engine.runner.overlap_steps = overlap
        completions, stats = engine.generate(prompts, sampling)
        outputs[overlap] = [(c.output_token_ids, c.finish_reason) for c in completions]
        assert stats.num_preemptions > 0
        assert (engine.runner.num_overlapped_steps > 0) == overlap
        assert not engine.runner.has_in_flight
    assert outputs[True] == outputs[False]
    assert outputs[True][0] == (hf_greedy(hf_model, prompts[0], 5), "stop")
    assert outputs[True][1][0] == hf_greedy(hf_model, prompts[1], 14)
