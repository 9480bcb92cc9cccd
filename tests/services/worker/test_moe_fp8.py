"""FP8 experts on the CPU (the kernels' reference math): ``--quantization fp8`` quantizes every
expert per output channel as it loads and leaves the router in its dtype; a checkpoint that
ships block-scaled FP8 experts (``quant_method: "fp8"``, the Qwen3-30B-A3B-FP8 style, its
router left unquantized) loads as it is. Both follow the unquantized model's logits."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.fp8 import FP8_DTYPE
from kernels.paged_attention_ref import allocate_kv_cache
from services.worker.weights import load_model
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks
from tests.services.worker.moe_checkpoints import build_moe_checkpoint
from tests.services.worker.test_fp8_checkpoints import BLOCK, block_quantized

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return build_moe_checkpoint(tmp_path_factory.mktemp("qwen3_moe"), "qwen3_moe",
                                num_experts=4, top_k=2, num_layers=3, dense_layers=(1,))


def logits_of(model) -> torch.Tensor:
    config = model.config
    model.bind_kv_cache(allocate_kv_cache(config.num_layers, 16, BLOCK_SIZE,
                                          config.num_kv_heads, config.head_dim, torch.float32,
                                          "cpu"))
    seq = torch.randint(0, 49152, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    steps = [[(seq[:17], 0)], [(seq[17:], 17)]]
    with torch.inference_mode():
        return torch.cat(run_chunks(model, steps, [[3, 8, 1, 12, 6, 0]]))


def assert_follows(quantized: torch.Tensor, reference: torch.Tensor) -> None:
    cosine = torch.nn.functional.cosine_similarity(quantized, reference, dim=-1)
    assert cosine.min() > 0.99, cosine


def test_quantization_fp8_makes_experts_fp8_per_channel_and_keeps_the_router(qwen3_moe):
    model = load_model(qwen3_moe, CPU, torch.float32, quantization="fp8")
    experts, router = model.layers[0].mlp.experts, model.layers[0].mlp.gate
    assert experts.w13_weight.dtype == FP8_DTYPE and experts.w2_weight.dtype == FP8_DTYPE
    assert experts.w13_weight_scale.shape == (4, 2 * 1536)
    assert experts.w2_weight_scale.shape == (4, 576)
    assert router.weight.dtype == torch.float32
    assert_follows(logits_of(model), logits_of(load_model(qwen3_moe, CPU, torch.float32)))


def test_a_block_fp8_moe_checkpoint_loads_as_it_is(tmp_path, qwen3_moe):
    tensors = load_file(str(qwen3_moe / "model.safetensors"))
    quantized = {}
    for name, tensor in tensors.items():
        module = name.removesuffix(".weight")
        if name.endswith("_proj.weight"):  # attention, dense MLP and every expert's
            quantized[name], quantized[f"{module}.weight_scale_inv"] = block_quantized(tensor)
        else:  # the routers (mlp.gate), norms and embeddings stay as they are
            quantized[name] = tensor
    path = tmp_path / "fp8"
    path.mkdir()
    save_file(quantized, str(path / "model.safetensors"))
    config = json.loads((qwen3_moe / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": list(BLOCK),
                                     "activation_scheme": "dynamic",
                                     "modules_to_not_convert": ["gate", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    model = load_model(path, CPU, torch.float32)
    experts = model.layers[2].mlp.experts
    assert experts.w13_weight.dtype == FP8_DTYPE and experts.w13_weight_scale.shape == (4, 3072)
    assert model.layers[2].mlp.gate.weight.dtype == torch.float32
    assert_follows(logits_of(model), logits_of(load_model(qwen3_moe, CPU, torch.float32)))
