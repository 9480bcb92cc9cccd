"""silu_and_mul (Triton) against silu_and_mul_ref."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul, silu_and_mul_ref
from tests.kernels.tolerances import double_rounding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def randn(*shape, gen, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    return (3.0 * torch.randn(*shape, generator=gen, device=device)).to(dtype)


def test_ref_is_the_hf_expression():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        gate, up = randn(2, 96, gen=gen, device="cpu", dtype=dtype)
        x = torch.cat((gate, up))[None]  # [1, 2 * 96]
        assert torch.equal(silu_and_mul_ref(x)[0], F.silu(gate) * up)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("d", [64, 96, 576, 1500])
def test_matches_ref(num_tokens, d):
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens * d)
    x = randn(num_tokens, 2 * d, gen=gen)
    out = torch.full((num_tokens, d), float("nan"), device=DEVICE)
    assert silu_and_mul(x, out=out) is out
    assert rel_err(out, silu_and_mul_ref(x)) < 1e-5


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's numpy
def test_strided_rows_leading_dims_and_extremes():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    wide = randn(6, 2 * 96 + 10, gen=gen)
    wide[0, :4] = torch.tensor([-200.0, 200.0, -90.0, 90.0])  # exp over/underflow in the gate
    x = wide[:, :2 * 96]  # row stride 202
    actual = silu_and_mul(x)
    assert not actual.isnan().any()
    assert rel_err(actual, silu_and_mul_ref(x)) < 1e-5
    x3 = randn(2, 3, 2 * 64, gen=gen)
    assert silu_and_mul(x3).shape == (2, 3, 64)
    assert rel_err(silu_and_mul(x3), silu_and_mul_ref(x3)) < 1e-5
    out_wide = torch.full((6, 100), float("nan"), device=DEVICE)
    silu_and_mul(x, out=out_wide[:, :96])  # a strided out view
    assert rel_err(out_wide[:, :96], silu_and_mul_ref(x)) < 1e-5
    assert out_wide[:, 96:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_ref(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    x = randn(7, 2 * 96, gen=gen, dtype=dtype)
    actual = silu_and_mul(x)
    assert actual.dtype == dtype
    torch.testing.assert_close(actual, silu_and_mul_ref(x))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 257, 4096])
def test_gpu_real_sizes(dtype, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = randn(num_tokens, 2 * 14336, gen=gen, device="cuda", dtype=dtype)
    out = torch.full((num_tokens, 14336), float("nan"), device="cuda", dtype=dtype)
    actual, expected = silu_and_mul(x, out=out), silu_and_mul_ref(x)
    torch.testing.assert_close(actual, expected, **double_rounding(dtype))
    assert (actual != expected).float().mean().item() < 0.01  # rounding flips only


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """No host sync: the call captures into a CUDA graph and replays on new inputs."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    x = randn(64, 2 * 14336, gen=gen, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(64, 14336, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile outside the capture
        silu_and_mul(x, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        silu_and_mul(x, out=out)
    x.copy_(randn(64, 2 * 14336, gen=gen, device="cuda", dtype=torch.bfloat16))
    graph.replay()
    assert torch.equal(out, silu_and_mul(x))
