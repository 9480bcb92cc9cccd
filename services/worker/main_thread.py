"""An executor that runs submitted calls on the process's main thread.

The worker's forward runs here while the NATS event loop lives in another thread:
on CPU, torch's OpenMP kernels ran ~1.8x slower at batch 1 when called from a
non-main thread (41 ms vs 75 ms per SmolLM2 decode step, measured on the 2-core
dev machine), and the event loop must stay free to answer pings during a step.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Executor, Future

IDLE_POLL_S = 0.0002  # how often on_idle runs while it says work is in flight


class MainThreadExecutor(Executor):
    def __init__(self) -> None:
        self._jobs: queue.Queue = queue.Queue()
        self._stopped = False
        # Run between jobs when none is queued; True: work is in flight, call again soon
        # (the worker reads back a GPU step once it is done, unless the next plan came first).
        self.on_idle: Callable[[], bool] | None = None

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._stopped:
            raise RuntimeError("the main-thread executor has stopped")
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        self._stopped = True
        self._jobs.put(None)

    def run_forever(self) -> None:
        """Run jobs on the calling (main) thread until shutdown()."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                busy = self.on_idle is not None and self.on_idle()
                try:  # wakes up for signal handlers
                    job = self._jobs.get(timeout=IDLE_POLL_S if busy else 0.5)
                except queue.Empty:
                    continue
            if job is None:
                break
            future, fn, args, kwargs = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as exc:  # noqa: BLE001 - handed to the awaiting coroutine
                future.set_exception(exc)
        while not self._jobs.empty():  # fail what was queued behind the stop
            job = self._jobs.get_nowait()
            if job is not None:
                job[0].cancel()
