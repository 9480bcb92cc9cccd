"""gather_blocks / scatter_blocks (Triton) against their references: whole blocks of every
layer (or of a layer range) between the layer-major cache and block-major staging rows, bit
for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_blocks import gather_blocks, gather_blocks_ref, scatter_blocks, scatter_blocks_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# (num_layers, block_size, num_kv_heads, head_dim, dtype): int64 words; int16 words (a piece
# of 3 * 2 * 2 bytes is not a multiple of 8); a piece longer than one program's iteration
SHAPES = [(2, 4, 2, 8, torch.bfloat16), (3, 1, 3, 2, torch.float16),
          (1, 16, 8, 128, torch.float32), (2, 16, 2, 64, torch.float8_e4m3fn)]  # (FP8 KV)


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


@pytest.mark.parametrize("layers", [(0, 2), (1, 3), (3, 4), (0, 4)])
@pytest.mark.parametrize("shape", [(4, *SHAPES[0][1:]), (4, *SHAPES[1][1:])])
def test_scatter_of_a_layer_range_writes_those_layers_only(shape, layers):
    """Staging rows of layers [first, end) land in those layers of the blocks; every other
    layer and block keeps its values."""
    first, end = layers
    kv_cache, _ = cache_and_staging(shape, num_blocks=9, num_rows=1, seed=2)
    staging = torch.randn(4, end - first, *kv_cache.shape[1:2], *kv_cache.shape[3:],
                          generator=torch.Generator(device=DEVICE).manual_seed(3),
                          device=DEVICE).to(kv_cache.dtype)  # [4, end - first, 2, ...]
    original = kv_cache.clone()
    expected = kv_cache.clone()
    block_ids = torch.tensor([8, 2, 5], device=DEVICE)  # 3 of 4 rows: the last is not used
    scatter_blocks_ref(expected, block_ids, staging, layers=layers)
    scatter_blocks(kv_cache, block_ids, staging, layers=layers)
    assert torch.equal(kv_cache, expected)
    assert torch.equal(kv_cache[first:end, :, 2], staging[1])
    others = [layer for layer in range(4) if not first <= layer < end]
    assert torch.equal(kv_cache[others], original[others])
    untouched = [b for b in range(9) if b not in (8, 2, 5)]
    assert torch.equal(kv_cache[:, :, untouched], original[:, :, untouched])


def test_gather_of_a_layer_range_equals_the_reference():
    kv_cache, _ = cache_and_staging((5, *SHAPES[0][1:]), num_blocks=6, num_rows=1, seed=4)
    staging = torch.zeros(3, 2, *kv_cache.shape[1:2], *kv_cache.shape[3:], dtype=kv_cache.dtype,
                          device=DEVICE)  # [3, 2 layers, 2, ...]
    expected = staging.clone()
    block_ids = torch.tensor([4, 0, 3], device=DEVICE)
    gather_blocks_ref(kv_cache, block_ids, expected, layers=(2, 4))
    gather_blocks(kv_cache, block_ids, staging, layers=(2, 4))
    assert torch.equal(staging, expected)
    assert torch.equal(staging[0], kv_cache[2:4, :, 4])


def test_a_layer_range_outside_the_cache_is_refused():
    kv_cache, staging = cache_and_staging(SHAPES[0], num_blocks=4, num_rows=2)
    for layers in [(1, 1), (2, 3), (-1, 1)]:
        with pytest.raises(ValueError, match="outside the cache"):
            scatter_blocks(kv_cache, torch.tensor([0], device=DEVICE), staging, layers=layers)
    with pytest.raises(ValueError, match="does not hold blocks"):  # rows of 2 layers, range of 1
        scatter_blocks(kv_cache, torch.tensor([0], device=DEVICE), staging, layers=(0, 1))


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


@pytest.mark.gpu
@gpu
def test_compiled_copies_leave_nothing_to_compile_at_the_first_store_or_load():
    """compile_copies (a kvstore's attach) compiles every variant the copies launch: the
    first gather, whole scatter and layer-group scatters find them in Triton's cache."""
    from kernels.kv_blocks import _copy_pieces_kernel, compile_copies

    kv_cache, staging = cache_and_staging((6, 16, 2, 64, torch.bfloat16), num_blocks=32,
                                          num_rows=8, seed=5)
    kernel_cache = _copy_pieces_kernel.device_caches[torch.cuda.current_device()][0]
    groups = [(0, 3), (3, 6)]
    compile_copies(kv_cache, staging, groups)
    compiled = len(kernel_cache)
    block_ids = torch.tensor([3, 9, 30], device=DEVICE)
    gather_blocks(kv_cache, block_ids, staging)
    gather_blocks(kv_cache, block_ids[1:], staging)  # a chunk's ids, 8 bytes in
    scatter_blocks(kv_cache, block_ids, staging)
    rows = torch.zeros(4, 3, 2, 16, 2, 64, dtype=kv_cache.dtype, device=DEVICE)
    for layers in groups:
        scatter_blocks(kv_cache, block_ids, rows, layers=layers)
    assert len(kernel_cache) == compiled
