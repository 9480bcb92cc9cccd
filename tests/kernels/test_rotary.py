"""apply_rotary (Triton) against apply_rotary_ref; the ref and the cache against HF's formulas."""

from __future__ import annotations

import pytest
import torch

from kernels.rotary import apply_rotary, apply_rotary_ref, build_cos_sin_cache
from services.worker.model import ModelConfig, compute_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def llama31_config(num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128) -> ModelConfig:
    return ModelConfig.from_dict({
        "model_type": "llama", "vocab_size": 128256, "hidden_size": num_heads * head_dim,
        "intermediate_size": 14336, "num_hidden_layers": 1, "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads, "head_dim": head_dim, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 131072, "rope_theta": 500000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}})


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' apply_rotary_pos_emb for one of q, k. x: [num_tokens, num_heads, head_dim];
    cos, sin: [num_tokens, head_dim] in x's dtype."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None, :] + torch.cat((-x2, x1), dim=-1) * sin[:, None, :]


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def make_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device,
             fused: bool, gen):
    """query, key (strided views of one fused qkv row when fused) and the whole buffer."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    if fused:
        qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen, device=device).to(dtype)
        q, k, _ = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(num_tokens, num_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
        return q, k, qkv
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen, device=device).to(dtype)
    return q, k, None


def test_cache_matches_model_angles():
    config = llama31_config(head_dim=64)
    inv_freq = compute_inv_freq(config)
    cache = build_cos_sin_cache(inv_freq, 5000)
    assert cache.shape == (5000, 64) and cache.dtype == torch.float32
    positions = torch.tensor([0, 1, 17, 4095, 4999])
    freqs = positions[:, None].float() * inv_freq[None, :]  # as transformers computes them
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = cache[positions].chunk(2, dim=-1)
    assert torch.equal(torch.cat((cos, cos), -1), angles.cos())
    assert torch.equal(torch.cat((sin, sin), -1), angles.sin())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ref_is_the_hf_rotary(dtype):
    gen = torch.Generator().manual_seed(0)
    config = llama31_config(9, 3, 64)
    inv_freq = compute_inv_freq(config)
    cache = build_cos_sin_cache(inv_freq, 2048)
    positions = torch.randint(0, 2048, (11,), generator=gen)
    q, k, _ = make_qkv(11, 9, 3, 64, dtype, "cpu", fused=False, gen=gen)
    freqs = positions[:, None].float() * inv_freq[None, :]  # as transformers computes them
    angles = torch.cat((freqs, freqs), dim=-1)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    expected_q, expected_k = hf_rotary(q, cos, sin), hf_rotary(k, cos, sin)
    apply_rotary_ref(q, k, positions, cache)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 96)])
@pytest.mark.parametrize("fused", [False, True])
def test_matches_ref(num_tokens, num_heads, num_kv_heads, head_dim, fused):
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens * head_dim)
    cache = build_cos_sin_cache(compute_inv_freq(llama31_config(num_heads, num_kv_heads, head_dim))
                                .to(DEVICE), 10000)
    positions = torch.randint(0, 10000, (num_tokens,), generator=gen, device=DEVICE)
    q, k, qkv = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, torch.float32, DEVICE,
                         fused, gen)
    expected_q, expected_k = q.clone(), k.clone()
    apply_rotary_ref(expected_q, expected_k, positions, cache)
    v_size = num_kv_heads * head_dim
    untouched_v = None if qkv is None else qkv[:, -v_size:].clone()
    apply_rotary(q, k, positions, cache)
    assert rel_err(q, expected_q) < 1e-5 and rel_err(k, expected_k) < 1e-5
    if qkv is not None:  # v shares the buffer and stays as it was
        assert torch.equal(qkv[:, -untouched_v.shape[1]:], untouched_v)


def test_int32_positions_and_position_zero():
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    cache = build_cos_sin_cache(compute_inv_freq(llama31_config(9, 3, 64)).to(DEVICE), 64)
    positions = torch.tensor([0, 63, 5], dtype=torch.int32, device=DEVICE)
    q, k, _ = make_qkv(3, 9, 3, 64, torch.float32, DEVICE, fused=False, gen=gen)
    q0, k0 = q[0].clone(), k[0].clone()
    expected_q, expected_k = q.clone(), k.clone()
    apply_rotary_ref(expected_q, expected_k, positions, cache)
    apply_rotary(q, k, positions, cache)
    assert torch.equal(q[0], q0) and torch.equal(k[0], k0)  # position 0 is the identity
    assert rel_err(q, expected_q) < 1e-5 and rel_err(k, expected_k) < 1e-5


def assert_kernel_equals_ref(q, k, positions, cache) -> None:
    """The kernel rotates q and k in place to exactly what the reference gives."""
    expected_q, expected_k = q.clone(), k.clone()
    apply_rotary_ref(expected_q, expected_k, positions, cache)
    apply_rotary(q, k, positions, cache)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)


def test_fp16_is_exact():
    """Half precision: each product rounded like torch does, so the kernel equals the ref."""
    gen = torch.Generator(device=DEVICE).manual_seed(2)
    cache = build_cos_sin_cache(compute_inv_freq(llama31_config(9, 3, 64)).to(DEVICE), 4096)
    positions = torch.randint(0, 4096, (7,), generator=gen, device=DEVICE)
    q, k, _ = make_qkv(7, 9, 3, 64, torch.float16, DEVICE, fused=True, gen=gen)
    assert_kernel_equals_ref(q, k, positions, cache)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 300, 4096])
def test_gpu_real_sizes(dtype, num_tokens):
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    config = llama31_config()  # 32 heads, 8 KV heads, head_dim 128, Llama-3.1 scaling
    cache = build_cos_sin_cache(compute_inv_freq(config).cuda(), config.max_position_embeddings)
    positions = torch.randint(0, config.max_position_embeddings, (num_tokens,), generator=gen,
                              device="cuda")
    q, k, _ = make_qkv(num_tokens, 32, 8, 128, dtype, "cuda", fused=True, gen=gen)
    assert_kernel_equals_ref(q, k, positions, cache)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """No host sync: the in-place call captures into a CUDA graph and replays on new inputs."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    config = llama31_config()
    cache = build_cos_sin_cache(compute_inv_freq(config).cuda(), 8192)
    positions = torch.randint(0, 8192, (64,), generator=gen, device="cuda")
    q, k, _ = make_qkv(64, 32, 8, 128, torch.bfloat16, "cuda", fused=True, gen=gen)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile outside the capture
        apply_rotary(q, k, positions, cache)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rotary(q, k, positions, cache)
    new_q, new_k, _ = make_qkv(64, 32, 8, 128, torch.bfloat16, "cuda", fused=False, gen=gen)
    q.copy_(new_q)
    k.copy_(new_k)
    positions.copy_(torch.randint(0, 8192, (64,), generator=gen, device="cuda"))
    graph.replay()
    apply_rotary_ref(new_q, new_k, positions, cache)
    assert torch.equal(q, new_q) and torch.equal(k, new_k)


# (bf16 on the GPU only: the interpreter's fp32 -> bf16 conversion does not round to nearest)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, pytest.param(
    torch.bfloat16, marks=[pytest.mark.gpu, gpu])])
@pytest.mark.parametrize("num_tokens,num_heads,head_dim", [(5, 16, 80), (33, 3, 64)])
def test_fp32_math_rotary_equals_its_ref_exactly_on_qkv_views(dtype, num_tokens, num_heads,
                                                               head_dim):
    """The vision tower's rotary (one rounding at the end): bitwise its torch reference, on
    q and k views of one fused qkv output, v untouched."""
    from kernels.rotary import apply_rotary_fp32, apply_rotary_fp32_ref
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    qkv = torch.randn(num_tokens, 3, num_heads, head_dim, generator=gen, device=DEVICE).to(dtype)
    angles = torch.rand(num_tokens, head_dim // 2, generator=gen, device=DEVICE) * 50
    cos_sin = torch.cat((angles.cos(), angles.sin()), dim=-1)
    original, expected = qkv.clone(), qkv.clone()
    apply_rotary_fp32_ref(*expected.unbind(1)[:2], cos_sin)
    apply_rotary_fp32(*qkv.unbind(1)[:2], cos_sin)
    assert torch.equal(qkv, expected)
    assert torch.equal(qkv[:, 2], original[:, 2]) and not torch.equal(qkv[:, 0], original[:, 0])
