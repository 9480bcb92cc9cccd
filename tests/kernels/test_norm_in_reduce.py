"""skinny_gemm_add_rms_norm (the residual add and RMSNorm in the split-K reduce) against the two
kernels it replaces, skinny_gemm then rms_norm: bitwise, batch invariant, and refused where it
cannot serve. On CPU under TRITON_INTERPRET=1 in fp32 and fp16; bf16, the Llama-3.1-8B shapes
and graph capture on the GPU (-m gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_gemm as skinny_module
from kernels.rms_norm import MAX_SINGLE_PASS, rms_norm, rms_norm_ref
from kernels.skinny_gemm import (MAX_M, SkinnyConfig, serves_add_rms_norm, skinny_gemm,
                                 skinny_gemm_add_rms_norm)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SPLIT2 = SkinnyConfig(block_n=16, block_k=32, split_k=2)
SPLIT3 = SkinnyConfig(block_n=32, block_k=16, split_k=3)
NO_SPLIT = SkinnyConfig(block_n=16, block_k=32)
EPS = 1e-5


def randn(*shape, gen, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def operands(m: int, n: int, k: int, seed: int, dtype=torch.float32, device=DEVICE,
             with_bias: bool = False):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = randn(m, k, gen=gen, device=device, dtype=dtype)
    weight = (randn(n, k, gen=gen, device=device) / k ** 0.5).to(dtype)
    bias = randn(n, gen=gen, device=device, dtype=dtype) if with_bias else None
    residual = randn(m, n, gen=gen, device=device, dtype=dtype)
    norm_weight = (1.0 + 0.5 * randn(n, gen=gen, device=device)).to(dtype)
    return x, weight, bias, residual, norm_weight


def two_kernels(x, weight, bias, residual, norm_weight, config=None):
    """What the worker runs without the fusion: the GEMM (its own reduce), then the norm."""
    return rms_norm(skinny_gemm(x, weight, bias, config=config), norm_weight, EPS, residual)


@pytest.mark.parametrize("config", [SPLIT2, SPLIT3], ids=["split2", "split3"])
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (3, 40, 96), (16, 37, 100), (5, 96, 1000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bitwise_the_gemm_then_the_norm(config, m, n, k, with_bias):
    """Odd N (masked columns, a norm over a non-power-of-two row), K tails, bias: the normed
    rows and the residual stream are bitwise what the two kernels give."""
    x, weight, bias, residual, norm_weight = operands(m, n, k, seed=m * n + k,
                                                      with_bias=with_bias)
    expected, expected_residual = two_kernels(x, weight, bias, residual.clone(), norm_weight,
                                              config)
    stream = residual.clone()
    normed, returned = skinny_gemm_add_rms_norm(x, weight, bias, stream, norm_weight, EPS,
                                                config=config)
    assert returned is stream  # added in place
    assert torch.equal(stream, expected_residual)
    assert torch.equal(normed, expected)
    # and both near the exact math
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    reference, _ = rms_norm_ref(exact.float(), norm_weight, EPS, residual.clone())
    torch.testing.assert_close(normed, reference, rtol=1e-5, atol=1e-5)


def test_half_precision_rounds_as_two_kernels():
    """fp16: the projection rounded to fp16 before the add, the sum rounded before the norm."""
    x, weight, bias, residual, norm_weight = operands(4, 48, 128, seed=7, dtype=torch.float16,
                                                      with_bias=True)
    expected, expected_residual = two_kernels(x, weight, bias, residual.clone(), norm_weight,
                                              SPLIT2)
    normed, stream = skinny_gemm_add_rms_norm(x, weight, bias, residual.clone(), norm_weight,
                                              EPS, config=SPLIT2)
    assert normed.dtype == torch.float16
    assert torch.equal(stream, expected_residual) and torch.equal(normed, expected)


def test_batch_invariant():
    """A row's result is bitwise the same alone and in batches of every size up to MAX_M."""
    x, weight, bias, residual, norm_weight = operands(MAX_M, 40, 200, seed=2, with_bias=True)
    alone, alone_residual = skinny_gemm_add_rms_norm(x[5:6].clone(), weight, bias,
                                                     residual[5:6].clone(), norm_weight, EPS,
                                                     config=SPLIT3)
    for m in (6, 11, MAX_M):
        normed, stream = skinny_gemm_add_rms_norm(x[:m], weight, bias, residual[:m].clone(),
                                                  norm_weight, EPS, config=SPLIT3)
        assert torch.equal(normed[5], alone[0]) and torch.equal(stream[5], alone_residual[0]), m


def test_residual_may_be_a_row_strided_view():
    """The residual stream as rows of a wider buffer: only its own columns change."""
    x, weight, _, _, norm_weight = operands(3, 32, 64, seed=4)
    buffer = randn(3, 48, gen=torch.Generator(device=DEVICE).manual_seed(5))
    expected, expected_residual = two_kernels(x, weight, None, buffer[:, :32].clone(),
                                              norm_weight, SPLIT2)
    before = buffer.clone()
    normed, _ = skinny_gemm_add_rms_norm(x, weight, None, buffer[:, :32], norm_weight, EPS,
                                         config=SPLIT2)
    assert torch.equal(buffer[:, :32], expected_residual) and torch.equal(normed, expected)
    assert torch.equal(buffer[:, 32:], before[:, 32:])


def test_refuses_what_it_cannot_serve(monkeypatch):
    x, weight, bias, residual, norm_weight = operands(2, 40, 64, seed=6)
    with pytest.raises(ValueError, match="split"):
        skinny_gemm_add_rms_norm(x, weight, bias, residual, norm_weight, EPS, config=NO_SPLIT)
    with pytest.raises(ValueError, match="split"):  # K too small for two whole tiles
        skinny_gemm_add_rms_norm(x[:, :32], weight[:, :32].contiguous(), bias, residual,
                                 norm_weight, EPS, config=SPLIT2)
    with pytest.raises(ValueError, match="residual"):
        skinny_gemm_add_rms_norm(x, weight, bias, residual[:1], norm_weight, EPS, config=SPLIT2)
    with pytest.raises(ValueError, match="residual"):
        skinny_gemm_add_rms_norm(x, weight, bias, residual.double(), norm_weight, EPS,
                                 config=SPLIT2)
    with pytest.raises(ValueError, match="norm_weight"):
        skinny_gemm_add_rms_norm(x, weight, bias, residual, norm_weight[:39], EPS, config=SPLIT2)
    monkeypatch.setattr(skinny_module, "MAX_SINGLE_PASS", 32)
    with pytest.raises(ValueError, match="one pass"):
        skinny_gemm_add_rms_norm(x, weight, bias, residual, norm_weight, EPS, config=SPLIT2)
    assert MAX_SINGLE_PASS >= 4096  # the real limit holds the 8B's rows


def test_the_worker_takes_it_only_on_cuda_with_a_split(monkeypatch):
    """serves_add_rms_norm: never for CPU tensors (the worker's CPU path is the torch
    reference), nor for shapes without a split."""
    x, weight, _, residual, norm_weight = operands(2, 40, 64, seed=8, dtype=torch.float16)
    assert not serves_add_rms_norm(2, weight, residual, norm_weight)  # no config for (40, 64)
    monkeypatch.setitem(skinny_module.CONFIGS, (40, 64), SkinnyConfig(16, 32, split_k=2,
                                                                      max_m=16))
    assert serves_add_rms_norm(2, weight, residual, norm_weight) == weight.is_cuda


@pytest.mark.gpu
@gpu
def test_gpu_serves_the_decode_shapes_with_a_split(monkeypatch):
    """o_proj and down of Llama-3.1-8B at 1..16 rows, bf16/fp16, one dtype;
    not qkv, gate_up or the lm_head (no split), not 17 rows, not a mixed dtype."""
    for dtype in (torch.bfloat16, torch.float16):
        norm_weight = torch.ones(4096, device="cuda", dtype=dtype)
        for n, k in ((4096, 4096), (4096, 14336)):
            weight = torch.empty(n, k, device="cuda", dtype=dtype)
            for m in (1, 2, 8, 16):
                residual = torch.empty(m, n, device="cuda", dtype=dtype)
                assert serves_add_rms_norm(m, weight, residual, norm_weight), (n, k, m)
            residual = torch.empty(17, n, device="cuda", dtype=dtype)
            assert not serves_add_rms_norm(17, weight, residual, norm_weight)
            residual = torch.empty(1, n, device="cuda", dtype=torch.float32)
            assert not serves_add_rms_norm(1, weight, residual, norm_weight)
            assert not serves_add_rms_norm(1, weight.float(), residual, norm_weight.float())
    for n, k in ((6144, 4096), (28672, 4096), (128256, 4096)):
        weight = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
        residual = torch.empty(1, n, device="cuda", dtype=torch.bfloat16)
        assert not serves_add_rms_norm(1, weight, residual,
                                       torch.ones(n, device="cuda", dtype=torch.bfloat16))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gpu_real_shapes_bitwise_the_two_kernels(n, k, dtype, with_bias):
    """o_proj and down of Llama-3.1-8B at their swept configs: the normed rows and the residual
    stream bitwise the GEMM then kernels/rms_norm.py at every M the worker uses, and a row's
    result the same alone and in a batch."""
    x, weight, bias, residual, norm_weight = operands(MAX_M, n, k, seed=n + k, dtype=dtype,
                                                      device="cuda", with_bias=with_bias)
    residual = residual * 8  # a residual stream larger than the projection, as in a decoder
    for m in (1, 2, 3, 8, MAX_M):
        expected, expected_residual = two_kernels(x[:m], weight, bias, residual[:m].clone(),
                                                  norm_weight)
        normed, stream = skinny_gemm_add_rms_norm(x[:m], weight, bias, residual[:m].clone(),
                                                  norm_weight, EPS)
        assert torch.equal(stream, expected_residual), m
        assert torch.equal(normed, expected), m
        if m > 1:
            assert torch.equal(normed[:1], first), m
        else:
            first = normed


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """No host sync: captured in a CUDA graph (split scratch included), replayed on new inputs
    and a new residual, bitwise as eager."""
    x, weight, bias, residual, norm_weight = operands(4, 4096, 14336, seed=9,
                                                      dtype=torch.bfloat16, device="cuda",
                                                      with_bias=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile outside the capture
        skinny_gemm_add_rms_norm(x, weight, bias, residual.clone(), norm_weight, EPS)
    torch.cuda.current_stream().wait_stream(stream)
    static_residual = residual.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scaled = x * 3.0  # written by the kernel just before
        normed, _ = skinny_gemm_add_rms_norm(scaled, weight, bias, static_residual, norm_weight,
                                             EPS)
    gen = torch.Generator(device="cuda").manual_seed(10)
    for _ in range(3):
        x.copy_(randn(4, 14336, gen=gen, device="cuda", dtype=torch.bfloat16))
        start = randn(4, 4096, gen=gen, device="cuda", dtype=torch.bfloat16)
        static_residual.copy_(start)
        graph.replay()
        expected, expected_residual = two_kernels(x * 3.0, weight, bias, start.clone(),
                                                  norm_weight)
        assert torch.equal(static_residual, expected_residual)
        assert torch.equal(normed, expected)
