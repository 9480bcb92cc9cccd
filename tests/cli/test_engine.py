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
    scheduler_config = SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=8)
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
