"""``--kv-cache-dtype fp8``: power-of-2 scales calibrated per layer, a checkpoint's own KV scales
taken instead, an FP8 cache's logits following the unquantized cache's (the CPU runs the
reference ops), the kvstore namespace carrying the scales, and a CPU worker refusing the flag."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import save_file

from kernels.paged_attention_ref import FP8_KV_DTYPE, FP8_KV_MAX, allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.kv_quant import (HEADROOM, calibrate_kv_scales, kv_scales_tag,
                                      power_of_two_scale, set_fp8_kv_scales)
from services.worker.runner_build import build_runner
from services.worker.weights import load_model
from shared.kv_messages import KvLayout
from shared.models import resolve_model
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks
from tests.services.worker.test_fp8_checkpoints import plain  # noqa: F401 (a fixture)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny():
    return resolve_model("dummy:tiny-llama")


def test_scales_are_powers_of_two_with_the_headroom():
    for amax in (1e-3, 0.7, 1.0, 3.5, 112.0, 5000.0):
        scale = power_of_two_scale(amax)
        assert math.log2(scale).is_integer()
        assert FP8_KV_MAX / (2 * HEADROOM) < amax / scale <= FP8_KV_MAX / HEADROOM
    assert power_of_two_scale(0.0) > 0  # an all-zero layer still divides by something


@torch.inference_mode()
def test_calibration_scales_each_layer_from_what_it_writes(tiny):
    model = load_model(tiny.path, CPU, torch.float32, seed=2)
    scales = calibrate_kv_scales(model, BLOCK_SIZE, CPU, torch.float32)
    assert len(scales) == model.config.num_layers
    assert all(math.log2(s).is_integer() for pair in scales for s in pair)
    assert model.layers[0].self_attn.key_cache is None  # the scratch cache is unbound again
    assert scales == calibrate_kv_scales(model, BLOCK_SIZE, CPU, torch.float32)  # seeded


@torch.inference_mode()
def test_fp8_cache_logits_follow_the_unquantized_cache(tiny):
    """Chunked, paged steps (a prompt chunk after context, then a decode) over an fp32 cache
    and an FP8 one: every position's logits point the same way, and differ."""
    seq = torch.randint(0, 1000, (14,), generator=torch.Generator().manual_seed(3)).tolist()
    steps, block_tables = [[(seq[:9], 0)], [(seq[9:13], 9)], [(seq[13:], 13)]], [[5, 1, 7, 3]]
    logits = {}
    for dtype in (torch.float32, FP8_KV_DTYPE):
        model = load_model(tiny.path, CPU, torch.float32, seed=2)
        if dtype == FP8_KV_DTYPE:
            set_fp8_kv_scales(model, BLOCK_SIZE, CPU, torch.float32)
        config = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 8, BLOCK_SIZE,
                                              config.num_kv_heads, config.head_dim, dtype, CPU))
        logits[dtype] = torch.cat(run_chunks(model, steps, block_tables))
    cosine = torch.nn.functional.cosine_similarity(logits[FP8_KV_DTYPE], logits[torch.float32],
                                                   dim=-1)
    assert cosine.min() > 0.99, cosine
    assert not torch.equal(logits[FP8_KV_DTYPE], logits[torch.float32])


def test_a_checkpoints_kv_scales_are_taken_not_calibrated(plain, tmp_path):  # noqa: F811
    """compressed-tensors' kv_cache_scheme ships self_attn.k_scale / v_scale: they load (a
    strict load would refuse unknown names) and become the layers' scales."""
    _, tensors = plain
    config = json.loads((plain[0] / "config.json").read_text())
    with_scales = dict(tensors)
    for layer in range(config["num_hidden_layers"]):
        with_scales[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.05 + layer)
        with_scales[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.01)
    save_file(with_scales, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path, CPU, torch.float32)
    set_fp8_kv_scales(model, BLOCK_SIZE, CPU, torch.float32)
    assert [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in model.layers] == [
        (pytest.approx(0.05 + i), pytest.approx(0.01)) for i in range(len(model.layers))]
    with_scales["model.layers.1.self_attn.v_scale"] = torch.tensor(0.0)
    save_file(with_scales, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.self_attn.v_scale is 0.0: a KV scale must"):
        load_model(tmp_path, CPU, torch.float32)


def test_the_namespace_carries_the_scales_and_keeps_unscaled_ones(tiny):
    """A bf16 layout's namespace is what it was before kv_scales existed (its stored blocks
    stay found); FP8 layouts with other scales never share one."""
    fields = dict(weights_version="w1", dtype="bfloat16", num_layers=2, block_size=16,
                  num_kv_heads=2, head_dim=64)
    import hashlib
    before = hashlib.sha256(json.dumps(fields, separators=(",", ":")).encode()).hexdigest()[:24]
    assert KvLayout(**fields).namespace == before
    model = load_model(tiny.path, CPU, torch.float32, seed=2)
    fp8 = {**fields, "dtype": "float8_e4m3fn"}
    tag = kv_scales_tag(model)
    model.layers[1].self_attn.v_scale = 0.5
    assert len({KvLayout(**fp8).namespace, KvLayout(**fp8, kv_scales=tag).namespace,
                KvLayout(**fp8, kv_scales=kv_scales_tag(model)).namespace, before}) == 4


def test_a_cpu_worker_refuses_an_fp8_cache_naming_the_flag(tiny):
    with pytest.raises(ValueError, match="--kv-cache-dtype fp8 needs a CUDA GPU"):
        build_runner(WorkerConfig(device="cpu", kv_cache_dtype="fp8"), tiny)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8"):
        WorkerConfig(kv_cache_dtype="int8")
