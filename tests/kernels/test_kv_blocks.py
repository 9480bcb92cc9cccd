"""gather_blocks / scatter_blocks (Triton) against their references: whole blocks of every
layer between the layer-major cache and block-major staging rows, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_blocks import gather_blocks, gather_blocks_ref, scatter_blocks, scatter_blocks_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (num_layers, block_size, num_kv_heads, head_dim, dtype): int64 words; int16 words (a piece
# of 3 * 2 * 2 bytes is not a multiple of 8); a piece longer than one program's iteration
SHAPES = [(2, 4, 2, 8, torch.bfloat16), (3, 1, 3, 2, torch.float16),
          (1, 16, 8, 128, torch.float32)]


def cache_and_staging(shape, num_blocks: int, num_rows: int, seed: int = 0):
    num_layers, block_size, heads, head_dim, dtype = shape
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    kv_cache = torch.randn(num_layers, 2, num_blocks, block_size, heads, head_dim,
                           generator=gen, device=DEVICE).to(dtype)
    staging = torch.randn(num_rows, num_layers, 2, block_size, heads, head_dim,
                          generator=gen, device=DEVICE).to(dtype)
    return kv_cache, staging


@pytest.mark.parametrize("shape", SHAPES)
def test_gather_equals_the_reference(shape):
    kv_cache, staging = cache_and_staging(shape, num_blocks=9, num_rows=6)
    expected = staging.clone()
    block_ids = torch.tensor([7, 0, 3, 8, 2], device=DEVICE)  # 5 of 6 rows: the last is kept
    gather_blocks_ref(kv_cache, block_ids, expected)
    gather_blocks(kv_cache, block_ids, staging)
    assert torch.equal(staging, expected)
    assert torch.equal(staging[1], kv_cache[:, :, 0])


@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_equals_the_reference_and_leaves_other_blocks(shape):
    kv_cache, staging = cache_and_staging(shape, num_blocks=9, num_rows=4, seed=1)
    expected = kv_cache.clone()
    block_ids = torch.tensor([5, 1, 6], device=DEVICE)
    scatter_blocks_ref(expected, block_ids, staging)
    scatter_blocks(kv_cache, block_ids, staging)
    assert torch.equal(kv_cache, expected)
    assert torch.equal(kv_cache[:, :, 1], staging[1])


def test_a_round_trip_moves_blocks():
    kv_cache, staging = cache_and_staging(SHAPES[0], num_blocks=8, num_rows=3)
    gather_blocks(kv_cache, torch.tensor([2, 4, 6], device=DEVICE), staging)
    scatter_blocks(kv_cache, torch.tensor([1, 3, 5], device=DEVICE), staging)
    for src, dst in [(2, 1), (4, 3), (6, 5)]:
        assert torch.equal(kv_cache[:, :, dst], kv_cache[:, :, src])


def test_staging_of_another_layout_is_refused():
    kv_cache, staging = cache_and_staging(SHAPES[0], num_blocks=4, num_rows=2)
    with pytest.raises(ValueError, match="does not hold blocks"):
        gather_blocks(kv_cache, torch.tensor([0], device=DEVICE), staging[:, :1].contiguous())
    with pytest.raises(ValueError, match="staging rows"):
        gather_blocks(kv_cache, torch.tensor([0, 1, 2], device=DEVICE), staging)


@pytest.mark.gpu
@gpu
def test_llama_8b_blocks_on_the_gpu():
    kv_cache, staging = cache_and_staging((32, 16, 8, 128, torch.bfloat16), num_blocks=64,
                                          num_rows=16)
    block_ids = torch.randperm(64, device=DEVICE)[:16]
    expected = staging.clone()
    gather_blocks_ref(kv_cache, block_ids, expected)
    gather_blocks(kv_cache, block_ids, staging)
    assert torch.equal(staging, expected)
