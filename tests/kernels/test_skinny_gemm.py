"""skinny_gemm (Triton) against F.linear in fp32, batch invariance, bias, masking, split-K.

On CPU under TRITON_INTERPRET=1 in fp32 and fp16 (the interpreter's tl.dot is wrong for bf16);
bf16 and the real shapes on the GPU (-m gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import skinny_gemm as skinny_module
from kernels.activation import silu_and_mul_ref
from kernels.skinny_gemm import (MAX_M, SkinnyConfig, config_for, skinny_gemm, skinny_gemm_ref,
                                 skinny_gemm_silu_and_mul)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

DOT = SkinnyConfig(block_n=16, block_k=32)
DOT_SPLIT = SkinnyConfig(block_n=16, block_k=32, split_k=3)
WIDE_SPLIT = SkinnyConfig(block_n=32, block_k=16, split_k=2)
CONFIGS = {"one_pass": DOT, "split3": DOT_SPLIT, "wide_split2": WIDE_SPLIT}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def randn(*shape, gen, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def exact(x, weight, bias=None) -> torch.Tensor:
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (3, 40, 96), (16, 37, 100), (5, 16, 1000)])
def test_matches_fp32(config, m, n, k):
    """Odd N (masked columns), K not a multiple of BLOCK_K (masked tail), splits that do not
    divide K."""
    gen = torch.Generator(device=DEVICE).manual_seed(m * n + k)
    x, weight = randn(m, k, gen=gen), randn(n, k, gen=gen)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    assert skinny_gemm(x, weight, config=config, out=out) is out
    assert not out.isnan().any()  # every element written
    assert rel_err(out, exact(x, weight)) < 1e-5


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_bias(config):
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x, weight, bias = randn(4, 100, gen=gen), randn(40, 100, gen=gen), randn(40, gen=gen)
    actual = skinny_gemm(x, weight, bias, config=config)
    assert rel_err(actual, exact(x, weight, bias)) < 1e-5


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_batch_invariant(config):
    """A row's output is bitwise the same alone and in batches of every size up to MAX_M."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    x, weight = randn(MAX_M, 200, gen=gen), randn(48, 200, gen=gen)
    bias = randn(48, gen=gen)
    alone = skinny_gemm(x[5:6].clone(), weight, bias, config=config)
    for m in (6, 8, 11, MAX_M):
        assert torch.equal(skinny_gemm(x[:m], weight, bias, config=config)[5], alone[0]), m
    # and the same as the row placed first in a batch
    batch = torch.cat([x[5:6], x[:3]])
    assert torch.equal(skinny_gemm(batch, weight, bias, config=config)[0], alone[0])


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_more_rows_than_a_tile_are_each_summed_as_alone(config):
    """Over MAX_M rows (tiles of rows, --batch-invariant's every step): each row bitwise as
    alone, wherever it falls in a tile, and the whole close to fp32."""
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    x, weight = randn(3 * MAX_M + 5, 200, gen=gen), randn(48, 200, gen=gen)
    bias = randn(48, gen=gen)
    out = skinny_gemm(x, weight, bias, config=config)
    assert rel_err(out, exact(x, weight, bias)) < 1e-5
    for row in (0, MAX_M - 1, MAX_M, 2 * MAX_M + 7, 3 * MAX_M + 4):
        alone = skinny_gemm(x[row:row + 1].clone(), weight, bias, config=config)
        assert torch.equal(out[row], alone[0]), row


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's tl.dot is wrong for bf16")
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    x, weight = randn(3, 96, gen=gen, dtype=dtype), randn(40, 96, gen=gen, dtype=dtype)
    bias = randn(40, gen=gen, dtype=dtype)
    for config in CONFIGS.values():
        actual = skinny_gemm(x, weight, bias, config=config)
        assert actual.dtype == dtype
        # fp32 sums, one rounding to the output dtype
        torch.testing.assert_close(actual, skinny_gemm_ref(x, weight, bias), atol=2e-2,
                                   rtol=2e-2 if dtype == torch.bfloat16 else 2e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_out_holds_the_rounded_values(dtype):
    """An fp32 ``out`` (logits into a graph's static buffer) gets exactly the values the
    kernel stores in x's dtype, widened: split or not, with a bias."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's tl.dot is wrong for bf16")
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    x, weight = randn(3, 96, gen=gen, dtype=dtype), randn(40, 96, gen=gen, dtype=dtype)
    bias = randn(40, gen=gen, dtype=dtype)
    for config in CONFIGS.values():
        out = torch.full((3, 40), float("nan"), device=DEVICE)
        assert skinny_gemm(x, weight, bias, config=config, out=out) is out
        assert torch.equal(out, skinny_gemm(x, weight, bias, config=config).float())
    with pytest.raises(ValueError, match="float32"):
        skinny_gemm(x, weight, out=torch.empty(3, 40, dtype=torch.float64, device=DEVICE))


GATED = SkinnyConfig(block_n=16, block_k=32)


@pytest.mark.parametrize("m,d,k", [(1, 32, 128), (3, 40, 96), (16, 24, 100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_silu_and_mul_epilogue_matches_two_kernels(m, d, k, with_bias):
    """The gated launch equals the GEMM then SwiGLU (odd d: masked columns; K tails)."""
    gen = torch.Generator(device=DEVICE).manual_seed(m * d + k)
    x, weight = randn(m, k, gen=gen), randn(2 * d, k, gen=gen)
    bias = randn(2 * d, gen=gen) if with_bias else None
    fused = skinny_gemm_silu_and_mul(x, weight, bias, config=GATED)
    assert fused.shape == (m, d) and not fused.isnan().any()
    gate_up = exact(x, weight, bias)
    assert rel_err(fused, silu_and_mul_ref(gate_up)) < 1e-5
    # batch invariant: a row alone is bitwise the row in the batch
    alone = skinny_gemm_silu_and_mul(x[-1:].clone(), weight, bias, config=GATED)
    assert torch.equal(alone[0], fused[-1])


def test_silu_and_mul_epilogue_half_precision_rounds_as_two_kernels():
    """fp16: gate and up rounded before the SwiGLU, silu rounded before the product."""
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    x = randn(2, 64, gen=gen, dtype=torch.float16)
    weight = randn(64, 64, gen=gen, dtype=torch.float16) / 8
    fused = skinny_gemm_silu_and_mul(x, weight, config=GATED)
    two_kernels = silu_and_mul_ref(skinny_gemm(x, weight, config=DOT))
    torch.testing.assert_close(fused, two_kernels, rtol=2e-3, atol=1e-3)


def test_silu_and_mul_epilogue_refuses_splits_and_odd_rows():
    gen = torch.Generator(device=DEVICE).manual_seed(10)
    x = randn(2, 64, gen=gen)
    with pytest.raises(ValueError, match="split"):
        skinny_gemm_silu_and_mul(x, randn(32, 64, gen=gen), config=DOT_SPLIT)
    with pytest.raises(ValueError, match="even"):
        skinny_gemm_silu_and_mul(x, randn(31, 64, gen=gen), config=GATED)


def test_strided_rows_of_x():
    """x may be a row-strided view (the rows of a larger buffer)."""
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    buffer, weight = randn(4, 160, gen=gen), randn(24, 128, gen=gen)
    x = buffer[:, :128]
    assert rel_err(skinny_gemm(x, weight, config=DOT), exact(x, weight)) < 1e-5


def test_edges_and_errors():
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    weight, bias = randn(24, 64, gen=gen), randn(24, gen=gen)
    assert skinny_gemm(torch.empty(0, 64, device=DEVICE), weight).shape == (0, 24)
    empty_k = skinny_gemm(torch.empty(2, 0, device=DEVICE), torch.empty(24, 0, device=DEVICE),
                          bias)
    assert torch.equal(empty_k, bias.expand(2, 24))
    with pytest.raises(ValueError, match="do not match"):
        skinny_gemm(randn(2, 63, gen=gen), weight)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_gemm(randn(2, 64, gen=gen), randn(64, 24, gen=gen).t())


def test_config_table_keys_on_shape_alone(monkeypatch):
    """Configs are chosen per (N, K), never per M (batch invariance); unlisted shapes get the
    default."""
    listed = SkinnyConfig(block_n=32, block_k=64, split_k=2, max_m=4)
    monkeypatch.setitem(skinny_module.CONFIGS, (24, 64), listed)
    assert config_for(24, 64) is listed
    assert config_for(40, 64) == skinny_module.default_config(40, 64)


def test_serves_only_measured_shapes_and_rows(monkeypatch):
    monkeypatch.setitem(skinny_module.CONFIGS, (24, 64), SkinnyConfig(32, 64, max_m=4))
    weight = torch.empty(24, 64, dtype=torch.bfloat16)
    assert not skinny_module.serves(1, weight)  # a CPU weight: F.linear
    if torch.cuda.is_available():
        weight = weight.cuda()
        assert skinny_module.serves(1, weight) and skinny_module.serves(4, weight)
        assert not skinny_module.serves(5, weight) and not skinny_module.serves(0, weight)
        assert not skinny_module.serves(1, weight.float())  # fp32 not measured
        assert not skinny_module.serves(1, torch.empty(40, 64, device="cuda"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336),
                                 (128256, 4096), (1000, 1000)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_real_shapes(n, k, dtype):
    gen = torch.Generator(device="cuda").manual_seed(n + k)
    weight = randn(n, k, gen=gen, device="cuda", dtype=dtype) / k ** 0.5
    x = randn(MAX_M, k, gen=gen, device="cuda", dtype=dtype)
    out = skinny_gemm(x, weight)
    assert rel_err(out, exact(x, weight)) < 5e-3  # one rounding to bf16/fp16
    for m in (1, 2, 3, 8):
        assert torch.equal(skinny_gemm(x[:m], weight), out[:m]), m


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_gpu_fp32_is_not_tf32(config):
    """fp32 in full precision (the worker's fp32 tests compare with cuBLAS's fp32)."""
    gen = torch.Generator(device="cuda").manual_seed(6)
    x, weight = randn(4, 4096, gen=gen, device="cuda"), randn(2048, 4096, gen=gen, device="cuda")
    assert rel_err(skinny_gemm(x, weight, config=config), exact(x, weight)) < 5e-6


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gate_up_silu_and_mul_is_the_two_kernels(dtype):
    """The Llama-3.1-8B gate_up with SwiGLU in the epilogue: bitwise the GEMM then
    kernels/activation.py at every M it serves, and batch invariant."""
    from kernels.activation import silu_and_mul

    gen = torch.Generator(device="cuda").manual_seed(11)
    weight = randn(28672, 4096, gen=gen, device="cuda", dtype=dtype) / 64
    x = randn(MAX_M, 4096, gen=gen, device="cuda", dtype=dtype)
    fused = skinny_gemm_silu_and_mul(x, weight)
    assert torch.equal(fused, silu_and_mul(skinny_gemm(x, weight)))
    for m in (1, 2, 3, 4):
        assert torch.equal(skinny_gemm_silu_and_mul(x[:m], weight), fused[:m]), m


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """No host sync: the call captures into a CUDA graph (split-K scratch included) and
    replays on new inputs, bitwise as eager."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    weight = randn(4096, 14336, gen=gen, device="cuda", dtype=torch.bfloat16)
    bias = randn(4096, gen=gen, device="cuda", dtype=torch.bfloat16)
    x = randn(4, 14336, gen=gen, device="cuda", dtype=torch.bfloat16)
    for config in (None, DOT_SPLIT):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm up: compile outside the capture
            skinny_gemm(x, weight, bias, config=config)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            scaled = x * 3.0  # written by the kernel just before
            out = skinny_gemm(scaled, weight, bias, config=config)
        for _ in range(3):
            x.copy_(randn(4, 14336, gen=gen, device="cuda", dtype=torch.bfloat16))
            graph.replay()
            assert torch.equal(out, skinny_gemm(x * 3.0, weight, bias, config=config)), config


def test_partials_are_the_splits_the_reduce_adds(monkeypatch):
    """skinny_gemm_partials (the TP tail's input) leaves the split-K partials unreduced: added
    in split order they are skinny_gemm's own output, bit for bit; an unsplit config refuses."""
    gen = torch.Generator(device=DEVICE).manual_seed(7)
    x, weight = randn(3, 200, gen=gen), randn(40, 200, gen=gen)  # K 200: three splits
    monkeypatch.setattr(skinny_module, "config_for", lambda n, k, dtype: DOT_SPLIT)
    partials = skinny_module.skinny_gemm_partials(x, weight)
    assert partials.shape == (3, 3, 40) and partials.dtype == torch.float32
    assert torch.equal(partials[0] + partials[1] + partials[2],
                       skinny_gemm(x, weight, config=DOT_SPLIT))
    monkeypatch.setattr(skinny_module, "config_for", lambda n, k, dtype: DOT)
    with pytest.raises(ValueError, match="does not split K"):
        skinny_module.skinny_gemm_partials(x, weight)
