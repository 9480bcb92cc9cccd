"""Drain on SIGTERM, for real: a nats-server, a worker and a scheduler as processes (no
gateway: the test submits token ids and reads the outputs on the bus itself)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cli.stack import free_port, nats_server_binary
from shared.bus import Bus
from shared.errors import ServiceUnavailable
from shared.messages import GenerateRequest, OutputBatch, SamplingParams, SubmitReply
from shared.scheduler_stats import SchedulerStats
from shared.subjects import Subjects

pytestmark = pytest.mark.integration

SUBJECTS = Subjects()


def start(tmp_path: Path, name: str, *args: str) -> subprocess.Popen:
    log = open(tmp_path / f"{name}.log", "w")
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen([sys.executable, "-m", *args], stdout=log, stderr=subprocess.STDOUT,
                            env=env)


def start_nats(tmp_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                               stdout=open(tmp_path / "nats.log", "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 10
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return process, f"nats://127.0.0.1:{port}"
        except OSError:
            assert time.monotonic() < deadline and process.poll() is None, "no nats-server"
            time.sleep(0.05)


def stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


class Outputs:
    def __init__(self) -> None:
        self.by_request: dict[str, list] = {}
        self.stats: dict[str, SchedulerStats] = {}

    async def on_outputs(self, batch: OutputBatch) -> None:
        for output in batch.outputs:
            self.by_request.setdefault(output.request_id, []).append(output)

    async def on_stats(self, stats: SchedulerStats) -> None:
        self.stats[stats.scheduler_id] = stats

    def finished(self, request_id: str):
        outputs = self.by_request.get(request_id, [])
        return outputs[-1] if outputs and outputs[-1].finish_reason else None


async def until(condition, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := condition():
            return value
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


async def wait_exit(process: subprocess.Popen, timeout_s: float) -> int:
    await until(lambda: process.poll() is not None, timeout_s, f"{process.args[2]} to exit")
    return process.returncode


def generate(request_id: str, max_tokens: int) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=list(range(100, 116)),
                           sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                   ignore_eos=True),
                           output_subject="test.outputs")


async def test_sigterm_drains_the_scheduler_then_the_worker(tmp_path):
    nats, nats_url = start_nats(tmp_path)
    common = ["--nats-url", nats_url, "--log-level", "info"]
    worker = start(tmp_path, "worker", "services.worker", *common, "--kv-cache-memory", "256MiB")
    first = start(tmp_path, "scheduler-1", "services.scheduler", *common, "--instance-id", "s1",
                  "--shutdown-timeout", "1")
    second = None
    bus = await Bus.connect(nats_url, name="test")
    seen = Outputs()
    await bus.subscribe("test.outputs", OutputBatch, seen.on_outputs)
    await bus.subscribe(SUBJECTS.scheduler_stats, SchedulerStats, seen.on_stats)
    try:
        await until(lambda: (s := seen.stats.get("s1")) and s.worker_ready, 180, "the worker")

        # 1. Only the scheduler stops, with 1 s to drain: a long request is failed (503).
        await bus.request(SUBJECTS.scheduler_submit, generate("long", 2000), SubmitReply)
        await until(lambda: "long" in seen.by_request, 30, "the first output")
        first.send_signal(signal.SIGTERM)
        await until(lambda: not seen.stats["s1"].worker_ready, 30, "stats saying it drains")
        with pytest.raises(ServiceUnavailable):  # no scheduler takes new requests
            await bus.request(SUBJECTS.scheduler_submit, generate("late", 4), SubmitReply)
        last = await until(lambda: seen.finished("long"), 10, "the long request to end")
        assert last.error is not None and (last.error.status, last.error.code) == (503, "shutdown")
        assert await wait_exit(first, 10) == 0

        # 2. Scheduler and worker stop together: what runs finishes, then both exit.
        second = start(tmp_path, "scheduler-2", "services.scheduler", *common,
                       "--instance-id", "s2")
        await until(lambda: (s := seen.stats.get("s2")) and s.worker_ready, 60, "a new scheduler")
        for request_id in ("a", "b"):
            await bus.request(SUBJECTS.scheduler_submit, generate(request_id, 24), SubmitReply)
        await until(lambda: "a" in seen.by_request and "b" in seen.by_request, 30, "outputs")
        second.send_signal(signal.SIGTERM)
        worker.send_signal(signal.SIGTERM)
        for request_id in ("a", "b"):
            last = await until(lambda: seen.finished(request_id), 30, f"{request_id} to end")
            assert last.finish_reason == "length" and last.error is None
            tokens = [t for o in seen.by_request[request_id] for t in o.new_token_ids]
            assert len(tokens) == 24
        assert await wait_exit(second, 10) == 0
        assert await wait_exit(worker, 10) == 0  # after a second with no step
    finally:
        await bus.close()
        for process in (first, second, worker, nats):
            if process is not None:
                stop(process)
