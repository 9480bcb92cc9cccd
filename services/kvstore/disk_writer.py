"""Write-through to the disk tier on one background thread, behind a bounded queue:
committing a block never waits for the disk; when the disk falls behind, new blocks are
not queued (the caller counts them as dropped)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog

from services.kvstore.disk_tier import DiskTier

log = structlog.get_logger()


@dataclass(frozen=True)
class WriteJob:
    namespace: str
    block_hash: bytes
    token_ids: list[int]
    payload: memoryview  # the arena slot, held (not evicted) until ``done`` runs
    # called on the writer thread: (bytes written (0: already there, or failed), seconds)
    done: Callable[[int, float], None]


class DiskWriter:
    def __init__(self, disk: DiskTier, max_queued: int) -> None:
        self.disk = disk
        self._queue: queue.Queue[WriteJob | None] = queue.Queue(maxsize=max_queued)
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    @property
    def num_queued(self) -> int:
        return self._queue.qsize()

    def submit(self, job: WriteJob) -> bool:
        """Queue a write; False when the queue is full (the block is not written)."""
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            return False
        return True

    def close(self, timeout_s: float) -> bool:
        """Finish the queued writes for up to ``timeout_s``; True if all were done."""
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            return False
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            started = time.perf_counter()
            written = 0
            try:
                written = self.disk.write(job.namespace, job.block_hash, job.token_ids,
                                          job.payload)
            except OSError as exc:  # a full or failing disk: the block is just not kept
                log.warning("kv_disk_write_failed", error=repr(exc))
            except Exception:  # noqa: BLE001 - the writer must outlive one bad block
                log.exception("kv_disk_write_failed")
            finally:
                try:
                    job.done(written, time.perf_counter() - started)
                except Exception:  # noqa: BLE001
                    log.exception("kv_disk_write_callback_failed")
