"""write_kv_cache (Triton) against write_kv_cache_ref, and its skip of negative slots."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import write_kv_cache
from kernels.paged_attention_ref import allocate_kv_cache, write_kv_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def make_inputs(num_tokens: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                block_size: int, dtype: torch.dtype, device: str, fused: bool, seed: int = 0):
    """Fresh random K/V (optionally strided views of a fused qkv row), a NaN-poisoned cache
    and distinct random slots."""
    gen = torch.Generator(device=device).manual_seed(seed)
    kv_size = num_kv_heads * head_dim
    if fused:  # [num_tokens, q_size + 2 * kv_size], split like Attention.forward does
        qkv = torch.randn(num_tokens, 3 * kv_size, generator=gen, device=device).to(dtype)
        _, key, value = qkv.split([kv_size, kv_size, kv_size], dim=-1)
        key = key.view(num_tokens, num_kv_heads, head_dim)
        value = value.view(num_tokens, num_kv_heads, head_dim)
    else:
        shape = (num_tokens, num_kv_heads, head_dim)
        key = torch.randn(shape, generator=gen, device=device).to(dtype)
        value = torch.randn(shape, generator=gen, device=device).to(dtype)
    kv_cache = allocate_kv_cache(2, num_blocks, block_size, num_kv_heads, head_dim, dtype, device)
    kv_cache.fill_(float("nan"))
    num_slots = num_blocks * block_size
    slot_mapping = torch.randperm(num_slots, generator=gen, device=device)[:num_tokens]
    return key, value, kv_cache, slot_mapping


def assert_same_cache(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(actual.isnan(), expected.isnan())  # same slots written, no others
    assert torch.equal(actual.nan_to_num(0.0), expected.nan_to_num(0.0))  # a copy is exact


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("num_kv_heads,head_dim", [(3, 64), (1, 128), (5, 96)])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_matches_ref(num_tokens, num_kv_heads, head_dim, fused, slot_dtype):
    key, value, kv_cache, slots = make_inputs(num_tokens, num_kv_heads, head_dim, num_blocks=6,
                                              block_size=16, dtype=torch.float32, device=DEVICE,
                                              fused=fused, seed=num_tokens)
    expected = kv_cache.clone()
    write_kv_cache_ref(key, value, expected[1, 0], expected[1, 1], slots)
    write_kv_cache(key, value, kv_cache[1, 0], kv_cache[1, 1], slots.to(slot_dtype))
    assert_same_cache(kv_cache, expected)  # layer 0 untouched in both


def test_negative_slots_are_skipped():
    num_tokens = 9
    key, value, kv_cache, slots = make_inputs(num_tokens, 3, 64, num_blocks=4, block_size=8,
                                              dtype=torch.float32, device=DEVICE, fused=True)
    padding = torch.tensor([0, 4, 8], device=DEVICE)
    slots[padding] = -1
    write_kv_cache(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    real = torch.ones(num_tokens, dtype=torch.bool, device=DEVICE)
    real[padding] = False
    expected = allocate_kv_cache(2, 4, 8, 3, 64, torch.float32, DEVICE).fill_(float("nan"))
    write_kv_cache_ref(key[real], value[real], expected[0, 0], expected[0, 1], slots[real])
    assert_same_cache(kv_cache, expected)
    assert kv_cache.isnan().sum() == kv_cache.numel() - 2 * 6 * 3 * 64  # only 6 tokens written


def test_all_padding_writes_nothing():
    key, value, kv_cache, slots = make_inputs(4, 2, 64, num_blocks=2, block_size=4,
                                              dtype=torch.float32, device=DEVICE, fused=False)
    write_kv_cache(key, value, kv_cache[0, 0], kv_cache[0, 1], torch.full_like(slots, -1))
    assert kv_cache.isnan().all()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 256, 8192])
def test_gpu_real_sizes(dtype, num_tokens):
    # Llama-3.1-8B: 8 KV heads, head_dim 128, fused qkv with 32 query heads
    key, value, kv_cache, slots = make_inputs(num_tokens, 8, 128, num_blocks=1024, block_size=16,
                                              dtype=dtype, device="cuda", fused=True,
                                              seed=num_tokens)
    slots[::5] = -1  # padding mixed in
    real = slots >= 0
    expected = kv_cache.clone()
    write_kv_cache_ref(key[real], value[real], expected[0, 0], expected[0, 1], slots[real])
    write_kv_cache(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    assert_same_cache(kv_cache, expected)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """No host sync: the call captures into a CUDA graph; replays honour new slots and -1."""
    key, value, kv_cache, slots = make_inputs(64, 8, 128, num_blocks=64, block_size=16,
                                              dtype=torch.bfloat16, device="cuda", fused=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile outside the capture
        write_kv_cache(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv_cache(key, value, kv_cache[0, 0], kv_cache[0, 1], slots)
    kv_cache.fill_(float("nan"))
    new_slots = torch.randperm(64 * 16, device="cuda")[:64]
    new_slots[-8:] = -1  # padding rows of the captured batch
    slots.copy_(new_slots)
    graph.replay()
    real = new_slots >= 0
    expected = torch.full_like(kv_cache, float("nan"))
    write_kv_cache_ref(key[real], value[real], expected[0, 0], expected[0, 1], new_slots[real])
    assert_same_cache(kv_cache, expected)


def rotary_inputs(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: str, seed: int = 0):
    """A fused qkv output split into strided views, positions, the Llama-3.1 cos/sin cache,
    a NaN-poisoned cache and distinct slots with padding (-1) mixed in."""
    from kernels.rotary import build_cos_sin_cache
    from tests.kernels.test_rotary import llama31_config
    from services.worker.model import compute_inv_freq

    gen = torch.Generator(device=device).manual_seed(seed)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=gen, device=device).to(dtype)
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    query = query.view(num_tokens, num_heads, head_dim)
    key = key.view(num_tokens, num_kv_heads, head_dim)
    value = value.view(num_tokens, num_kv_heads, head_dim)
    config = llama31_config(num_heads, num_kv_heads, head_dim)
    cos_sin = build_cos_sin_cache(compute_inv_freq(config).to(device), 4096)
    positions = torch.randint(0, 4096, (num_tokens,), generator=gen, device=device)
    kv_cache = allocate_kv_cache(2, 8, 16, num_kv_heads, head_dim, dtype, device)
    kv_cache.fill_(float("nan"))
    slots = torch.randperm(8 * 16, generator=gen, device=device)[:num_tokens]
    slots[::3] = -1
    return qkv, query, key, value, positions, cos_sin, kv_cache, slots


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 4, 128), (6, 2, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rotary_and_write_equals_the_two_ops(num_tokens, num_heads, num_kv_heads, head_dim,
                                            dtype):
    """Bitwise the rotary kernel's numbers (q and k rotated in place, v untouched) and the
    rotated keys and values in the real tokens' slots only."""
    from kernels.kv_cache import rotary_and_write_kv_cache, rotary_and_write_kv_cache_ref
    from kernels.rotary import apply_rotary

    qkv, query, key, value, positions, cos_sin, kv_cache, slots = rotary_inputs(
        num_tokens, num_heads, num_kv_heads, head_dim, dtype, DEVICE, seed=num_tokens)
    expected_qkv, expected_cache = qkv.clone(), kv_cache.clone()
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    e_query, e_key, e_value = expected_qkv.split([q_size, kv_size, kv_size], dim=-1)
    e_query, e_key = e_query.view_as(query), e_key.view_as(key)
    rotary_and_write_kv_cache_ref(e_query, e_key, e_value.view_as(value), positions, cos_sin,
                                  expected_cache[1, 0], expected_cache[1, 1], slots)
    rotary_and_write_kv_cache(query, key, value, positions, cos_sin, kv_cache[1, 0],
                              kv_cache[1, 1], slots)
    assert torch.equal(qkv, expected_qkv)
    assert_same_cache(kv_cache, expected_cache)
    # and the same as the two kernels one after the other
    two_qkv, two_cache = rotary_inputs(num_tokens, num_heads, num_kv_heads, head_dim, dtype,
                                       DEVICE, seed=num_tokens)[0::6]
    two_query, two_key, two_value = two_qkv.split([q_size, kv_size, kv_size], dim=-1)
    apply_rotary(two_query.view_as(query), two_key.view_as(key), positions, cos_sin)
    write_kv_cache(two_key.view_as(key), two_value.view_as(value), two_cache[1, 0],
                   two_cache[1, 1], slots)
    assert torch.equal(qkv, two_qkv)
    assert_same_cache(kv_cache, two_cache)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 300, 4096])
def test_gpu_rotary_and_write_real_sizes(dtype, num_tokens):
    """Llama-3.1-8B's heads: bitwise the rotary and KV-write kernels, also under a graph."""
    from kernels.kv_cache import rotary_and_write_kv_cache
    from kernels.rotary import apply_rotary

    inputs = rotary_inputs(num_tokens, 32, 8, 128, dtype, "cuda", seed=num_tokens)
    qkv, query, key, value, positions, cos_sin, kv_cache, slots = inputs
    kv_cache = allocate_kv_cache(2, 512, 16, 8, 128, dtype, "cuda").fill_(float("nan"))
    slots = torch.randperm(512 * 16, device="cuda")[:num_tokens]
    slots[::5] = -1
    two_qkv, two_cache = qkv.clone(), kv_cache.clone()
    two_query, two_key, two_value = two_qkv.split([4096, 1024, 1024], dim=-1)
    apply_rotary(two_query.view_as(query), two_key.view_as(key), positions, cos_sin)
    write_kv_cache(two_key.view_as(key), two_value.view_as(value), two_cache[0, 0],
                   two_cache[0, 1], slots)
    original = qkv.clone()
    rotary_and_write_kv_cache(query, key, value, positions, cos_sin, kv_cache[0, 0],
                              kv_cache[0, 1], slots)
    assert torch.equal(qkv, two_qkv)
    assert_same_cache(kv_cache, two_cache)
    # captured once, replayed on the original inputs: the same result again
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rotary_and_write_kv_cache(query, key, value, positions, cos_sin, kv_cache[0, 0],
                                  kv_cache[0, 1], slots)
    qkv.copy_(original)
    kv_cache.fill_(float("nan"))
    graph.replay()
    assert torch.equal(qkv, two_qkv)
    assert_same_cache(kv_cache, two_cache)
