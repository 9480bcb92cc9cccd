"""Copies between a KV cache and a real arena file on CPU (kv_tiers.py), and the reservation
and commit bookkeeping around them (kv_offload.py)."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.paged_attention_ref import allocate_kv_cache
from services.worker import kv_offload
from services.worker.kv_offload import BlocksToStore, Commit, KvOffload, commit_messages
from services.worker.kv_tiers import KvTiers, chunked_runs, paired_runs
from shared.kv_arena import KvArena
from shared.messages import KvStoreRun
from tests.services.worker.kv_arenas import committed_blocks

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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
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
    assert chunked_runs([4, 5, 6, 9, 10, 2], 10) == [[(0, 4, 3), (3, 9, 2), (5, 2, 1)]]
    # both consecutive: one copy per run
    assert paired_runs([4, 5, 6, 9, 10], [1, 2, 3, 7, 9]) == [(4, 1, 3), (9, 7, 1), (10, 9, 1)]
    assert paired_runs([], []) == [] and paired_runs([3], [8]) == [(3, 8, 1)]
    assert chunked_runs([], 4) == []
    # per chunk of 3: a run is cut at each chunk's start
    assert chunked_runs([4, 5, 6, 7, 9, 10, 2], 3) == [[(0, 4, 3)], [(0, 7, 1), (1, 9, 2)],
                                                       [(0, 2, 1)]]


def naive_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    found: list[tuple[int, int, int]] = []
    for index, value in enumerate(ids):
        if found and found[-1][1] + found[-1][2] == value:
            found[-1] = (found[-1][0], found[-1][1], found[-1][2] + 1)
        else:
            found.append((index, value, 1))
    return found


@pytest.mark.parametrize("seed", range(20))
def test_runs_found_at_once_equal_a_walk_over_the_ids(seed):
    rng = random.Random(seed)
    num_ids, chunk = rng.randrange(1, 200), rng.randrange(1, 40)
    ids = [rng.choice((-1, 1, 1, 1, 5)) for _ in range(num_ids)]  # steps: mostly consecutive
    ids = [sum(ids[:i + 1]) + 100 for i in range(num_ids)]
    others = [value + rng.choice((0, 0, 0, 1)) * 1000 for value in ids]
    assert chunked_runs(ids, chunk) == [[(index, first, length) for index, first, length
                                         in naive_runs(ids[start:start + chunk])]
                                        for start in range(0, num_ids, chunk)]
    assert paired_runs(ids, others) == naive_paired_runs(ids, others)


def naive_paired_runs(slot_ids: list[int], block_ids: list[int]) -> list[tuple[int, int, int]]:
    found: list[tuple[int, int, int]] = []
    for slot_id, block_id in zip(slot_ids, block_ids):
        if found and found[-1][0] + found[-1][2] == slot_id \
                and found[-1][1] + found[-1][2] == block_id:
            found[-1] = (found[-1][0], found[-1][1], found[-1][2] + 1)
        else:
            found.append((slot_id, block_id, 1))
    return found


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


def block(token_list, index, block_id, computed_before=True) -> BlocksToStore:
    return BlocksToStore(token_list, index, [block_id], [f"hash-{block_id}".encode()],
                         computed_before)


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
    assert committed_blocks(commit) == [
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
    assert commit.slot_ids == [0] and commit.returned_slot_ids == [1]


def test_a_run_splits_into_blocks_full_before_the_step_and_those_it_completes(tmp_path):
    """resolve_stores checks each run against its request once and keeps it whole (at most
    two parts: full before the step, completed by it); refused runs are counted."""
    offload = KvOffload(KvTiers(make_cache(torch.float32), make_arena(tmp_path, torch.float32)),
                        "store-1", BLOCK_SIZE)
    tokens = list(range(200, 200 + 5 * BLOCK_SIZE))
    requests = {"a": (tokens, [9, 8, 7, 6, 5], 2 * BLOCK_SIZE + 1, 5 * BLOCK_SIZE)}
    runs = [KvStoreRun("a", 1, [8, 7, 6], [b"a1", b"a2", b"a3"]),  # 1 before, 2 this step
            KvStoreRun("a", 0, [9], [b"a0"]),  # before only
            KvStoreRun("a", 3, [6, 5], [b"a3", b"a4"]),  # this step only
            KvStoreRun("a", 2, [6], [b"x"]),  # not the request's block there
            KvStoreRun("gone", 0, [1, 2], [b"g0", b"g1"])]
    found = offload.resolve_stores(runs, requests.get)
    assert [(r.first_block_index, r.block_ids, r.block_hashes, r.computed_before)
            for r in found] == [(1, [8], [b"a1"], True), (2, [7, 6], [b"a2", b"a3"], False),
                                (0, [9], [b"a0"], True), (3, [6, 5], [b"a3", b"a4"], False)]
    assert all(r.token_list is tokens for r in found) and offload.num_skipped == 3


def test_runs_cut_by_the_reservation_and_by_tokens_not_on_the_host(tmp_path):
    """Slots go to the blocks in order, a run cut where they run out; a block whose tokens
    are not all on the host gives its slot back, and so do the blocks after it."""
    cache = make_cache(torch.float32)
    offload = KvOffload(KvTiers(cache, make_arena(tmp_path, torch.float32)), "store-1",
                        BLOCK_SIZE)
    offload.slot_pool.add([4, 5, 6, 1, 2])
    short = list(range(50, 50 + 2 * BLOCK_SIZE + 1))  # its third block is one token short
    full = list(range(10, 10 + 3 * BLOCK_SIZE))
    offload.store([BlocksToStore(short, 0, [0, 1, 2], [b"s0", b"s1", b"s2"], False),
                   BlocksToStore(full, 0, [3, 4, 5], [b"f0", b"f1", b"f2"], False)])
    offload.end_submit()
    (commit,) = offload.take_commits()
    assert (commit.block_size, commit.slot_ids, commit.returned_slot_ids) == (BLOCK_SIZE,
                                                                              [4, 5, 1, 2], [6])
    assert committed_blocks(commit) == [
        (b"s0", 4, short[:4]), (b"s1", 5, short[4:8]), (b"f0", 1, full[:4]), (b"f1", 2, full[4:8])]
    assert commit.token_ids == short[:8] + full[:8]
    assert (offload.num_stored, offload.num_skipped) == (4, 2)  # s2 (tokens), f2 (no slot)
    slots = offload.tiers.slots
    for slot_id, block_id in ((4, 0), (5, 1), (1, 3), (2, 4)):
        assert torch.equal(slots[slot_id], cache[:, :, block_id])


def test_commit_messages_split_by_tokens(monkeypatch):
    """The commit's blocks as columns, at most MAX_TOKENS_PER_COMMIT tokens per message,
    the returned slots with the last one."""
    monkeypatch.setattr(kv_offload, "MAX_TOKENS_PER_COMMIT", 2 * BLOCK_SIZE)
    tokens = list(range(5 * BLOCK_SIZE))
    commit = Commit("store-1", BLOCK_SIZE, [b"h0", b"h1", b"h2", b"h3", b"h4"], [7, 3, 9, 1, 0],
                    tokens, returned_slot_ids=[5])
    messages = commit_messages([commit], "ns", "w")
    assert len(messages) == 3
    assert [m.returned_slot_ids for m in messages] == [[], [], [5]]
    assert all((m.namespace, m.owner_id, m.store_id, m.block_size) == ("ns", "w", "store-1",
                                                                       BLOCK_SIZE)
               for m in messages)
    blocks = [block for m in messages for block in committed_blocks(m)]
    assert blocks == committed_blocks(commit)
    assert blocks[2] == (b"h2", 9, tokens[2 * BLOCK_SIZE:3 * BLOCK_SIZE])
    (only_returned,) = commit_messages([Commit("store-1", BLOCK_SIZE, [], [], [], [2])], "ns",
                                       "w")
    assert only_returned.slot_ids == [] and only_returned.returned_slot_ids == [2]
