"""The host-tier arena file: what one process writes, another maps and reads."""

import multiprocessing

import numpy as np
import pytest

from shared.kv_arena import HEADER_NBYTES, KvArena


def _write_slot(path: str, slot: int, value: int) -> None:
    arena = KvArena.attach(path)
    arena.slots()[slot, :] = value


def test_another_process_sees_what_one_writes(tmp_path):
    arena = KvArena.create(tmp_path / "arena", num_slots=3, slot_nbytes=4096, store_id="store-a")
    process = multiprocessing.get_context("spawn").Process(
        target=_write_slot, args=(str(arena.path), 1, 7))
    process.start()
    process.join(timeout=60)
    assert process.exitcode == 0
    slots = arena.slots()
    assert slots.shape == (3, 4096)
    assert (slots[1] == 7).all() and (slots[0] == 0).all() and (slots[2] == 0).all()
    attached = KvArena.attach(arena.path)
    assert (attached.store_id, attached.num_slots, attached.slot_nbytes) == ("store-a", 3, 4096)


def test_slots_start_page_aligned(tmp_path):
    arena = KvArena.create(tmp_path / "arena", num_slots=2, slot_nbytes=100, store_id="s")
    assert arena.slots().ctypes.data % 4096 == 0
    assert arena.path.stat().st_size == HEADER_NBYTES + 200


def test_a_file_that_is_not_an_arena_is_refused(tmp_path):
    path = tmp_path / "other"
    path.write_bytes(np.arange(5000, dtype=np.uint8).tobytes())
    with pytest.raises(ValueError, match="not a flotilla KV arena"):
        KvArena.attach(path)
