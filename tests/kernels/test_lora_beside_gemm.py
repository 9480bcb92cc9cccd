"""The LoRA shrink run inside the skinny GEMM's launch (kernels/skinny_gemm.py with a
kernels/lora_delta.py ``LoraDelta``): the projection's output plus each adapter row's delta,
base rows bitwise the GEMM's alone, with and without K split, into the residual of the fused
add-and-norm, and past the step's rows nothing written; gate_up's SwiGLU in the expand's
launch, bitwise the expand then kernels/activation.py; FP8 base weights the same.

On CPU under TRITON_INTERPRET=1 (tests/conftest.py), small shapes; the 8B's projections on the
GPU (-m gpu), against the two-launch path."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import skinny_gemm
from kernels.activation import silu_and_mul
from kernels.fp8 import quantize_per_channel
from kernels.lora import lora_expand_ref, lora_rows_of, lora_shrink_ref
from kernels.lora_delta import LoraDelta
from kernels.lora_configs import default_plan, plan_for
from kernels.rms_norm import rms_norm_ref
from kernels.skinny_gemm import SkinnyConfig
from tests.kernels.test_lora_kernels import (
    DEVICE, TOLERANCE, random_slots, rel_err, slot_pattern)

# (the interpreter's bf16 products are wrong for the GEMM's tiles: fp16 stands in on the CPU)
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
TOL = {**TOLERANCE, torch.float16: 3e-3}
PLAIN = SkinnyConfig(block_n=16, block_k=32)
SPLIT = SkinnyConfig(block_n=16, block_k=32, split_k=3)


def make_step(num_tokens, in_features, out_features, kind, dtype, seed, width=24, beside=True):
    gen = torch.Generator().manual_seed(seed)
    a, b = random_slots(3, width, in_features, out_features, gen, dtype)
    x = torch.randn(num_tokens, in_features, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
              ).to(DEVICE, dtype)
    token_slots = slot_pattern(kind, num_tokens, 3, gen)
    plan = plan_for(in_features, width, out_features, num_tokens, dtype)
    delta = LoraDelta(a, b, lora_rows_of(token_slots), dataclasses.replace(plan, beside=beside))
    return x, weight, token_slots, delta


def expected_delta(x, token_slots, delta):
    """The adapter rows' deltas by the torch references (fp32), zeros at base rows."""
    y = lora_shrink_ref(x, delta.a, token_slots)
    zeros = torch.zeros(x.shape[0], delta.b.shape[1], device=x.device)
    return lora_expand_ref(y, delta.b.float(), token_slots, zeros)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("config", [PLAIN, SPLIT], ids=["plain", "split"])
@pytest.mark.parametrize("num_tokens,kind,beside", [
    (1, "one", True), (5, "interleaved", True), (16, "runs", True), (20, "runs", True),
    (6, "base", True), (5, "interleaved", False)])
def test_gemm_with_the_shrink_beside_adds_each_rows_delta(num_tokens, kind, beside, config,
                                                          dtype):
    """(``beside`` off in the plan: the two launches after the GEMM, the same sums)"""
    x, weight, token_slots, delta = make_step(num_tokens, 96, 40, kind, dtype, num_tokens,
                                              beside=beside)
    alone = skinny_gemm.skinny_gemm(x, weight, config=config)
    got = skinny_gemm.skinny_gemm(x, weight, config=config, lora=delta)
    base = token_slots < 0
    assert torch.equal(got[base], alone[base])  # a base row keeps the GEMM's bits
    adapter = ~base
    if adapter.any():
        wanted = expected_delta(x, token_slots, delta)[adapter]
        assert rel_err(got[adapter].float() - alone[adapter].float(), wanted) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("beside", [True, False])
def test_add_rms_norm_takes_the_deltas_into_the_residual(dtype, beside):
    x, weight, token_slots, delta = make_step(7, 128, 48, "interleaved", dtype, 11,
                                              beside=beside)
    gen = torch.Generator().manual_seed(5)
    residual = torch.randn(7, 48, generator=gen).to(DEVICE, dtype)
    norm_weight = torch.rand(48, generator=gen).to(DEVICE, dtype) + 0.5
    base_residual = residual.clone()
    normed_alone, _ = skinny_gemm.skinny_gemm_add_rms_norm(
        x, weight, None, base_residual, norm_weight, 1e-5, config=SPLIT)
    with_delta = residual.clone()
    normed, summed = skinny_gemm.skinny_gemm_add_rms_norm(
        x, weight, None, with_delta, norm_weight, 1e-5, config=SPLIT, lora=delta)
    assert summed is with_delta
    base = token_slots < 0
    assert torch.equal(normed[base], normed_alone[base])
    assert torch.equal(summed[base], base_residual[base])
    adapter = ~base
    wanted = expected_delta(x, token_slots, delta)
    assert rel_err(summed[adapter].float() - base_residual[adapter].float(),
                   wanted[adapter]) < TOL[dtype]
    expected_norm = rms_norm_ref(summed, norm_weight, 1e-5)
    assert rel_err(normed[adapter].float(), expected_norm[adapter].float()) < TOL[dtype]


def test_rows_past_the_step_and_an_empty_step_are_left_alone():
    """A captured launch's grid covers the bucket: padding rows and a step with no adapter row
    get exactly the GEMM's output."""
    x, weight, _, delta = make_step(12, 64, 32, "one", torch.float32, 2)
    for token_slots in ([1, 0, -1] + [-1] * 9, [-1] * 12):
        token_slots = torch.tensor(token_slots, dtype=torch.int32, device=DEVICE)
        step = LoraDelta(delta.a, delta.b, lora_rows_of(token_slots), delta.plan)
        alone = skinny_gemm.skinny_gemm(x, weight, config=SPLIT)
        got = skinny_gemm.skinny_gemm(x, weight, config=SPLIT, lora=step)
        base = token_slots < 0
        assert torch.equal(got[base], alone[base])
        assert not got.isnan().any()


def test_the_shrink_beside_splits_k_for_a_few_dozen_programs():
    x = torch.zeros(1, 4096, device=DEVICE)
    a = torch.zeros(2, 48, 4096, device=DEVICE)
    delta = LoraDelta(a, torch.zeros(2, 6144, 48, device=DEVICE),
                      lora_rows_of(torch.zeros(1, dtype=torch.int32, device=DEVICE)),
                      default_plan(1, 48))  # (beside off: the shrink's plan still says how)
    shrink = delta.beside(x)
    assert shrink.block_k <= 64 and shrink.num_splits * shrink.split_len >= 4096
    assert 16 <= shrink.num_programs <= 64
    assert shrink.y.shape == (shrink.num_splits, 1, 48)


@pytest.mark.parametrize("config", [PLAIN, SPLIT], ids=["plain", "split"])
@pytest.mark.parametrize("beside", [True, False])
def test_fp8_base_weights_take_the_same_deltas(config, beside):
    """An FP8 weight (per output channel, as --quantization fp8 loads it): base rows the FP8
    GEMM's bits, adapter rows its output plus their deltas; the SwiGLU expand bitwise the
    expand then silu_and_mul over the FP8 projection."""
    x, weight, token_slots, delta = make_step(5, 96, 48, "interleaved", HALF, 5, beside=beside)
    weight, scale = quantize_per_channel(weight)
    alone = skinny_gemm.skinny_gemm(x, weight, weight_scale=scale, config=config)
    got = skinny_gemm.skinny_gemm(x, weight, weight_scale=scale, config=config, lora=delta)
    base = token_slots < 0
    assert torch.equal(got[base], alone[base])
    wanted = expected_delta(x, token_slots, delta)[~base]
    assert rel_err(got[~base].float() - alone[~base].float(), wanted) < TOL[HALF]
    expected = silu_and_mul(skinny_gemm.skinny_gemm(x, weight, weight_scale=scale, lora=delta))
    swiglu = skinny_gemm.skinny_gemm_lora_silu_and_mul(x, weight, None, delta, weight_scale=scale)
    assert torch.equal(swiglu, expected)


# Llama-3.1-8B's projections, rank 16 on all seven: (in, parts * rank, out)
SHAPES = {"qkv": (4096, 48, 6144), "o": (4096, 16, 4096), "gate_up": (4096, 32, 28672),
          "down": (14336, 16, 4096)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_real_shapes_match_the_two_launches_on_the_gpu(shape, num_tokens, fp8):
    in_features, width, out_features = SHAPES[shape]
    x, weight, token_slots, delta = make_step(num_tokens, in_features, out_features,
                                              "interleaved", torch.bfloat16, 1, width)
    weight, scale = quantize_per_channel(weight) if fp8 else (weight, None)
    if not skinny_gemm.serves(num_tokens, weight):
        pytest.skip("the skinny GEMM does not serve this shape")
    two_launches = delta.add(x, skinny_gemm.skinny_gemm(x, weight, weight_scale=scale))
    got = skinny_gemm.skinny_gemm(x, weight, weight_scale=scale, lora=delta)
    base = token_slots < 0
    assert torch.equal(got[base], two_launches[base])
    assert rel_err(got.float(), two_launches.float()) < 1e-2
    graph = torch.cuda.CUDAGraph()  # one capture replays the same
    with torch.cuda.graph(graph):
        captured = skinny_gemm.skinny_gemm(x, weight, weight_scale=scale, lora=delta)
    graph.replay()
    assert torch.equal(captured, got)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("num_tokens,kind,beside", [
    (1, "one", True), (4, "interleaved", False), (16, "runs", True), (6, "base", True)])
def test_gate_up_swiglu_in_the_expand_is_the_two_ops_bitwise(num_tokens, kind, beside, dtype):
    """skinny_gemm_lora_silu_and_mul against silu_and_mul of the projection with its deltas
    in: every row's bits, base rows' too (rows of several slots interleaved)."""
    x, weight, token_slots, delta = make_step(num_tokens, 64, 2 * 24, kind, dtype, num_tokens,
                                              beside=beside)
    expected = silu_and_mul(skinny_gemm.skinny_gemm(x, weight, lora=delta))
    got = skinny_gemm.skinny_gemm_lora_silu_and_mul(x, weight, None, delta)
    assert torch.equal(got, expected)
    base = token_slots < 0
    alone = silu_and_mul(skinny_gemm.skinny_gemm(x, weight))
    assert torch.equal(got[base], alone[base])
    if (~base).any():
        assert not torch.equal(got[~base], alone[~base])


def test_the_swiglu_expand_refuses_more_rows_than_a_tile():
    x, weight, _, delta = make_step(17, 64, 48, "runs", torch.float32, 3)
    y = torch.zeros(1, 17, 24, device=DEVICE)
    with pytest.raises(ValueError, match="at most 16 rows"):
        delta.expand_silu_and_mul(y, torch.zeros(17, 48, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 4])
def test_the_8b_gate_up_swiglu_expand_on_the_gpu(num_tokens):
    """The expand then silu_and_mul, with the table's plan (beside under its register cap),
    and bitwise the same in a CUDA graph. Not bitwise the two launches on the GPU (at 4 rows
    on an H100, 2026-12-08): Triton folds the expand's ``out + y @ b`` into the tensor-core
    product's accumulator (its TTGIR: ``tt.dot %y, %b, %out``), where the SwiGLU expand adds
    the finished product, so the fp32 sums can part in their last bit and, rarely, the bf16
    rounding after them (the interpreter, exact in both, is bitwise: the test above). Here:
    within bf16 rounding, and at most 1% of the elements apart."""
    in_features, width, out_features = SHAPES["gate_up"]
    x, weight, _, delta = make_step(num_tokens, in_features, out_features, "interleaved",
                                    torch.bfloat16, 2, width)
    expected = silu_and_mul(skinny_gemm.skinny_gemm(x, weight, lora=delta))
    got = skinny_gemm.skinny_gemm_lora_silu_and_mul(x, weight, None, delta)
    torch.testing.assert_close(got, expected)  # (bf16: rtol 1.6e-2, atol 1e-5)
    differing = (got != expected).float().mean().item()
    assert differing <= 0.01, f"{differing:.2%} of the elements differ"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = skinny_gemm.skinny_gemm_lora_silu_and_mul(x, weight, None, delta)
    graph.replay()
    assert torch.equal(captured, got)
