"""The disk tier: block files (format, checksum), the index rebuilt from them, LRU within
its size, and the background writer."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from services.kvstore.block_file import CorruptBlock, read_block_into, read_header, write_block
from services.kvstore.disk_tier import DiskTier
from services.kvstore.disk_writer import DiskWriter, WriteJob

NS = "a1b2c3d4e5f6a1b2c3d4e5f6"
SLOT = 4096


def h(i: int) -> bytes:
    return i.to_bytes(32, "big")


def payload(i: int) -> memoryview:
    return memoryview(np.random.default_rng(i).integers(0, 256, SLOT, dtype=np.uint8))



def _size(tokens: int) -> int:
    return 26 + len(NS) + 32 + 4 * tokens + SLOT + 4  # fixed header, names, tokens, payload, CRC


def test_block_file_round_trip_and_header(tmp_path):
    path = tmp_path / "block"
    size = write_block(path, NS, h(1), [1, 2, 3, 4], payload(1))
    assert size == os.path.getsize(path) == _size(4)
    header, on_disk = read_header(path)
    assert (header.namespace, header.block_hash, header.num_tokens, header.payload_nbytes) == (
        NS, h(1), 4, SLOT)
    out = np.zeros(SLOT, np.uint8)
    assert read_block_into(path, NS, h(1), memoryview(out)) == [1, 2, 3, 4]
    assert bytes(out) == bytes(payload(1))
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("offset", [0, 40, 100, 100 + SLOT // 2, -1])
def test_a_flipped_byte_anywhere_is_detected(tmp_path, offset):
    path = tmp_path / "block"
    write_block(path, NS, h(1), [1, 2, 3, 4], payload(1))
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptBlock):
        read_block_into(path, NS, h(1), memoryview(np.zeros(SLOT, np.uint8)))


def test_wrong_block_wrong_size_and_truncation_are_corrupt(tmp_path):
    path = tmp_path / "block"
    write_block(path, NS, h(1), [1], payload(1))
    with pytest.raises(CorruptBlock, match="another block"):
        read_block_into(path, NS, h(2), memoryview(np.zeros(SLOT, np.uint8)))
    with pytest.raises(CorruptBlock, match="payload"):
        read_block_into(path, NS, h(1), memoryview(np.zeros(SLOT * 2, np.uint8)))
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CorruptBlock):
        read_header(path)
    with pytest.raises(CorruptBlock):
        read_block_into(path, NS, h(1), memoryview(np.zeros(SLOT, np.uint8)))


def test_write_read_and_corrupt_block_dropped(tmp_path):
    corrupt = []
    disk = DiskTier(tmp_path, 1 << 20, on_corrupt=lambda ns, bh, why: corrupt.append(bh))
    assert disk.write(NS, h(1), [1, 2], payload(1)) == _size(2)
    assert disk.write(NS, h(1), [1, 2], payload(1)) == 0  # already there
    assert disk.contains(NS, h(1)) and disk.num_bytes == _size(2)
    assert disk.path_of(NS, h(1)) == tmp_path / NS / h(1).hex()[:2] / h(1).hex()
    out = np.zeros(SLOT, np.uint8)
    assert disk.read_into(NS, h(1), memoryview(out)) == [1, 2]
    assert bytes(out) == bytes(payload(1))
    assert disk.read_into(NS, h(2), memoryview(out)) is None  # a miss
    path = disk.path_of(NS, h(1))
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF
    path.write_bytes(bytes(data))
    assert disk.read_into(NS, h(1), memoryview(out)) is None
    assert corrupt == [h(1)] and not path.exists() and not disk.contains(NS, h(1))
    assert disk.num_bytes == 0
    assert disk.take_changes() == [(NS, True, h(1)), (NS, False, h(1))]


def test_lru_eviction_stays_within_the_size(tmp_path):
    disk = DiskTier(tmp_path, 3 * _size(1))
    for i in range(3):
        disk.write(NS, h(i), [i], payload(i))
    out = memoryview(np.zeros(SLOT, np.uint8))
    assert disk.read_into(NS, h(0), out) == [0]  # block 0 is now the most recent
    disk.write(NS, h(3), [3], payload(3))
    assert [disk.contains(NS, h(i)) for i in range(4)] == [True, False, True, True]
    assert not disk.path_of(NS, h(1)).exists()
    assert disk.num_bytes == 3 * _size(1) <= disk.capacity_bytes
    assert disk.write(NS, h(9), list(range(10_000)), payload(9)) == 0  # can never fit


def test_index_rebuilt_from_the_files(tmp_path):
    first = DiskTier(tmp_path, 1 << 20)
    for i in range(3):
        first.write(NS, h(i), [i, i], payload(i))
        os.utime(first.path_of(NS, h(i)), (1000 + i, 1000 + i))
    os.utime(first.path_of(NS, h(0)), (2000, 2000))  # read last: the most recent
    (tmp_path / NS / "ab").mkdir()
    (tmp_path / NS / "ab" / "abcd.123.tmp").write_bytes(b"half")  # a write cut short
    bad = first.path_of(NS, h(2))
    bad.write_bytes(bad.read_bytes()[:-1])  # truncated: wrong size
    misplaced = tmp_path / "other-namespace" / "00"
    misplaced.mkdir(parents=True)
    (misplaced / h(1).hex()).write_bytes(first.path_of(NS, h(1)).read_bytes())

    corrupt = []
    second = DiskTier(tmp_path, 2 * _size(2), on_corrupt=lambda *args: corrupt.append(args))
    assert second.scan() == (2, 2)
    assert len(corrupt) == 2 and not bad.exists()
    assert not list(tmp_path.rglob("*.tmp"))
    assert second.contains(NS, h(0)) and second.contains(NS, h(1))
    second.write(NS, h(5), [5, 5], payload(5))  # evicts the oldest by mtime: block 1
    assert not second.contains(NS, h(1)) and second.contains(NS, h(0))
    out = np.zeros(SLOT, np.uint8)
    assert second.read_into(NS, h(0), memoryview(out)) == [0, 0]
    assert bytes(out) == bytes(payload(0))


def test_writer_writes_in_the_background_and_drops_when_full(tmp_path):
    disk = DiskTier(tmp_path, 1 << 20)
    gate = threading.Event()
    done = []
    real_write = disk.write

    def slow_write(*args):
        gate.wait(5)
        return real_write(*args)

    disk.write = slow_write
    writer = DiskWriter(disk, max_queued=2)
    jobs = [WriteJob(NS, h(i), [i], payload(i), lambda n, s, i=i: done.append((i, n)))
            for i in range(4)]
    assert writer.submit(jobs[0])
    deadline = time.monotonic() + 5
    while writer.num_queued and time.monotonic() < deadline:  # the thread took job 0
        time.sleep(0.01)
    assert writer.submit(jobs[1]) and writer.submit(jobs[2])
    assert not writer.submit(jobs[3])  # the queue is full: dropped
    gate.set()
    assert writer.close(5)
    assert sorted(done) == [(i, _size(1)) for i in range(3)]
    assert [disk.contains(NS, h(i)) for i in range(4)] == [True, True, True, False]
