"""The disk tier: one file per block under ``<root>/<namespace>/<first two hex>/<hex hash>``
(block_file.py), an in-memory index of them in LRU order, kept within a size.

The index is rebuilt from the files at start (headers only; sizes from the file, LRU order
from mtime, which a read refreshes), so a restarted kvstore keeps its blocks. Files are
written by one background thread (disk_writer.py) and read by pins in worker threads,
while the event loop looks blocks up: the index is guarded by a lock; no file I/O happens
under it.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

import structlog

from services.kvstore.block_file import (
    TMP_SUFFIX, CorruptBlock, encode_header, read_block_into, read_header, write_block,
)

log = structlog.get_logger()

Key = tuple[str, bytes]  # (namespace, block hash)
TRAILER_NBYTES = 4


class DiskTier:
    def __init__(self, root: str | Path, capacity_bytes: int,
                 on_corrupt: Callable[[str, bytes, str], None] | None = None) -> None:
        self.root = Path(root)
        self.capacity_bytes = capacity_bytes
        self._on_corrupt = on_corrupt or (lambda namespace, block_hash, why: None)
        self._lock = threading.Lock()
        self._entries: OrderedDict[Key, int] = OrderedDict()  # -> file size; oldest first
        self._num_bytes = 0
        self._changes: list[tuple[str, bool, bytes]] = []  # (namespace, stored?, hash)

    def path_of(self, namespace: str, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.root / namespace / name[:2] / name

    # ------------------------------------------------------------ index
    @property
    def num_blocks(self) -> int:
        return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._num_bytes

    def contains(self, namespace: str, block_hash: bytes) -> bool:
        return (namespace, block_hash) in self._entries  # one dict lookup: atomic in CPython

    def count_namespace(self, namespace: str) -> int:
        with self._lock:
            return sum(1 for ns, _ in self._entries if ns == namespace)

    def take_changes(self) -> list[tuple[str, bool, bytes]]:
        """(namespace, stored (True) or removed, hash) since the last call, for events."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def take_changes_and_index(self
                               ) -> tuple[list[tuple[str, bool, bytes]], dict[str, list[bytes]]]:
        """``take_changes`` and, taken under the same lock, every block indexed by
        namespace: the index is exactly what those changes (and all before) leave."""
        index: dict[str, list[bytes]] = {}
        with self._lock:
            changes, self._changes = self._changes, []
            for namespace, block_hash in self._entries:
                index.setdefault(namespace, []).append(block_hash)
        return changes, index

    def _add(self, key: Key, size: int) -> None:
        """Under the lock."""
        self._entries[key] = size
        self._num_bytes += size
        self._changes.append((key[0], True, key[1]))

    def _forget(self, key: Key) -> bool:
        """Under the lock."""
        size = self._entries.pop(key, None)
        if size is None:
            return False
        self._num_bytes -= size
        self._changes.append((key[0], False, key[1]))
        return True

    def _make_room(self, size: int) -> list[Key]:
        """Under the lock: forget the least recently used blocks until ``size`` more bytes
        fit; returns them (their files are deleted outside the lock)."""
        victims = []
        while self._entries and self._num_bytes + size > self.capacity_bytes:
            key = next(iter(self._entries))
            self._forget(key)
            victims.append(key)
        return victims

    def _delete_files(self, keys: list[Key]) -> None:
        for namespace, block_hash in keys:
            self.path_of(namespace, block_hash).unlink(missing_ok=True)

    # ------------------------------------------------------------ start
    def scan(self) -> tuple[int, int]:
        """Rebuild the index from the files (headers only). Half-written files are
        deleted, and so are files whose header or size is wrong (counted as corrupt).
        Returns (blocks found, corrupt files deleted)."""
        found: list[tuple[float, Key, int]] = []
        num_corrupt = 0
        self.root.mkdir(parents=True, exist_ok=True)
        for path in self.root.glob("*/*/*"):
            if path.name.endswith(TMP_SUFFIX):
                path.unlink(missing_ok=True)  # a write that never finished
                continue
            try:
                header, size = read_header(path)
                if header.block_hash.hex() != path.name or header.namespace != path.parent.parent.name:
                    raise CorruptBlock("the file is not where its header says it belongs")
                found.append((os.stat(path).st_mtime, (header.namespace, header.block_hash), size))
            except CorruptBlock as exc:
                num_corrupt += 1
                log.warning("kv_disk_block_corrupt", path=str(path), reason=str(exc))
                self._on_corrupt(path.parent.parent.name, b"", str(exc))
                path.unlink(missing_ok=True)
            except OSError as exc:
                log.warning("kv_disk_block_unreadable", path=str(path), error=repr(exc))
        found.sort(key=lambda item: item[0])
        with self._lock:
            for _, key, size in found:
                if key not in self._entries:
                    self._add(key, size)
            victims = self._make_room(0)
        self._delete_files(victims)
        return len(self._entries), num_corrupt

    # ------------------------------------------------------------ write (writer thread)
    def write(self, namespace: str, block_hash: bytes, token_ids: list[int],
              payload: memoryview) -> int:
        """Store a block (evicting the least recently used to make room). Returns the bytes
        written: 0 when it was already there or can never fit."""
        key = (namespace, block_hash)
        size = (len(encode_header(namespace, block_hash, token_ids, payload.nbytes))
                + payload.nbytes + TRAILER_NBYTES)
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return 0
            if size > self.capacity_bytes:
                return 0
            victims = self._make_room(size)
        self._delete_files(victims)
        path = self.path_of(namespace, block_hash)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_block(path, namespace, block_hash, token_ids, payload)
        with self._lock:
            if key not in self._entries:
                self._add(key, size)
            more = self._make_room(0)  # a read's touch cannot grow it; a race might
        self._delete_files(more)
        return size

    # ------------------------------------------------------------ read (pins, in a thread)
    def read_into(self, namespace: str, block_hash: bytes, out: memoryview) -> list[int] | None:
        """Read a block into ``out`` and verify it; its token ids, or None on a miss. A
        block that fails verification is deleted and reported to ``on_corrupt``."""
        key = (namespace, block_hash)
        if key not in self._entries:
            return None
        path = self.path_of(namespace, block_hash)
        try:
            token_ids = read_block_into(path, namespace, block_hash, out)
        except CorruptBlock as exc:
            log.warning("kv_disk_block_corrupt", path=str(path), reason=str(exc))
            with self._lock:
                self._forget(key)
            path.unlink(missing_ok=True)
            self._on_corrupt(namespace, block_hash, str(exc))
            return None
        except OSError as exc:  # evicted meanwhile, or the disk failed
            log.info("kv_disk_block_unreadable", path=str(path), error=repr(exc))
            with self._lock:
                self._forget(key)
            return None
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
        try:
            os.utime(path)  # the LRU order survives a restart
        except OSError:
            pass
        return token_ids
