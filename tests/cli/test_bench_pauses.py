"""The load generator's own pauses: a blocked event loop and the collector's passes are
seen and timed, so a stall every stream saw at once can be told apart from the server's."""

from __future__ import annotations

import asyncio
import gc
import time

from cli.bench.pauses import ClientPauses


def test_a_blocked_loop_and_a_collection_are_reported():
    async def run() -> tuple[dict, float]:
        start = time.monotonic()
        async with ClientPauses() as pauses:
            await asyncio.sleep(0.03)
            time.sleep(0.08)  # the loop blocked (as a long collection would block it)
            await asyncio.sleep(0.03)
            gc.collect()
            await asyncio.sleep(0.01)
        return pauses.figures(), time.monotonic() - start

    num_callbacks = len(gc.callbacks)
    figures, elapsed_s = asyncio.run(run())
    assert len(gc.callbacks) == num_callbacks  # its hook is gone after the run
    assert 70 <= figures["client_max_loop_lag_ms"] < 1000 * elapsed_s
    # when the blocked stretch ended: after it began, within the run (a busy machine stretches
    # the sleeps around it, so no tighter bound holds)
    assert 0.1 <= figures["client_max_loop_lag_at_s"] <= elapsed_s
    assert figures["client_gc_collections"] >= 1
    assert 0 <= figures["client_gc_max_ms"] <= figures["client_gc_total_ms"]
