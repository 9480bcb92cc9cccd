"""Process entry point shared by the NATS services: config, logging, tracing, signals."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import structlog

from shared.config import ServiceConfig, load_config
from shared.logging import setup_logging
from shared.tracing import setup_tracing

C = TypeVar("C", bound=ServiceConfig)
log = structlog.get_logger()
_IMPORTED_AT = time.monotonic()  # (the fallback start where /proc is absent)


def process_age_s() -> float:
    """Seconds since this process was started, its imports included (/proc/self/stat's
    start time, in clock ticks since boot, against /proc/uptime)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # (field 22)
            return max(0.0, float(uptime.read().split()[0])
                       - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED_AT


def log_startup(phase: str, **fields) -> None:
    """One step of a (re)start, timed from the process's start: where a restart spends
    its seconds before the service serves again (docs/fault-tolerance.md reads them)."""
    log.info("startup_phase", phase=phase, since_start_s=round(process_age_s(), 2), **fields)


def setup_process(name: str, config_cls: type[C], argv: Sequence[str] | None = None) -> C:
    """Build the config once; set up logging and tracing for this process."""
    config = load_config(config_cls, argv)
    setup_logging(name, level=config.log_level, json=config.log_json)
    setup_tracing(name, config.otel_exporter, config.otlp_traces_endpoint)
    structlog.contextvars.bind_contextvars(service=name, instance=config.instance_id)
    log_startup("imported")
    return config


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, the model, the tokenizer) out of the
    garbage collector's reach, so its full passes walk only what the service makes while
    serving: on the 2-core machine every process shares the worker's cores; on a GPU a
    pause in one tensor-parallel rank stalls every rank's next all-reduce. From here on a
    collection that pauses the process for over LONG_GC_PAUSE_S is logged."""
    gc.collect()
    gc.freeze()
    if _log_long_gc_pause not in gc.callbacks:
        gc.callbacks.append(_log_long_gc_pause)


LONG_GC_PAUSE_S = 0.02
_gc_started: list[float] = []


def _log_long_gc_pause(phase: str, info: dict) -> None:
    if phase == "start":
        _gc_started[:] = [time.perf_counter()]
    elif _gc_started:
        paused_s = time.perf_counter() - _gc_started.pop()
        if paused_s > LONG_GC_PAUSE_S:
            log.warning("long_gc_pause", ms=round(1e3 * paused_s, 1),
                        generation=info.get("generation"), collected=info.get("collected"))


def run_event_loop(main: Awaitable[None]) -> None:
    """Run ``main`` to completion on uvloop (libuv: cheaper socket I/O for the gateway's
    many streams and the scheduler's step loop), or asyncio's loop where uvloop is absent."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    uvloop.run(main)


def service_main(name: str, config_cls: type[C],
                 serve: Callable[[C, asyncio.Event], Awaitable[None]],
                 argv: Sequence[str] | None = None) -> None:
    """Run ``serve(config, stop)`` until SIGINT/SIGTERM sets ``stop``."""
    config = setup_process(name, config_cls, argv)
    run_event_loop(_run(config, serve))


async def _run(config: C, serve: Callable[[C, asyncio.Event], Awaitable[None]]) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await serve(config, stop)
