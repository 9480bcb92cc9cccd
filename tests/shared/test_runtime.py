"""A service's start-up heap leaves the collector's reach, and long pauses get logged."""

import gc

from structlog.testing import capture_logs

from shared import runtime


def test_freeze_moves_the_heap_out_and_logs_long_collections(monkeypatch):
    callbacks_before = list(gc.callbacks)
    try:
        runtime.freeze_startup_objects()
        runtime.freeze_startup_objects()  # a second call adds no second logger
        assert gc.get_freeze_count() > 0
        assert gc.callbacks.count(runtime._log_long_gc_pause) == 1
        monkeypatch.setattr(runtime, "LONG_GC_PAUSE_S", 0.0)  # every collection is "long"
        with capture_logs() as logs:
            gc.collect()
        pauses = [entry for entry in logs if entry["event"] == "long_gc_pause"]
        assert pauses and pauses[-1]["generation"] == 2 and pauses[-1]["ms"] >= 0
        monkeypatch.setattr(runtime, "LONG_GC_PAUSE_S", 60.0)
        with capture_logs() as logs:
            gc.collect()
        assert not [entry for entry in logs if entry["event"] == "long_gc_pause"]
    finally:
        gc.callbacks[:] = callbacks_before
        gc.unfreeze()
