"""An FP8 KV cache (--kv-cache-dtype fp8): the Triton KV writes against their references
(bitwise), paged attention over an FP8 cache against the reference on the same cache, and the
quantization error itself against an unquantized cache.

On CPU under Triton's interpreter with fp16 queries (the interpreter's bf16 dots read raw
bits: tests/kernels/test_paged_attention_triton.py); the `gpu` tests use bf16 and real shapes.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_cache import rotary_and_write_kv_cache, rotary_and_write_kv_cache_ref, write_kv_cache
from kernels.paged_attention import paged_attention
from kernels.paged_attention_ref import (FP8_KV_DTYPE, FP8_KV_MAX, allocate_kv_cache,
                                         paged_attention_ref, quantize_kv, write_kv_cache_ref)
from tests.kernels.test_kv_cache import make_inputs, rotary_inputs
from tests.kernels.test_paged_attention import make_batch
from tests.kernels.test_paged_attention_triton import SEQ_SETS, gpu_batch, rel_error

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def fp8_cache_like(kv_cache: torch.Tensor) -> torch.Tensor:
    """An FP8 cache of kv_cache's shape, every byte 0x7f (NaN in e4m3): unwritten slots show."""
    return torch.full(kv_cache.shape, 0x7F, dtype=torch.uint8, device=kv_cache.device
                      ).view(FP8_KV_DTYPE)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def assert_same_fp8(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bitwise, but for Triton's interpreter, which drops a rounding's carry into the exponent
    (7.79 -> 4, not 8; tests/kernels/test_fp8.py), rounds subnormals (below 2^-6) its own way
    and ties away from zero (fp32 inputs: ties are rare): there those values are left out, a few
    percent at most."""
    differ = actual.view(torch.uint8) != expected.view(torch.uint8)
    if actual.device.type == "cpu":
        ref = expected.float()
        carry_lost = (actual.float() * 2 == ref) & (ref.abs().log2().frac() == 0)
        interpreter_rounding = carry_lost | (ref.abs() <= 2.0 ** -6)
        assert (differ & interpreter_rounding).float().mean() < 0.05
        differ &= ~interpreter_rounding
    assert not differ.any()


@pytest.mark.parametrize("k_scale,v_scale", [(1.0, 1.0), (0.25, 2.0 ** -7), (0.0137, 3.1)])
@pytest.mark.parametrize("num_tokens", [1, 19])
def test_write_matches_ref_bitwise(k_scale, v_scale, num_tokens):
    key, value, kv_cache, slots = make_inputs(num_tokens, 3, 64, num_blocks=4, block_size=8,
                                              dtype=torch.float32, device=DEVICE, fused=True)
    key = key * 40  # past 448 * scale for the small scales: the clamp is exercised
    slots[1::4] = -1
    actual, expected = fp8_cache_like(kv_cache), fp8_cache_like(kv_cache)
    write_kv_cache(key, value, actual[1, 0], actual[1, 1], slots, k_scale, v_scale)
    write_kv_cache_ref(key, value, expected[1, 0], expected[1, 1], slots, k_scale, v_scale)
    assert_same_fp8(actual, expected)
    kept = slots >= 0
    stored = actual[1, 0].view(-1, 3, 64)[slots[kept]].float()
    assert stored.abs().max() <= FP8_KV_MAX and not stored.isnan().any()
    assert same_bytes(actual[0], fp8_cache_like(kv_cache)[0])  # layer 0 untouched


@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_rotary_and_write_matches_ref_bitwise(num_tokens):
    qkv, query, key, value, positions, cos_sin, kv_cache, slots = rotary_inputs(
        num_tokens, 6, 2, 96, torch.float32, DEVICE, seed=num_tokens)
    expected_qkv = qkv.clone()
    e_query, e_key, e_value = expected_qkv.split([6 * 96, 2 * 96, 2 * 96], dim=-1)
    actual, expected = fp8_cache_like(kv_cache), fp8_cache_like(kv_cache)
    rotary_and_write_kv_cache_ref(e_query.view_as(query), e_key.view_as(key),
                                  e_value.view_as(value), positions, cos_sin, expected[1, 0],
                                  expected[1, 1], slots, 0.5, 0.125)
    rotary_and_write_kv_cache(query, key, value, positions, cos_sin, actual[1, 0], actual[1, 1],
                              slots, 0.5, 0.125)
    assert torch.equal(qkv, expected_qkv)
    assert_same_fp8(actual, expected)


def fp8_batch(seqs, k_scale, v_scale, num_heads=8, num_kv_heads=2, head_dim=64):
    """make_batch's cache quantized into FP8 with these scales, and its fp16 queries."""
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, _ = make_batch(
        seqs, 16, num_heads, num_kv_heads, head_dim)
    return (query.half(), quantize_kv(key_cache, k_scale), quantize_kv(value_cache, v_scale),
            key_cache, value_cache, block_tables, seq_lens, query_start_loc)


@pytest.mark.parametrize("seqs_name", ["many_decodes", "mixed", "chunks"])
@pytest.mark.parametrize("num_segments", [None, 4])
def test_attention_over_fp8_matches_ref(seqs_name, num_segments):
    """The kernel on an FP8 cache equals the reference on the same cache (widened exactly,
    power-of-2 scales), and stays near attention over the unquantized cache."""
    seqs = SEQ_SETS[seqs_name]
    k_scale, v_scale = 2.0 ** -5, 2.0 ** -6
    query, key_fp8, value_fp8, key_cache, value_cache, tables, seq_lens, starts = fp8_batch(
        seqs, k_scale, v_scale)
    scale = 64 ** -0.5
    out = paged_attention(query, key_fp8, value_fp8, tables, seq_lens, starts, scale,
                          max_query_len=max(q for _, q in seqs),
                          max_seq_len=max(s for s, _ in seqs), num_segments=num_segments,
                          k_scale=k_scale, v_scale=v_scale).float()
    ref = paged_attention_ref(query.float(), key_fp8, value_fp8, tables, seq_lens, starts,
                              scale, k_scale, v_scale)
    assert rel_error(out, ref) < 2e-3
    unquantized = paged_attention_ref(query.float(), key_cache, value_cache, tables, seq_lens,
                                      starts, scale)
    assert 1e-3 < rel_error(out, unquantized) < 0.06  # e4m3: 3 mantissa bits


def test_scales_only_apply_to_fp8_caches():
    """A bf16/fp16/fp32 cache ignores the scales (the worker passes 1.0 then anyway)."""
    seqs = SEQ_SETS["mixed"]
    query, _, _, key_cache, value_cache, tables, seq_lens, starts = fp8_batch(seqs, 1.0, 1.0)
    kwargs = dict(max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs))
    args = (query, key_cache.half(), value_cache.half(), tables, seq_lens, starts, 0.125)
    assert torch.equal(paged_attention(*args, **kwargs),
                       paged_attention(*args, **kwargs, k_scale=3.0, v_scale=0.5))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("seqs", [[(16384, 1)], [(4096 - 7 * i, 1) for i in range(64)],
                                  [(3000 + i, 1) for i in range(30)] + [(1500, 1500), (9000, 512)]])
def test_gpu_attention_over_fp8(seqs):
    """Llama-3.1-8B's heads, bf16 queries: the kernel on an FP8 cache against the reference on
    the same cache, and against the bf16 cache it was quantized from."""
    query, key_cache, value_cache, tables, seq_lens, starts = gpu_batch(
        seqs, 32, 8, 128, torch.bfloat16)
    k_scale, v_scale = 2.0 ** -6, 2.0 ** -6
    key_fp8, value_fp8 = quantize_kv(key_cache, k_scale), quantize_kv(value_cache, v_scale)
    scale = 128 ** -0.5
    kwargs = dict(max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs))
    out = paged_attention(query, key_fp8, value_fp8, tables, seq_lens, starts, scale, **kwargs,
                          k_scale=k_scale, v_scale=v_scale).float()
    ref = paged_attention_ref(query.float(), key_fp8, value_fp8, tables, seq_lens, starts,
                              scale, k_scale, v_scale)
    assert rel_error(out, ref) < 2e-2
    unquantized = paged_attention_ref(query.float(), key_cache.float(), value_cache.float(),
                                      tables, seq_lens, starts, scale)
    assert rel_error(out, unquantized) < 0.08


@pytest.mark.gpu
@needs_cuda
def test_gpu_write_matches_ref_bitwise():
    key, value, kv_cache, slots = make_inputs(4096, 8, 128, num_blocks=512, block_size=16,
                                              dtype=torch.bfloat16, device="cuda", fused=True)
    actual, expected = fp8_cache_like(kv_cache), fp8_cache_like(kv_cache)
    write_kv_cache(key, value, actual[0, 0], actual[0, 1], slots, 2.0 ** -4, 2.0 ** -3)
    write_kv_cache_ref(key, value, expected[0, 0], expected[0, 1], slots, 2.0 ** -4, 2.0 ** -3)
    assert same_bytes(actual, expected)
    assert allocate_kv_cache(1, 2, 16, 8, 128, FP8_KV_DTYPE, "cuda").element_size() == 1
