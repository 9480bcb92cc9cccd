"""Every supported family (Llama, Mistral, Qwen2, Qwen3) on the one decoder, against Hugging Face
transformers on tiny random checkpoints: logits of a chunked, paged batch and greedy generation."""

from __future__ import annotations

import json

import pytest
import structlog
import torch
from transformers import (
    LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM,
    Qwen3Config, Qwen3ForCausalLM,
)

from services.worker.model import ModelConfig
from services.worker.weights import load_model
from tests.services.worker.model_checks import (
    assert_chunked_logits_match_hf, hf_greedy, make_runner, runner_greedy,
)

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, initializer_range=0.2, bos_token_id=None, eos_token_id=None,
            pad_token_id=None)
ROPE = {"rope_type": "default", "rope_theta": 10000.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
# name: (config class, model class, config fields over TINY)
FAMILIES = {
    "llama3.1_untied": (LlamaConfig, LlamaForCausalLM,
                        dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE)),
    "llama2_mha_tied": (LlamaConfig, LlamaForCausalLM,
                        dict(num_key_value_heads=4, tie_word_embeddings=True, rope_parameters=ROPE)),
    "mistral_untied": (MistralConfig, MistralForCausalLM,
                       dict(sliding_window=None, tie_word_embeddings=False, rope_parameters=ROPE)),
    # Mistral v0.1 style: the window (32) caps the context; every test sequence fits in it
    "mistral_window_head_dim": (MistralConfig, MistralForCausalLM,
                                dict(sliding_window=32, head_dim=32, tie_word_embeddings=True,
                                     rope_parameters=ROPE)),
    "qwen2_untied": (Qwen2Config, Qwen2ForCausalLM,
                     dict(hidden_size=128, num_attention_heads=8, tie_word_embeddings=False,
                          sliding_window=4096, use_sliding_window=False,
                          rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM,
                   dict(tie_word_embeddings=True, rope_parameters=ROPE)),
    "qwen3_tied_head_dim": (Qwen3Config, Qwen3ForCausalLM,
                            dict(head_dim=32, tie_word_embeddings=True, rope_parameters=ROPE)),
    "qwen3_untied_head_dim": (Qwen3Config, Qwen3ForCausalLM,
                              dict(hidden_size=96, head_dim=16, tie_word_embeddings=False,
                                   rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    config_class, model_class, fields = FAMILIES[request.param]
    torch.manual_seed(0)
    hf_model = model_class(config_class(**{**TINY, **fields})).eval()
    with torch.no_grad():  # HF starts biases at 0 and norms at 1: make a mix-up visible
        for name, param in hf_model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.2)
            elif "norm" in name:
                param.normal_(1.0, 0.2)
    path = tmp_path_factory.mktemp(request.param)
    hf_model.save_pretrained(path, safe_serialization=True)
    return path, hf_model


def test_config_reads_the_family(family_checkpoint):
    path, hf_model = family_checkpoint
    config = ModelConfig.from_path(path)
    hf_config = hf_model.config
    assert config.family == hf_config.model_type
    assert config.head_dim == hf_model.model.layers[0].self_attn.head_dim
    assert config.tie_word_embeddings == hf_config.tie_word_embeddings
    assert config.qkv_bias == (hf_model.model.layers[0].self_attn.q_proj.bias is not None)
    assert config.o_proj_bias == (hf_model.model.layers[0].self_attn.o_proj.bias is not None)
    assert config.qk_norm == hasattr(hf_model.model.layers[0].self_attn, "q_norm")


def test_logits_match_hf_for_chunked_batch(family_checkpoint):
    path, hf_model = family_checkpoint
    assert_chunked_logits_match_hf(path, hf_model)


def test_greedy_generation_matches_hf(family_checkpoint):
    path, hf_model = family_checkpoint
    prompts = [[5, 17, 33, 2, 290, 41, 7, 150, 11], [64, 3, 3]]
    expected = hf_greedy(hf_model, prompts, num_new_tokens=12)
    assert all(len(tokens) == 12 for tokens in expected)
    assert runner_greedy(make_runner(path), prompts, num_new_tokens=12) == expected


BASE = dict(vocab_size=10, hidden_size=64, intermediate_size=8, num_hidden_layers=4,
            num_attention_heads=4, max_position_embeddings=32768)


@pytest.mark.parametrize("fields, window", [
    (dict(architectures=["MistralForCausalLM"], sliding_window=4096), 4096),
    (dict(architectures=["MistralForCausalLM"], sliding_window=None), None),
    (dict(architectures=["MistralForCausalLM"], sliding_window=32768), None),  # no shorter
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=4096), None),  # not used
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=4096, use_sliding_window=True,
          max_window_layers=4), None),  # no layer at or past max_window_layers
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=4096, use_sliding_window=True,
          max_window_layers=2), 4096),
    (dict(architectures=["Qwen3ForCausalLM"], sliding_window=4096, use_sliding_window=True,
          layer_types=["full_attention"] * 3 + ["sliding_attention"]), 4096),
    (dict(architectures=["LlamaForCausalLM"], sliding_window=4096), None),  # Llama ignores it
])
def test_a_used_sliding_window_caps_the_context_with_a_warning(fields, window):
    with structlog.testing.capture_logs() as logs:
        config = ModelConfig.from_dict({**BASE, **fields})
    assert config.sliding_window == window
    warned = [e for e in logs if e["event"] == "sliding_window_caps_context"]
    if window is None:
        assert config.usable_context_len() == 32768 and config.usable_context_len(1000) == 1000
        assert not warned
    else:
        assert config.usable_context_len() == window
        assert config.usable_context_len(100_000) == window
        assert config.usable_context_len(1000) == 1000
        assert warned and warned[0]["log_level"] == "warning"


def test_the_runner_context_is_capped_to_the_window(family_checkpoint):
    path, _ = family_checkpoint
    config = json.loads((path / "config.json").read_text())
    runner = make_runner(path)
    assert runner.max_model_len == (32 if config.get("sliding_window") == 32 else 128)


@pytest.mark.parametrize("fields, message", [
    (dict(architectures=["GPT2LMHeadModel"], model_type="gpt2"), "unsupported architecture"),
    (dict(architectures=["Gemma2ForCausalLM"], model_type="llama"), "unsupported architecture"),
    (dict(model_type="phi3"), "unsupported model_type 'phi3'"),
    (dict(), "unsupported model_type None"),
])
def test_an_unsupported_architecture_fails_clearly(tmp_path, fields, message):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **fields}))
    with pytest.raises(ValueError, match=message):
        load_model(tmp_path, torch.device("cpu"), torch.float32)


def test_model_type_names_the_family_when_architectures_is_empty():
    config = ModelConfig.from_dict({**BASE, "architectures": None, "model_type": "qwen3"})
    assert config.family == "qwen3" and config.qk_norm and config.head_dim == 128
