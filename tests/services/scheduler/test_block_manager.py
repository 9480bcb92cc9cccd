"""The block manager's eviction order (a segmented LRU): blocks a prefix hit took are
protected, blocks never hit since they were cached are evicted first; the protected
segment is bounded and ages out into probation."""

from __future__ import annotations

from services.scheduler.block_manager import BlockManager

from .test_scheduler import FakeWorker, make_scheduler, request, run_to_completion


def h(index: int) -> bytes:
    return index.to_bytes(32, "big")


def cache_all(manager: BlockManager, hashes: list[int]) -> list[int]:
    """Allocate a block per hash and cache it (in use: ref_count 1)."""
    block_ids = manager.allocate(len(hashes))
    for block_id, index in zip(block_ids, hashes):
        manager.cache_block(block_id, h(index), [index] * manager.block_size)
    return block_ids


def evicted_hashes(manager: BlockManager, num_blocks: int) -> list[int]:
    """Allocate ``num_blocks`` and say which cached hashes that evicted, in order."""
    manager.keep_journal()
    manager.take_journal()
    manager.allocate(num_blocks)
    return [int.from_bytes(block_hash, "big") for block_hash in manager.take_journal()[1]]


def test_a_block_hit_by_a_later_request_outlives_blocks_freed_after_it():
    manager = BlockManager(num_blocks=6, block_size=4)
    shared = cache_all(manager, [1, 2])
    manager.free(shared)
    manager.reuse(shared)  # a second request's prefix hit
    manager.free(shared)
    manager.free(cache_all(manager, [3, 4, 5, 6]))  # one-offs, freed later
    # plain LRU would take 1 and 2 first (least recently freed); they were shared
    assert evicted_hashes(manager, 5) == [6, 5, 4, 3, 2]  # each sequence's tail first
    assert manager.cached_hashes() == [h(1)]


def test_within_a_segment_the_least_recently_freed_goes_first():
    manager = BlockManager(num_blocks=4, block_size=4)
    first, second = cache_all(manager, [1, 2]), cache_all(manager, [3, 4])
    manager.free(first)
    manager.free(second)
    assert evicted_hashes(manager, 3) == [2, 1, 4]
    manager = BlockManager(num_blocks=4, block_size=4, protected_share=1.0)
    first, second = cache_all(manager, [1, 2]), cache_all(manager, [3, 4])
    manager.free(first)
    manager.free(second)
    manager.reuse(first + second)
    manager.free(second)
    manager.free(first)  # now the more recently freed
    assert evicted_hashes(manager, 3) == [4, 3, 2]


def test_a_reused_block_leaves_the_evictable_pool_until_freed_again():
    manager = BlockManager(num_blocks=4, block_size=4)
    blocks = cache_all(manager, [1, 2, 3])
    manager.free(blocks)
    manager.reuse(blocks[:1])
    manager.reuse(blocks[1:2])
    manager.free(blocks[1:2])  # protected now; blocks[2] still in probation
    assert manager.num_free_blocks == 3 and manager.num_protected_blocks == 1
    assert manager.num_evictable(blocks) == 2
    assert manager.can_allocate(3) and not manager.can_allocate(3, num_reused_evictable=1)
    assert evicted_hashes(manager, 3) == [3, 2]  # the free block first, then probation
    assert manager.blocks[blocks[0]].ref_count == 1 and manager.cached_hashes() == [h(1)]


def test_blocks_loaded_from_the_kvstore_are_protected():
    manager = BlockManager(num_blocks=3, block_size=4)
    [loaded] = manager.allocate(1)
    manager.cache_block(loaded, h(1), [1] * 4, from_kvstore=True)  # a tier hit's block
    computed = cache_all(manager, [2])
    manager.free(computed)
    manager.free([loaded])
    assert evicted_hashes(manager, 2) == [2]


def test_protected_is_bounded_and_its_oldest_ages_into_probation():
    manager = BlockManager(num_blocks=10, block_size=4, protected_share=0.3)  # 3 blocks
    old, new = cache_all(manager, [1, 2]), cache_all(manager, [3, 4])
    manager.free(old + new)
    manager.reuse(old + new)
    manager.free(old)
    manager.free(new)  # 4 protected > 3: the least recently freed (h(2)) ages out
    assert manager.num_protected_blocks == 3
    assert not manager.blocks[old[1]].reused  # it needs another hit to come back
    one_off = cache_all(manager, [5])
    manager.free(one_off)
    # probation: h(2) (aged out), then h(5); free blocks go first
    assert evicted_hashes(manager, 10 - 5 + 2) == [2, 5]


def test_an_evicted_block_starts_unprotected_in_its_next_life():
    manager = BlockManager(num_blocks=2, block_size=4, protected_share=1.0)
    [block] = cache_all(manager, [1])
    manager.free([block])
    manager.reuse([block])
    manager.free([block])
    assert manager.num_protected_blocks == 1
    assert evicted_hashes(manager, 2) == [1]
    manager.cache_block(block, h(2), [2] * 4)
    assert not manager.blocks[block].reused
    manager.free([block])
    assert manager.num_protected_blocks == 0 and manager.num_free_blocks == 1


def test_a_tenants_shared_prompt_survives_one_off_prompts_through_the_scheduler():
    """A tenant's system prompt, hit by a second conversation, stays cached while
    one-off prompts freed after it take the rest of the cache; the tenant's third
    conversation still finds it (plain LRU evicted it: it was freed first). The fake
    worker checks every step's KV."""
    scheduler, worker = make_scheduler(num_blocks=24, max_num_batched_tokens=256), FakeWorker(24)
    system = list(range(500, 532))  # 8 full blocks

    def conversation(name: str) -> list[int]:
        return system + [600 + len(name), 601, 602]

    for name in ("c1", "c22"):
        scheduler.add_request(request(name, 0, 2, prompt=conversation(name), ignore_eos=True))
        run_to_completion(scheduler, worker)
    for index in range(3):  # one-off prompts: 15 blocks each, freed after the prompt
        scheduler.add_request(request(f"one-off-{index}", 58, 2, ignore_eos=True))
        run_to_completion(scheduler, worker)
    scheduler.add_request(request("c333", 0, 2, prompt=conversation("c333"), ignore_eos=True))
    _, _, plans = run_to_completion(scheduler, worker)
    assert plans[0].new_requests[0].num_computed_tokens == len(system)
    assert scheduler.block_manager.num_used_blocks == 0
