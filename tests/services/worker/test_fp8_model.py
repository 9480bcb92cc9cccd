"""``--quantization fp8``: the loader quantizes exactly the projections, the FP8 model's logits
follow the unquantized model's, and a worker without FP8 tensor cores refuses the flag."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8 import FP8_DTYPE, dequantize_per_channel
from kernels.paged_attention_ref import allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.runner_build import build_runner
from services.worker.weights import check_quantization, load_model
from shared.models import resolve_model
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks

CPU = torch.device("cpu")
PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


@pytest.fixture(scope="module")
def tiny():
    return resolve_model("dummy:tiny-llama")


def test_only_the_projections_are_quantized_each_from_the_same_random_weight(tiny):
    plain = load_model(tiny.path, CPU, torch.float32, seed=2).state_dict()
    quantized = load_model(tiny.path, CPU, torch.float32, seed=2, quantization="fp8").state_dict()
    scales = {name for name in quantized if name.endswith("weight_scale")}
    assert set(quantized) - scales == set(plain)
    for name, tensor in plain.items():
        if name.split(".")[-2] in PROJECTIONS and name.endswith("weight"):
            assert quantized[name].dtype == FP8_DTYPE and f"{name}_scale" in scales
            back = dequantize_per_channel(quantized[name], quantized[f"{name}_scale"])
            assert ((back - tensor).abs() <= tensor.abs().amax(1, keepdim=True) / 16).all()
        else:  # embeddings, norms, lm_head
            assert torch.equal(quantized[name], tensor), name
    assert len(scales) == len(PROJECTIONS) * 2  # tiny-llama's two layers


@torch.inference_mode()
def test_fp8_logits_follow_the_unquantized_model(tiny):
    """Chunked, paged steps through both models: every position's logits point the same way
    (the CPU runs the FP8 math in fp32: weights dequantized, activations quantized per token)."""
    gen = torch.Generator().manual_seed(3)
    seq = torch.randint(0, 1000, (12,), generator=gen).tolist()
    steps, block_tables = [[(seq[:8], 0)], [(seq[8:], 8)]], [[5, 1, 7]]
    logits = {}
    for quantization in ("none", "fp8"):
        model = load_model(tiny.path, CPU, torch.float32, seed=2, quantization=quantization)
        config = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 8, BLOCK_SIZE,
                                              config.num_kv_heads, config.head_dim,
                                              torch.float32, "cpu"))
        logits[quantization] = torch.cat(run_chunks(model, steps, block_tables))
    cosine = torch.nn.functional.cosine_similarity(logits["fp8"], logits["none"], dim=-1)
    assert cosine.min() > 0.99, cosine
    assert not torch.equal(logits["fp8"], logits["none"])  # the FP8 path did run


def test_a_cpu_worker_refuses_fp8_naming_the_flag(tiny):
    with pytest.raises(ValueError, match="--quantization fp8 needs a CUDA GPU"):
        build_runner(WorkerConfig(device="cpu", quantization="fp8"), tiny)
    assert check_quantization(tiny.path, "none", CPU) == "none"
    with pytest.raises(ValueError, match="quantization must be one of none, fp8, int4"):
        WorkerConfig(quantization="int3")
