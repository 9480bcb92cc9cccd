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
