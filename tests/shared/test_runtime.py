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


def test_startup_phases_are_timed_from_the_process_start():
    """process_age_s counts from the exec (imports included), so it is already past the
    time this test module took to import, and it only grows."""
    import time

    first = runtime.process_age_s()
    time.sleep(0.05)
    second = runtime.process_age_s()
    assert 0.0 < first <= second < 24 * 3600
    assert second - first >= 0.04  # (its clock ticks are 10 ms)
    with capture_logs() as logs:
        runtime.log_startup("serving", replica_id="0")
    (entry,) = [e for e in logs if e["event"] == "startup_phase"]
    assert entry["phase"] == "serving" and entry["replica_id"] == "0"
    assert entry["since_start_s"] >= round(second, 2)
