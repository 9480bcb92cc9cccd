"""rms_norm (Triton) against rms_norm_ref, and rms_norm_ref against HF's Llama RMSNorm."""

from __future__ import annotations

import pytest
import torch

import kernels.rms_norm as rms_norm_module
from kernels.rms_norm import rms_norm, rms_norm_ref
from tests.kernels.tolerances import double_rounding

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def randn(*shape, gen, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def make_weight(hidden_size: int, gen, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    return (1.0 + 0.5 * torch.randn(hidden_size, generator=gen, device=device)).to(dtype)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("hidden_size", [64, 96, 576])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_ref(num_tokens, hidden_size, with_residual):
    gen = torch.Generator(device=DEVICE).manual_seed(hidden_size + num_tokens)
    x = 3.0 * randn(num_tokens, hidden_size, gen=gen)
    weight = make_weight(hidden_size, gen)
    residual = randn(num_tokens, hidden_size, gen=gen) if with_residual else None
    expected = rms_norm_ref(x, weight, 1e-5, None if residual is None else residual.clone())
    actual = rms_norm(x, weight, 1e-5, None if residual is None else residual.clone())
    if with_residual:
        (expected, expected_residual), (actual, actual_residual) = expected, actual
        assert torch.equal(actual_residual, expected_residual)  # the same fp32 add
    assert not actual.isnan().any()
    assert rel_err(actual, expected) < 1e-5


def test_residual_is_updated_in_place():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    x, residual = randn(5, 96, gen=gen), randn(5, 96, gen=gen)
    weight = make_weight(96, gen)
    expected_sum = x + residual
    normed, returned = rms_norm(x, weight, 1e-6, residual)
    assert returned is residual
    assert torch.equal(residual, expected_sum)
    assert rel_err(normed, rms_norm_ref(expected_sum, weight, 1e-6)) < 1e-5


def hf_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward."""
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return weight * (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)


def test_ref_is_the_hf_rmsnorm():
    gen = torch.Generator().manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        x = randn(7, 576, gen=gen, device="cpu", dtype=dtype)
        residual = randn(7, 576, gen=gen, device="cpu", dtype=dtype)
        weight = make_weight(576, gen, device="cpu", dtype=dtype)
        assert torch.equal(rms_norm_ref(x, weight, 1e-5), hf_rms_norm(x, weight, 1e-5))
        summed = x + residual  # the decoder layer's residual add, in the activation dtype
        normed, new_residual = rms_norm_ref(x, weight, 1e-5, residual)
        assert torch.equal(new_residual, summed)
        assert torch.equal(normed, hf_rms_norm(summed, weight, 1e-5))


@pytest.mark.parametrize("hidden_size", [96, 200])
@pytest.mark.parametrize("with_residual", [False, True])
def test_two_pass_loop(monkeypatch, hidden_size, with_residual):
    """Rows longer than MAX_SINGLE_PASS, shrunk here so the loop runs at small sizes."""
    monkeypatch.setattr(rms_norm_module, "MAX_SINGLE_PASS", 64)
    monkeypatch.setattr(rms_norm_module, "LOOP_BLOCK", 32)
    gen = torch.Generator(device=DEVICE).manual_seed(hidden_size)
    x = randn(7, hidden_size, gen=gen)
    weight = make_weight(hidden_size, gen)
    if with_residual:
        residual = randn(7, hidden_size, gen=gen)
        expected, expected_residual = rms_norm_ref(x, weight, 1e-5, residual.clone())
        actual, actual_residual = rms_norm(x, weight, 1e-5, residual)
        assert torch.equal(actual_residual, expected_residual)
    else:
        expected, actual = rms_norm_ref(x, weight, 1e-5), rms_norm(x, weight, 1e-5)
    assert rel_err(actual, expected) < 1e-5


@pytest.mark.parametrize("num_heads,head_dim", [(9, 64), (4, 128)])
def test_per_head_on_strided_qkv_view(num_heads, head_dim):
    """Qwen3's q/k norm: [num_tokens, num_heads, head_dim] split from a fused qkv output."""
    gen = torch.Generator(device=DEVICE).manual_seed(head_dim)
    num_tokens, num_kv_heads = 7, 3
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, gen=gen)
    q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    q_weight, k_weight = make_weight(head_dim, gen), make_weight(head_dim, gen)
    for x, weight in ((q, q_weight), (k, k_weight)):
        out = torch.full(x.shape, float("nan"), device=DEVICE)
        rms_norm(x, weight, 1e-6, out=out)
        assert rel_err(out, rms_norm_ref(x.contiguous(), weight, 1e-6)) < 1e-5
    expected = rms_norm_ref(q.contiguous(), q_weight, 1e-6)
    rms_norm(q, q_weight, 1e-6, out=q)  # in place, into the qkv buffer
    assert rel_err(q, expected) < 1e-5


def test_any_leading_shape():
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    x = randn(2, 3, 5, 64, gen=gen)
    weight = make_weight(64, gen)
    assert rel_err(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5)) < 1e-5
    one_row = x[0, 0, 0]  # [64]
    assert rel_err(rms_norm(one_row, weight, 1e-5), rms_norm_ref(one_row, weight, 1e-5)) < 1e-5


def test_out_buffer_is_fully_written():
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    x, weight = randn(33, 576, gen=gen), make_weight(576, gen)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, weight, 1e-5, out=out) is out
    assert rel_err(out, rms_norm_ref(x, weight, 1e-5)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_close_to_ref(dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    x, residual = randn(7, 96, gen=gen, dtype=dtype), randn(7, 96, gen=gen, dtype=dtype)
    weight = make_weight(96, gen, dtype=dtype)
    expected, expected_residual = rms_norm_ref(x, weight, 1e-5, residual.clone())
    actual, actual_residual = rms_norm(x, weight, 1e-5, residual)
    assert actual.dtype == dtype
    # (the interpreter rounds fp32 -> bf16 toward zero, the GPU to nearest even)
    torch.testing.assert_close(actual_residual, expected_residual)
    torch.testing.assert_close(actual, expected)  # dtype-aware tolerances (about 1 ulp)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 257, 4096])
@pytest.mark.parametrize("hidden_size", [4096, 8192, 16384])
def test_gpu_real_sizes(dtype, num_tokens, hidden_size):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    x = randn(num_tokens, hidden_size, gen=gen, device="cuda", dtype=dtype)
    residual = randn(num_tokens, hidden_size, gen=gen, device="cuda", dtype=dtype)
    weight = make_weight(hidden_size, gen, device="cuda", dtype=dtype)
    expected, expected_residual = rms_norm_ref(x, weight, 1e-5, residual.clone())
    out = torch.full_like(x, float("nan"))
    actual, actual_residual = rms_norm(x, weight, 1e-5, residual, out=out)
    assert torch.equal(actual_residual, expected_residual)
    torch.testing.assert_close(actual, expected, **double_rounding(dtype))
    # elements off the reference by more than rounding of the last step are rare
    assert (actual != expected).float().mean().item() < 0.01
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5),
                               **double_rounding(dtype))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_per_head_norm(dtype):
    gen = torch.Generator(device="cuda").manual_seed(6)
    num_tokens, num_heads, num_kv_heads, head_dim = 1000, 32, 8, 128
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = randn(num_tokens, q_size + 2 * kv_size, gen=gen, device="cuda", dtype=dtype)
    q = qkv[:, :q_size].view(num_tokens, num_heads, head_dim)
    weight = make_weight(head_dim, gen, device="cuda", dtype=dtype)
    torch.testing.assert_close(rms_norm(q, weight, 1e-6),
                               rms_norm_ref(q.contiguous(), weight, 1e-6))


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """No host sync: the fused call captures into a CUDA graph and replays on new inputs."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    x = randn(64, 4096, gen=gen, device="cuda", dtype=torch.bfloat16)
    residual = randn(64, 4096, gen=gen, device="cuda", dtype=torch.bfloat16)
    weight = make_weight(4096, gen, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile outside the capture
        rms_norm(x, weight, 1e-5, residual.clone(), out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(x, weight, 1e-5, residual, out=out)
    for _ in range(2):
        x.copy_(randn(64, 4096, gen=gen, device="cuda", dtype=torch.bfloat16))
        start = randn(64, 4096, gen=gen, device="cuda", dtype=torch.bfloat16)
        residual.copy_(start)
        graph.replay()
        expected, expected_residual = rms_norm(x, weight, 1e-5, start.clone())
        assert torch.equal(out, expected) and torch.equal(residual, expected_residual)
