"""Checkpoints that ship FP8 weights (fp8_checkpoints.py), written here in each format from one
small random Llama: compressed-tensors per channel and per tensor (with a projection left
unquantized), and ``quant_method: "fp8"`` with block scales that do not divide the shapes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from kernels.fp8 import FP8_DTYPE, FP8_MAX, MIN_SCALE, dequantize_per_channel, quantize_per_channel
from kernels.paged_attention_ref import allocate_kv_cache
from services.worker.fp8_checkpoints import PROJECTIONS, checkpoint_fp8
from services.worker.weights import check_quantization, load_model
from shared.models import PRESETS_DIR
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks

CPU = torch.device("cpu")
BLOCK = (24, 40)  # rows and columns a block scale covers: neither divides tiny-llama's shapes


def is_projection(name: str) -> bool:
    module = name.removesuffix(".weight")
    return name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """tiny-llama in Hugging Face's own layout (transformers' random init), fp32."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = {**json.loads((PRESETS_DIR / "tiny-llama.json").read_text()),
              "tie_word_embeddings": False}
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    path = tmp_path_factory.mktemp("plain")
    tensors = {name: t.contiguous() for name, t in model.state_dict().items()}
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return path, tensors


def write_checkpoint(path, config: dict, tensors: dict, quantization_config: dict) -> None:
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**config, "quantization_config":
                                                  quantization_config}))


def compressed_tensors(strategy: str) -> dict:
    weights = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
               "dynamic": False}
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": {"num_bits": 8, "type": "float",
                                                                "strategy": "token",
                                                                "dynamic": True}}},
            "ignore": ["lm_head", "model.layers.1.mlp.down_proj"]}


def per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (weight.abs().max() / FP8_MAX).clamp(min=MIN_SCALE)
    return (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale.reshape(1)


def block_quantized(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, scale_inv [ceil(N / 24), ceil(K / 40)]): each block on its own max."""
    n, k = weight.shape
    rows, cols = -(-n // BLOCK[0]), -(-k // BLOCK[1])
    scale_inv = torch.empty(rows, cols)
    quantized = torch.empty(n, k, dtype=FP8_DTYPE)
    for i in range(rows):
        for j in range(cols):
            block = weight[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]]
            scale_inv[i, j] = (block.abs().max() / FP8_MAX).clamp(min=MIN_SCALE)
            quantized[i * BLOCK[0]:(i + 1) * BLOCK[0], j * BLOCK[1]:(j + 1) * BLOCK[1]] = (
                block / scale_inv[i, j]).to(FP8_DTYPE)
    return quantized, scale_inv


def written(plain, tmp_path, kind: str) -> dict:
    """A checkpoint of ``kind`` next to the plain one; returns what was written."""
    plain_path, tensors = plain
    config = json.loads((plain_path / "config.json").read_text())
    out = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if not is_projection(name) or (kind != "fp8-block" and "layers.1.mlp.down" in name):
            out[name] = tensor
        elif kind == "channel":
            out[name], scale = quantize_per_channel(tensor)
            out[f"{module}.weight_scale"] = scale[:, None].to(torch.bfloat16)  # [N, 1], bf16
        elif kind == "tensor":
            out[name], out[f"{module}.weight_scale"] = per_tensor(tensor)
            out[f"{module}.input_scale"] = torch.ones(1)  # a static scheme's: dropped
        else:
            out[name], out[f"{module}.weight_scale_inv"] = block_quantized(tensor)
    quantization = (compressed_tensors(kind) if kind != "fp8-block" else
                    {"quant_method": "fp8", "activation_scheme": "dynamic",
                     "weight_block_size": list(BLOCK)})
    write_checkpoint(tmp_path, config, out, quantization)
    return out


@pytest.mark.parametrize("kind", ["channel", "tensor", "fp8-block"])
def test_each_format_loads_its_fp8_weights_per_channel(plain, tmp_path, kind):
    out = written(plain, tmp_path, kind)
    model = load_model(tmp_path, CPU, torch.float32)  # no flag: the checkpoint says FP8
    state = model.state_dict()
    assert model.config.quantization == "fp8"
    qkv = state["layers.0.self_attn.qkv_proj.weight"]
    assert qkv.dtype == FP8_DTYPE and state["layers.0.self_attn.qkv_proj.weight_scale"].shape == (
        qkv.shape[0],)
    if kind == "channel":  # the checkpoint's bytes and scales, fused
        parts = [out[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"]
        assert torch.equal(qkv.view(torch.uint8), torch.cat(parts).view(torch.uint8))
    _, tensors = plain
    references = {"layers.0.self_attn.qkv_proj": torch.cat(
        [tensors[f"model.layers.0.self_attn.{p}.weight"] for p in ("q_proj", "k_proj", "v_proj")]),
        "layers.1.mlp.down_proj": tensors["model.layers.1.mlp.down_proj.weight"]}
    for name, reference in references.items():
        loaded = dequantize_per_channel(state[f"{name}.weight"], state[f"{name}.weight_scale"])
        # one e4m3 rounding (two for the block format's requantization), on each row's scale
        row_max = reference.abs().amax(1, keepdim=True)
        assert ((loaded - reference).abs() <= row_max * 2 ** -3).all(), (kind, name)
    assert torch.equal(state["lm_head.weight"], tensors["lm_head.weight"])  # unquantized


@torch.inference_mode()
@pytest.mark.parametrize("kind", ["channel", "fp8-block"])
def test_a_checkpoint_of_fp8_weights_computes_what_its_source_model_does(plain, tmp_path, kind):
    written(plain, tmp_path, kind)
    seq = torch.randint(0, 1000, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    logits = []
    for path in (plain[0], tmp_path):
        model = load_model(path, CPU, torch.float32)
        config = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 4, BLOCK_SIZE,
                                              config.num_kv_heads, config.head_dim,
                                              torch.float32, "cpu"))
        logits.append(torch.cat(run_chunks(model, [[(seq, 0)]], [[2, 0, 3]])))
    cosine = torch.nn.functional.cosine_similarity(logits[0], logits[1], dim=-1)
    assert cosine.min() > 0.99, cosine


def test_formats_it_cannot_load_are_refused_by_name(plain, tmp_path):
    assert checkpoint_fp8({}) is None
    assert checkpoint_fp8({"quantization_config": {"quant_method": "fp8"}}).block_size is None
    with pytest.raises(ValueError, match="'awq' is not supported"):
        checkpoint_fp8({"quantization_config": {"quant_method": "awq", "bits": 4}})
    int8 = compressed_tensors("channel")
    int8["config_groups"]["group_0"]["weights"]["type"] = "int"
    with pytest.raises(ValueError, match="'compressed-tensors' is not supported"):
        checkpoint_fp8({"quantization_config": int8})
    out = written(plain, tmp_path, "channel")
    with pytest.raises(ValueError, match="its weights are FP8"):
        check_quantization(tmp_path, "none", CPU)  # the CPU worker cannot serve it
    out["lm_head.weight"], _ = quantize_per_channel(out["lm_head.weight"])
    write_checkpoint(tmp_path, json.loads((plain[0] / "config.json").read_text()), out,
                     compressed_tensors("channel"))
    with pytest.raises(ValueError, match="lm_head.weight is FP8 in this checkpoint"):
        load_model(tmp_path, CPU, torch.float32)
