"""The load generator's own pauses: a blocked event loop and the collector's passes are
seen and timed, so a stall every stream saw at once can be told apart from the server's."""

from __future__ import annotations

import asyncio
import gc
import time

from cli.bench.pauses import ClientPauses


def test_a_blocked_loop_and_a_collection_are_reported():
    async def run() -> dict:
        async with ClientPauses() as pauses:
            await asyncio.sleep(0.03)
            time.sleep(0.08)  # the loop blocked (as a long collection would block it)
            await asyncio.sleep(0.03)
            gc.collect()
            await asyncio.sleep(0.01)
        return pauses.figures()

    num_callbacks = len(gc.callbacks)
    figures = asyncio.run(run())
    assert len(gc.callbacks) == num_callbacks  # its hook is gone after the run
    assert 70 <= figures["client_max_loop_lag_ms"] < 1000
    assert 0.1 <= figures["client_max_loop_lag_at_s"] < 1.0  # when the blocked stretch ended
    assert figures["client_gc_collections"] >= 1
    assert 0 <= figures["client_gc_max_ms"] <= figures["client_gc_total_ms"]
