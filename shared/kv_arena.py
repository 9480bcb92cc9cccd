"""The kvstore's host tier: a file of fixed-size slots that the kvstore creates and every
worker on the node maps (normally under /dev/shm, so it is shared memory).

One slot holds one KV block of one layout (``KvLayout.slot_shape``, contiguous). The
kvstore decides which slot holds what (over NATS); the bytes never travel on the bus.
The file starts with a one-page header, so the slots start page-aligned (a CUDA worker
registers them as pinned memory and copies by DMA).

    header (4096 bytes): magic "FLOTKVA1" | u32le version | u64le num_slots
                         | u64le slot_nbytes | 32-byte store id (ASCII, zero padded)
    slots:               num_slots x slot_nbytes bytes
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

import numpy as np

MAGIC = b"FLOTKVA1"
VERSION = 1
HEADER_NBYTES = 4096
_HEADER = struct.Struct("<8sIQQ32s")


class KvArena:
    def __init__(self, path: Path, mapping: mmap.mmap, num_slots: int, slot_nbytes: int,
                 store_id: str) -> None:
        self.path = path
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.store_id = store_id
        self._mapping = mapping

    @classmethod
    def create(cls, path: str | Path, num_slots: int, slot_nbytes: int, store_id: str) -> KvArena:
        """A new arena file (replacing any old one at ``path``); memory is taken as slots
        are first written (tmpfs and disk files are sparse)."""
        if num_slots < 1 or slot_nbytes < 1:
            raise ValueError(f"an arena needs slots: {num_slots} x {slot_nbytes} bytes")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        staging = path.with_name(path.name + ".tmp")
        with open(staging, "wb") as f:
            f.truncate(HEADER_NBYTES + num_slots * slot_nbytes)
            f.write(_HEADER.pack(MAGIC, VERSION, num_slots, slot_nbytes,
                                 store_id.encode("ascii")[:32]))
        os.replace(staging, path)  # a worker never maps a half-written header
        return cls.attach(path)

    @classmethod
    def attach(cls, path: str | Path) -> KvArena:
        path = Path(path)
        with open(path, "r+b") as f:
            magic, version, num_slots, slot_nbytes, raw_id = _HEADER.unpack(
                f.read(_HEADER.size))
            if magic != MAGIC or version != VERSION:
                raise ValueError(f"{path} is not a flotilla KV arena (version {VERSION})")
            expected = HEADER_NBYTES + num_slots * slot_nbytes
            if os.fstat(f.fileno()).st_size != expected:
                raise ValueError(f"{path}: {os.fstat(f.fileno()).st_size} bytes, header says "
                                 f"{expected}")
            mapping = mmap.mmap(f.fileno(), expected)
        return cls(path, mapping, num_slots, slot_nbytes, raw_id.rstrip(b"\0").decode("ascii"))

    def slots(self) -> np.ndarray:
        """[num_slots, slot_nbytes] uint8, a writable view of the mapped slots."""
        return np.frombuffer(self._mapping, dtype=np.uint8, count=self.num_slots * self.slot_nbytes,
                             offset=HEADER_NBYTES).reshape(self.num_slots, self.slot_nbytes)

    def close(self) -> None:
        """Unmap (views taken with ``slots()`` must be gone first)."""
        self._mapping.close()

    def unlink(self) -> None:
        self.path.unlink(missing_ok=True)
