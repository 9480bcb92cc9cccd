"""The worker's Llama decoder against Hugging Face transformers on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from services.worker.model import ModelConfig, compute_inv_freq
from tests.services.worker.model_checks import (
    assert_chunked_logits_match_hf, hf_greedy, make_runner, runner_greedy,
)

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


def test_logits_match_hf_for_chunked_batch(tiny_checkpoint):
    path, hf_model = tiny_checkpoint
    assert_chunked_logits_match_hf(path, hf_model)


def test_greedy_generation_matches_hf(tiny_checkpoint):
    path, hf_model = tiny_checkpoint
    prompts = [[5, 17, 33, 2, 90, 41, 7], [64, 3, 3]]
    expected = hf_greedy(hf_model, prompts, num_new_tokens=10)
    assert runner_greedy(make_runner(path, "64KiB"), prompts, num_new_tokens=10) == expected


def test_legacy_rope_keys_read_like_rope_parameters():
    base = dict(model_type="llama", vocab_size=10, hidden_size=64, intermediate_size=8,
                num_hidden_layers=1, num_attention_heads=4, max_position_embeddings=4096)
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
