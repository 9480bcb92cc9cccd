"""Dummy models (``--model dummy:<preset>``): seeded random weights of real architectures, made on the
target device, that every service loads like any other model."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from kernels.paged_attention_ref import allocate_kv_cache
from services.tokenizer.encoding import TextCodec
from services.worker.config import WorkerConfig
from services.worker.model import ModelConfig, Transformer
from services.worker.weights import load_model
from services.worker.runner_build import build_runner
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import DUMMY_MARKER, PRESETS_DIR, dummy_presets, resolve_model
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks

CPU = torch.device("cpu")
# preset: (family, published parameter count in billions, to 2 decimals)
PRESETS = {"llama-3.1-8b": ("llama", 8.03), "llama-3.2-1b": ("llama", 1.24),
           "llama-3.3-70b": ("llama", 70.55),
           "qwen2.5-7b": ("qwen2", 7.62), "qwen3-0.6b": ("qwen3", 0.60),
           "qwen3-30b-a3b": ("qwen3_moe", 30.53), "mixtral-8x7b": ("mixtral", 46.70),
           "tiny-llama": ("llama", 0.00)}


@pytest.fixture(scope="module")
def tiny():
    return resolve_model("dummy:tiny-llama")


def test_the_shipped_presets():
    assert set(dummy_presets()) >= set(PRESETS)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_a_preset_builds_the_architecture_transformers_builds(preset):
    """Same parameter count as the HF model of the same config.json (both on the meta device)."""
    config_dict = json.loads((PRESETS_DIR / f"{preset}.json").read_text())
    config = ModelConfig.from_dict(config_dict)
    with torch.device("meta"):
        model = Transformer(config)
        hf_config = AutoConfig.for_model(**config_dict)
        hf_model = AutoModelForCausalLM.from_config(hf_config)
    num_params = sum(p.numel() for p in model.parameters())
    family, billions = PRESETS[preset]
    assert config.family == family and config.sliding_window is None
    assert num_params == sum(p.numel() for p in hf_model.parameters())
    assert round(num_params / 1e9, 2) == billions


def test_dummy_tiny_llama_resolves_to_a_directory_with_the_default_tokenizer(tiny):
    assert tiny.name == "dummy-tiny-llama" and tiny.dummy
    assert (tiny.path / DUMMY_MARKER).is_file() and not any(tiny.path.glob("*.safetensors"))
    assert tiny.config["eos_token_id"] == 2 and tiny.config["bos_token_id"] == 1
    codec = TextCodec(tiny.path)  # what the tokenizer service does
    assert codec.eos_token_ids == [2] and codec.vocab_size == 49152 and codec.has_chat_template
    assert codec.max_model_len == 8192
    assert resolve_model("dummy:tiny-llama").path == tiny.path  # built once, then reused


def test_the_same_seed_gives_the_same_weights(tiny):
    first = load_model(tiny.path, CPU, torch.float32, seed=0).state_dict()
    again = load_model(tiny.path, CPU, torch.float32, seed=0).state_dict()
    other = load_model(tiny.path, CPU, torch.float32, seed=1).state_dict()
    assert first.keys() == again.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    matrices = [name for name in first if not name.endswith("norm.weight")]
    assert not any(torch.equal(first[name], other[name]) for name in matrices)
    assert all(torch.equal(first[name], torch.ones_like(first[name]))
               for name in first if name.endswith("norm.weight"))
    std = first["layers.0.self_attn.qkv_proj.weight"].std().item()
    assert 0.018 < std < 0.022


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_random_weights_are_made_in_the_target_dtype_and_give_finite_logits(tiny, dtype):
    model = load_model(tiny.path, CPU, dtype)
    assert all(p.dtype == dtype and p.device == CPU for p in model.parameters())
    logits = _forward(model, dtype)
    assert logits.shape == (20, 49152) and torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 10


def test_activations_stay_finite_in_bf16_through_many_layers(tmp_path):
    """32 layers of a 4096-wide model would be slow here; 32 of 256 show the residual growth."""
    config = json.loads((PRESETS_DIR / "llama-3.1-8b.json").read_text())
    config.update(hidden_size=256, intermediate_size=896, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=512)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / DUMMY_MARKER).write_text("")
    model = load_model(tmp_path, CPU, torch.bfloat16)
    assert model.config.num_layers == 32
    logits = _forward(model, torch.bfloat16)
    assert torch.isfinite(logits).all() and logits.abs().max().item() < 100


def test_dummy_tiny_llama_runs_a_step_through_the_runner(tiny):
    runner = build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="1MiB",
                                      block_size=16), tiny)
    assert runner.model_name == "dummy-tiny-llama" and runner.eos_token_ids == [2]
    assert runner.max_model_len == 8192
    greedy = SamplingParams(temperature=0.0)
    prompt = [1, 504, 3575, 282, 4649, 314, 7042, 30, 17, 29]
    plan = StepPlan(0, [NewRequestData("a", prompt, greedy, [3])], [ScheduledRequest("a", 10)])
    result = runner.execute(plan)
    assert result.request_ids == ["a"] and 0 <= result.sampled_token_ids[0] < 49152
    again = runner.execute(StepPlan(1, [], [ScheduledRequest("a", 1)]))
    assert again.request_ids == ["a"] and len(again.sampled_token_ids) == 1


def test_an_unknown_preset_names_the_presets():
    with pytest.raises(ValueError, match="tiny-llama"):
        resolve_model("dummy:no-such-preset")
    with pytest.raises(ValueError, match="unknown dummy preset"):
        resolve_model("dummy:../presets/tiny-llama")


def _forward(model: Transformer, dtype: torch.dtype) -> torch.Tensor:
    """Logits of every token of a 20-token prompt, in two chunks."""
    config = model.config
    model.bind_kv_cache(allocate_kv_cache(config.num_layers, 8, BLOCK_SIZE, config.num_kv_heads,
                                          config.head_dim, dtype, "cpu"))
    tokens = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens = [t % config.vocab_size for t in tokens]
    with torch.inference_mode():
        first, second = run_chunks(model, [[(tokens[:12], 0)], [(tokens[12:], 12)]],
                                   [[4, 1, 7, 0, 2]])
    return torch.cat([first, second])
