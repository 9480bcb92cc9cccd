"""The load generator's own pauses during a run: a client that stops reading its sockets
makes every stream's chunks look late, whichever server it measures.

``ClientPauses`` watches the event loop (a task that sleeps a few ms and notes how late it
wakes) and Python's garbage collector (each collection's length) for the run it wraps, so a
report can tell a server's stall from the client's; it holds the cyclic collector off for
the run, since one full collection paused every stream for 0.3 s.
"""

from __future__ import annotations

import asyncio
import gc
import time

TICK_S = 0.005  # the watcher's sleep: a lag shorter than this is not seen


class ClientPauses:
    def __init__(self) -> None:
        self.started = 0.0
        self.max_lag_s = 0.0
        self.max_lag_at_s = 0.0  # seconds after the run began, when that lag ended
        self.num_collections = 0
        self.max_collection_s = 0.0
        self.collections_s = 0.0
        self._collection_began = 0.0
        self._collector_was_on = True
        self._watcher: asyncio.Task | None = None

    async def __aenter__(self) -> ClientPauses:
        # no cyclic collection during the run (reference counting still frees nearly all):
        # one full collection over the dataset and the run's records stalled every stream
        # for 313 ms (H200, ShareGPT Poisson at 20 req/s, session 24)
        gc.collect()
        self._collector_was_on = gc.isenabled()
        gc.disable()
        self.started = time.perf_counter()
        gc.callbacks.append(self._on_collection)
        self._watcher = asyncio.create_task(self._watch())
        return self

    async def __aexit__(self, *exc_info) -> None:
        gc.callbacks.remove(self._on_collection)
        self._watcher.cancel()
        await asyncio.gather(self._watcher, return_exceptions=True)
        if self._collector_was_on:
            gc.enable()

    async def _watch(self) -> None:
        while True:
            before = time.perf_counter()
            await asyncio.sleep(TICK_S)
            woke = time.perf_counter()
            lag_s = woke - before - TICK_S
            if lag_s > self.max_lag_s:
                self.max_lag_s, self.max_lag_at_s = lag_s, woke - self.started

    def _on_collection(self, phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._collection_began = now
            return
        length_s = now - self._collection_began
        self.num_collections += 1
        self.collections_s += length_s
        self.max_collection_s = max(self.max_collection_s, length_s)

    def figures(self) -> dict:
        return {"client_max_loop_lag_ms": round(1e3 * self.max_lag_s, 1),
                "client_max_loop_lag_at_s": round(self.max_lag_at_s, 3),
                "client_gc_collections": self.num_collections,
                "client_gc_max_ms": round(1e3 * self.max_collection_s, 1),
                "client_gc_total_ms": round(1e3 * self.collections_s, 1)}
