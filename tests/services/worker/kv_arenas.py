"""A host arena for a test runner's stores and loads (the kvstore's side, without it)."""

from __future__ import annotations

from pathlib import Path

from services.worker.kv_offload import KvOffload
from services.worker.kv_tiers import KvTiers
from services.worker.runner import ModelRunner
from shared.kv_arena import KvArena


def offload_to_new_arena(runner: ModelRunner, path: Path, num_slots: int = 16,
                         store_id: str = "store-1") -> KvOffload:
    """A new arena at ``path`` with slots the size of ``runner``'s blocks, attached to it,
    every slot free for its stores -> the runner's KvOffload."""
    slot_nbytes = runner.kv_cache[:, :, 0].numel() * runner.kv_cache.element_size()
    KvArena.create(path, num_slots, slot_nbytes, store_id).close()
    offload = KvOffload(KvTiers(runner.kv_cache, KvArena.attach(path)), store_id,
                        runner.block_size)
    runner.attach_kv(offload)
    offload.slot_pool.add(range(num_slots))
    return offload


def committed_blocks(commit) -> list[tuple[bytes, int, list[int]]]:
    """(hash, slot, token ids) per block of a Commit or a KvCommitRequest (columns)."""
    size, tokens = commit.block_size, commit.token_ids
    return [(block_hash, slot_id, list(tokens[index * size:(index + 1) * size]))
            for index, (block_hash, slot_id) in enumerate(zip(commit.block_hashes,
                                                              commit.slot_ids))]
