"""Copies between a KV cache and a real arena file on CPU (kv_tiers.py), and the reservation
and commit bookkeeping around them (kv_offload.py)."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention import allocate_kv_cache
from services.worker.kv_offload import BlockToStore, KvOffload
from services.worker.kv_tiers import KvTiers, paired_runs, runs
from shared.kv_arena import KvArena

NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 3, 12, 4, 2, 8


def make_cache(dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    cache = allocate_kv_cache(NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype,
                              torch.device("cpu"))
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def make_arena(tmp_path, dtype: torch.dtype, num_slots: int = 8) -> KvArena:
    slot_nbytes = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
    return KvArena.create(tmp_path / "arena", num_slots, slot_nbytes, "store-1")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_stored_then_loaded_into_other_blocks_are_bit_identical(tmp_path, dtype):
    cache = make_cache(dtype)
    original = cache.clone()
    tiers = KvTiers(cache, make_arena(tmp_path, dtype))
    stored_blocks, slot_ids = [3, 7, 1, 2], [5, 6, 0, 1]
    copy = tiers.store(stored_blocks, slot_ids)
    assert tiers.completed() == [copy]
    # a slot is the block contiguous, [num_layers, 2, block_size, num_kv_heads, head_dim],
    # in the arena file itself (another process reads it from there)
    again = KvArena.attach(tmp_path / "arena")
    raw = torch.from_numpy(again.slots()[5].copy()).view(dtype).view(tiers.slot_shape)
    assert torch.equal(raw.view(torch.uint8), original[:, :, 3].contiguous().view(torch.uint8))
    cache.zero_()
    loaded_blocks = [10, 4, 5, 11]
    timing = tiers.load(slot_ids, loaded_blocks)
    assert timing.num_bytes == 4 * tiers.slot_nbytes
    for stored, loaded in zip(stored_blocks, loaded_blocks):
        assert torch.equal(cache[:, :, loaded].view(torch.uint8),
                           original[:, :, stored].view(torch.uint8))
    untouched = [b for b in range(NUM_BLOCKS) if b not in loaded_blocks]
    assert not cache[:, :, untouched].any()
    tiers.close()


def test_runs_group_consecutive_ids():
    assert runs([4, 5, 6, 9, 10, 2]) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert runs([]) == []
    # both consecutive: one copy per run
    assert paired_runs([4, 5, 6, 9, 10], [1, 2, 3, 7, 9]) == [(4, 1, 3), (9, 7, 1), (10, 9, 1)]


def test_consecutive_slots_and_blocks_copy_in_one_call(tmp_path, monkeypatch):
    cache = make_cache(torch.float32)
    tiers = KvTiers(cache, make_arena(tmp_path, torch.float32))
    calls = []
    original_copy = torch.Tensor.copy_

    def counting_copy(self, src, *args, **kwargs):
        calls.append(tuple(src.shape))
        return original_copy(self, src, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
    tiers.store([2, 3, 4, 5], [0, 1, 2, 3])
    tiers.load([0, 1, 2, 3], [8, 9, 10, 11])
    monkeypatch.undo()
    assert [shape[0] for shape in calls] == [4, 4]
    assert torch.equal(cache[:, :, 8:12], cache[:, :, 2:6])


def test_copies_outside_the_cache_or_arena_are_refused(tmp_path):
    tiers = KvTiers(make_cache(torch.float32), make_arena(tmp_path, torch.float32, num_slots=4))
    with pytest.raises(ValueError, match="slots"):
        tiers.load([4], [0])
    with pytest.raises(ValueError, match="blocks"):
        tiers.store([NUM_BLOCKS], [0])
    with pytest.raises(ValueError):
        tiers.load([0, 1], [0])


def test_an_arena_of_another_layout_is_refused(tmp_path):
    with pytest.raises(ValueError, match="another layout"):
        KvTiers(make_cache(torch.float32), make_arena(tmp_path, torch.bfloat16))


def block(token_list, index, block_id, computed_before=True) -> BlockToStore:
    return BlockToStore(token_list, index, block_id, f"hash-{block_id}".encode(), computed_before)


def test_the_reservation_holds_a_whole_step_of_blocks(tmp_path):
    """A step may complete a whole token budget of prompt blocks at once: the pool aims at
    two steps' worth (within half the arena) and is topped up whenever one step's worth
    is not free, so a long prompt's blocks are not skipped (a fixed eighth of the arena
    stored 45 of a 1,000-token prompt's 62 blocks)."""
    arena = make_arena(tmp_path, torch.float32, num_slots=400)
    offload = KvOffload(KvTiers(make_cache(torch.float32), arena), "store-1", BLOCK_SIZE,
                        max_blocks_per_step=70)
    assert offload.target_free_slots == 140
    offload.slot_pool.add(range(140))
    assert offload.slots_wanted() == 0
    offload.slot_pool.take(71)  # fewer than a step's worth left (69): top up
    assert offload.slots_wanted() == 71
    small = KvOffload(KvTiers(make_cache(torch.float32), make_arena(tmp_path / "b", torch.float32,
                                                                    num_slots=100)),
                      "store-1", BLOCK_SIZE, max_blocks_per_step=70)
    assert small.target_free_slots == 50  # the kvstore gives no owner more than half


def test_stores_without_a_reserved_slot_are_skipped_and_counted(tmp_path):
    offload = KvOffload(KvTiers(make_cache(torch.float32), make_arena(tmp_path, torch.float32)),
                        "store-1", BLOCK_SIZE, target_free_slots=4)
    assert offload.slots_wanted() == 4
    offload.slot_pool.add([6, 2])
    assert offload.slots_wanted() == 0  # at half the target: enough
    tokens = list(range(100, 100 + 3 * BLOCK_SIZE))
    offload.store([block(tokens, 0, 5), block(tokens, 1, 6), block(tokens, 2, 7)])
    offload.end_submit()
    (commit,) = offload.take_commits()
    assert commit.store_id == "store-1" and commit.returned_slot_ids == []
    assert [(b.block_hash, b.slot_id, b.token_ids) for b in commit.blocks] == [
        (b"hash-5", 6, tokens[:BLOCK_SIZE]), (b"hash-6", 2, tokens[BLOCK_SIZE:2 * BLOCK_SIZE])]
    assert (offload.num_stored, offload.num_skipped) == (2, 1)
    assert offload.slot_pool.num_free == 0 and offload.slots_wanted() == 4
    offload.store([block(tokens, 0, 5)])  # nothing reserved: nothing copied, nothing committed
    offload.end_submit()
    assert offload.take_commits() == [] and offload.num_skipped == 2


def test_a_block_whose_tokens_are_not_on_the_host_gives_its_slot_back(tmp_path):
    offload = KvOffload(KvTiers(make_cache(torch.float32), make_arena(tmp_path, torch.float32)),
                        "store-1", BLOCK_SIZE)
    offload.slot_pool.add([0, 1])
    tokens = list(range(BLOCK_SIZE + 1))  # the second block is one token short
    offload.store([block(tokens, 0, 3), block(tokens, 1, 4)])
    offload.end_submit()
    (commit,) = offload.take_commits()
    assert [b.slot_id for b in commit.blocks] == [0] and commit.returned_slot_ids == [1]
