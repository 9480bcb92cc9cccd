"""FP8 (kernels/fp8.py): per-channel weight and per-token activation quantization, the skinny
GEMM on FP8 weights, and the row-wise scaled FP8 GEMM, each against its fp32 reference.

On CPU under TRITON_INTERPRET=1 (fp16 activations: the interpreter's tl.dot is wrong for
bf16); bf16, the Llama-3.1-8B shapes and torch._scaled_mm on the GPU (-m gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels import fp8
from kernels.activation import silu_and_mul_ref
from kernels.rms_norm import rms_norm_ref
from kernels.skinny_gemm import (MAX_M, SkinnyConfig, serves_gated, skinny_gemm,
                                 skinny_gemm_add_rms_norm, skinny_gemm_ref,
                                 skinny_gemm_silu_and_mul)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
ONE_PASS = SkinnyConfig(block_n=16, block_k=32)
SPLIT3 = SkinnyConfig(block_n=16, block_k=32, split_k=3)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def randn(*shape, seed: int, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    gen = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def fp8_weight(n: int, k: int, seed: int, device=DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """A [n, k] weight whose rows span three orders of magnitude, quantized per channel."""
    weight = randn(n, k, seed=seed, device=device) * torch.logspace(
        -2, 1, n, device=device)[:, None]
    return fp8.quantize_per_channel(weight)


def test_per_channel_quantization_round_trips_within_e4m3_precision():
    weight = randn(40, 96, seed=1) * torch.logspace(-3, 2, 40, device=DEVICE)[:, None]
    weight_fp8, scale = fp8.quantize_per_channel(weight)
    assert weight_fp8.dtype == fp8.FP8_DTYPE and scale.shape == (40,)
    # each row's largest magnitude lands on 448; e4m3 keeps 3 mantissa bits (error <= 2**-4)
    assert torch.equal(weight_fp8.float().abs().amax(dim=1), torch.full((40,), 448.0,
                                                                        device=DEVICE))
    back = fp8.dequantize_per_channel(weight_fp8, scale)
    assert ((back - weight).abs() <= weight.abs() * 2 ** -4 + scale[:, None] * 2 ** -9).all()
    zeros_fp8, zero_scale = fp8.quantize_per_channel(torch.zeros(3, 16, device=DEVICE))
    assert (zeros_fp8.float() == 0).all() and (zero_scale == fp8.MIN_SCALE).all()


@pytest.mark.parametrize("m,k", [(1, 64), (5, 300), (3, 5000)])
def test_per_token_quantization_matches_the_reference(m, k):
    """Rows of very different scales, K not a power of two, K over one block (two passes)."""
    x = (randn(m, k, seed=m + k) * torch.logspace(-2, 2, m, device=DEVICE)[:, None]).to(HALF)
    x[0, :] = 0.0  # an all-zero row: the smallest scale, zeros
    x_fp8, scale = fp8.quantize_per_token(x)
    ref_fp8, ref_scale = fp8.quantize_per_token_ref(x)
    assert x_fp8.dtype == fp8.FP8_DTYPE and scale.shape == (m, 1)
    torch.testing.assert_close(scale, ref_scale, rtol=1e-6, atol=0)
    # the same e4m3 value, or its neighbour where x / scale sits on a rounding boundary
    steps = (x_fp8.view(torch.uint8).int() - ref_fp8.view(torch.uint8).int()).abs()
    if DEVICE == "cpu":  # Triton's interpreter drops a rounding's carry into the exponent
        # (31.6 -> 16, not 32): there, only those values may be half the reference
        ref = ref_fp8.float()
        carry_lost = (x_fp8.float() * 2 == ref) & (ref.abs().log2().frac() == 0)
        steps = torch.where(carry_lost, 0, steps)
    assert (steps <= 1).all() and (steps == 0).float().mean() > 0.99
    assert (x_fp8[0].float() == 0).all()


@pytest.mark.parametrize("config", [ONE_PASS, SPLIT3], ids=["one_pass", "split3"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (3, 40, 96), (MAX_M, 37, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_gemm_on_fp8_weights_matches_the_dequantized_reference(config, m, n, k,
                                                                      with_bias):
    weight_fp8, scale = fp8_weight(n, k, seed=n + k)
    x = randn(m, k, seed=m, dtype=HALF)
    bias = randn(n, seed=7, dtype=HALF) if with_bias else None
    out = skinny_gemm(x, weight_fp8, bias, config=config, weight_scale=scale)
    expected = skinny_gemm_ref(x, weight_fp8, bias, weight_scale=scale)
    assert out.dtype == HALF and rel_err(out, expected) < 2e-3  # one rounding to HALF
    for rows in (1, 2):  # batch invariant
        assert torch.equal(skinny_gemm(x[:rows], weight_fp8, bias, config=config,
                                       weight_scale=scale), out[:rows])


@pytest.mark.parametrize("config", [ONE_PASS, SPLIT3], ids=["one_pass", "split3"])
def test_fp8_weights_with_bf16_rows_multiply_in_fp16_without_overflow_or_loss(config):
    """bf16 x on an FP8 weight multiplies in fp16 (``_fp16_dot``), each row of a tile scaled by
    a power of two: rows far outside fp16's range (1e6) and far below it come out as the fp32
    product rounded to bf16 (the interpreter's bf16 store truncates: within 2^-7), batch
    invariant."""
    weight_fp8, scale = fp8_weight(40, 100, seed=11)
    magnitudes = torch.tensor([1e6, 3e4, 1.0, 1e-3, 1e-6], device=DEVICE)
    x = (randn(5, 100, seed=12) * magnitudes[:, None]).to(torch.bfloat16)
    out = skinny_gemm(x, weight_fp8, config=config, weight_scale=scale)
    expected = torch.nn.functional.linear(x.float(), fp8.dequantize_per_channel(
        weight_fp8, scale))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert ((out.float() - expected).abs() <= expected.abs() * 2 ** -7 + 1e-30).all()
    for rows in (1, 3):
        assert torch.equal(skinny_gemm(x[:rows], weight_fp8, config=config,
                                       weight_scale=scale), out[:rows])


def test_fp8_down_with_add_rms_norm_matches_its_reference():
    down_fp8, down_scale = fp8_weight(40, 24, seed=5)
    x = randn(4, 24, seed=4, dtype=HALF)
    residual = randn(4, 40, seed=6, dtype=HALF)
    norm_weight = randn(40, seed=8, dtype=HALF)
    normed, summed = skinny_gemm_add_rms_norm(
        x, down_fp8, None, residual.clone(), norm_weight, 1e-6,
        config=SkinnyConfig(block_n=16, block_k=16, split_k=2), weight_scale=down_scale)
    projected = skinny_gemm_ref(x, down_fp8, weight_scale=down_scale)
    ref_normed, ref_summed = rms_norm_ref(projected, norm_weight, 1e-6, residual.clone())
    assert rel_err(summed, ref_summed) < 4e-3 and rel_err(normed, ref_normed) < 4e-3


@pytest.mark.parametrize("dtype", [HALF, torch.bfloat16], ids=["half", "bf16"])
def test_fp8_gate_up_with_swiglu_in_one_launch_rounds_as_the_two_kernels(dtype):
    """The gated launch on an FP8 gate_up weight: the gate rows and the up rows each times
    their own scales, then SwiGLU rounded as silu_and_mul rounds it (the reference applies it
    to the dequantized product)."""
    gate_up_fp8, scale = fp8_weight(48, 96, seed=3)
    x = randn(4, 96, seed=4, dtype=dtype)
    config = SkinnyConfig(block_n=16, block_k=32)
    fused = skinny_gemm_silu_and_mul(x, gate_up_fp8, config=config, weight_scale=scale)
    gate_up = torch.nn.functional.linear(x.float(), fp8.dequantize_per_channel(gate_up_fp8,
                                                                            scale))
    expected = silu_and_mul_ref(gate_up.to(dtype))
    assert fused.shape == (4, 24) and fused.dtype == dtype
    # three roundings to dtype; the interpreter truncates bf16 (each rounding biased toward 0)
    assert rel_err(fused, expected) < (2e-2 if dtype == torch.bfloat16 else 2e-3)
    alone = skinny_gemm_silu_and_mul(x[-1:].clone(), gate_up_fp8, config=config,
                                     weight_scale=scale)
    assert torch.equal(alone[0], fused[-1])  # batch invariant
    assert not serves_gated(1, gate_up_fp8.cpu())  # the worker takes it on CUDA alone


def test_operand_errors_name_what_is_wrong():
    weight_fp8, scale = fp8_weight(32, 64, seed=9)
    x = randn(2, 64, seed=10, dtype=HALF)
    with pytest.raises(ValueError, match="FP8 weight"):
        skinny_gemm(x.to(fp8.FP8_DTYPE), weight_fp8, weight_scale=scale)
    with pytest.raises(ValueError, match="weight_scale must be"):
        skinny_gemm(x, weight_fp8, weight_scale=scale[:16])
    with pytest.raises(ValueError, match="weight"):
        skinny_gemm(x, weight_fp8)  # an FP8 weight without its scale


def test_the_reference_linear_quantizes_activations_only_when_asked():
    weight_fp8, scale = fp8_weight(48, 64, seed=11)
    x = randn(6, 64, seed=12)
    weight_only = fp8.fp8_linear_ref(x, weight_fp8, scale, quantize_x=False)
    both = fp8.fp8_linear_ref(x, weight_fp8, scale)
    assert torch.allclose(weight_only, x @ fp8.dequantize_per_channel(weight_fp8, scale).T,
                          rtol=1e-5, atol=1e-5)
    assert 0 < rel_err(both, weight_only) < 0.05  # activations rounded to e4m3


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)])
def test_gpu_fp8_paths_at_the_8b_shapes(n, k):
    """Skinny (weight-only FP8) and torch._scaled_mm (FP8 x FP8, row-wise scales) against the
    fp32 references, at decode and prefill sizes; the skinny GEMM batch invariant."""
    weight_fp8, scale = fp8_weight(n, k, seed=n + k, device="cuda")
    x = randn(256, k, seed=k, device="cuda", dtype=torch.bfloat16)
    skinny = skinny_gemm(x[:MAX_M], weight_fp8, weight_scale=scale)
    assert rel_err(skinny, fp8.fp8_linear_ref(x[:MAX_M], weight_fp8, scale,
                                              quantize_x=False)) < 5e-3
    for m in (1, 2, 3, 8):
        assert torch.equal(skinny_gemm(x[:m], weight_fp8, weight_scale=scale), skinny[:m]), m
    for m in (1, 17, 256):
        out = fp8.fp8_linear(x[:m], weight_fp8, scale)
        assert out.dtype == torch.bfloat16
        assert rel_err(out, fp8.fp8_linear_ref(x[:m], weight_fp8, scale)) < 1e-2, m


@pytest.mark.gpu
@gpu
def test_gpu_fp8_linear_captures_into_a_cuda_graph():
    weight_fp8, scale = fp8_weight(1024, 512, seed=13, device="cuda")
    x = randn(64, 512, seed=14, device="cuda", dtype=torch.bfloat16)
    eager = fp8.fp8_linear(x, weight_fp8, scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8.fp8_linear(x, weight_fp8, scale)
    graph.replay()
    assert torch.equal(captured, eager)
