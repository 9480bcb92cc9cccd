"""``python -m shared.healthcheck``, the container probe, against a real nats-server and
the real gateway, tokenizer and scheduler (the worker is a stand-in answering its
subjects: loading a model here would only slow the test down)."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cli.stack import Stack, StackOptions, free_port, nats_server_binary
from shared.bus import Bus
from shared.healthcheck import main, service_from_pid1
from shared.messages import Empty, HealthReply, WorkerInfo
from shared.subjects import Subjects
from tests.deploy.tools import ROOT

pytestmark = pytest.mark.integration

NAMESPACE = "probe-test"


@pytest.fixture(scope="module")
def nats_url():
    server = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", "-1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url, deadline = None, time.monotonic() + 15
    while time.monotonic() < deadline:
        line = server.stderr.readline()
        if match := re.search(r"Listening for client connections on ([\d.]+):(\d+)", line):
            url = f"nats://{match.group(1)}:{match.group(2)}"
        if "Server is ready" in line and url:
            break
    threading.Thread(target=server.stderr.read, daemon=True).start()  # keep the pipe drained
    assert url, "nats-server did not start"
    yield url
    server.terminate()
    server.wait(10)


def probe(service: str | None, *args: str, nats_url: str, namespace: str = NAMESPACE,
          **env: str) -> subprocess.CompletedProcess:
    """Run the probe as a container runs it: a new process configured by FLOTILLA_* variables."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_")}
    environ |= {"FLOTILLA_NATS_URL": nats_url, "FLOTILLA_NAMESPACE": namespace, **env}
    command = [sys.executable, "-m", "shared.healthcheck", *([service] if service else []), *args]
    return subprocess.run(command, env=environ, cwd=ROOT, capture_output=True, text=True, timeout=60)


def eventually_ok(*args, timeout_s: float = 60.0, **kwargs) -> subprocess.CompletedProcess:
    deadline = time.monotonic() + timeout_s
    while True:
        result = probe(*args, **kwargs)
        if result.returncode == 0 or time.monotonic() > deadline:
            return result
        time.sleep(0.5)


class StandInWorker:
    """Answers a worker's attach, ping and health subjects for one replica."""

    def __init__(self, nats_url: str, replica_id: str = "0") -> None:
        self.nats_url, self.replica_id = nats_url, replica_id
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._loop.run_until_complete, args=(self._run(),),
                                        daemon=True)
        self._ready = threading.Event()

    def __enter__(self) -> "StandInWorker":
        self._thread.start()
        assert self._ready.wait(15), "the stand-in worker did not connect"
        return self

    def __exit__(self, *_) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(15)

    async def _run(self) -> None:
        self._stop = asyncio.Event()
        subjects = Subjects(NAMESPACE)
        bus = await Bus.connect(self.nats_url, name="stand-in-worker")
        health = HealthReply(service="worker", instance_id="stand-in")

        async def on_health(_: Empty) -> HealthReply:
            return health

        async def on_attach(_: Empty) -> WorkerInfo:
            return WorkerInfo(worker_id="stand-in", replica_id=self.replica_id, model_name="m",
                              num_blocks=64, block_size=16, max_model_len=1024,
                              eos_token_ids=[2], kv_cache_bytes=1 << 20, device="cpu",
                              dtype="float32")

        await bus.serve(subjects.worker_ping(self.replica_id), Empty, on_health)
        await bus.serve(subjects.worker_attach(self.replica_id), Empty, on_attach)
        await bus.serve(subjects.health("worker"), Empty, on_health,
                        queue=subjects.queue_group("worker"))
        await bus.flush()
        self._ready.set()
        await self._stop.wait()
        await bus.close()


def test_probes_fail_when_nothing_answers(nats_url):
    for service in ("tokenizer", "worker"):
        result = probe(service, nats_url=nats_url)
        assert result.returncode == 1 and "nothing answers" in result.stderr, result.stderr
    result = probe("scheduler", "--live", "--timeout-s", "1.5", nats_url=nats_url)
    assert result.returncode == 1 and "no heartbeat" in result.stderr
    unreachable = f"nats://127.0.0.1:{free_port()}"
    result = probe("worker", "--timeout-s", "1", nats_url=unreachable)
    assert result.returncode == 1 and "cannot reach NATS" in result.stderr
    result = probe("gateway", "--live", nats_url=nats_url, FLOTILLA_PORT=str(free_port()))
    assert result.returncode == 1


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
def test_probes_follow_the_real_services(nats_url, tmp_path):
    gateway_port = free_port()
    stack = Stack(StackOptions(nats_url=nats_url, namespace=NAMESPACE, port=gateway_port,
                               host="127.0.0.1", log_dir=tmp_path))
    try:
        for name in ("scheduler", "tokenizer", "gateway"):
            stack.start_service(name)
        # A scheduler with no worker: alive, not ready.
        assert eventually_ok("scheduler", "--live", nats_url=nats_url).returncode == 0
        not_ready = probe("scheduler", nats_url=nats_url)
        assert not_ready.returncode == 1 and "no worker attached" in not_ready.stderr
        gateway = dict(nats_url=nats_url, FLOTILLA_PORT=str(gateway_port))
        assert eventually_ok("gateway", "--live", **gateway).returncode == 0
        assert eventually_ok("tokenizer", nats_url=nats_url).returncode == 0
        not_ready = probe("gateway", **gateway)
        assert not_ready.returncode == 1 and "503" in not_ready.stderr  # no worker yet

        with StandInWorker(nats_url):
            assert probe("worker", nats_url=nats_url).returncode == 0
            ready = eventually_ok("scheduler", nats_url=nats_url)
            assert ready.returncode == 0 and "worker attached" in ready.stdout
            assert eventually_ok("gateway", **gateway).returncode == 0
            # Another replica, or another release's namespace, is not this one.
            assert probe("worker", nats_url=nats_url, FLOTILLA_REPLICA_ID="1").returncode == 1
            assert probe("scheduler", "--live", "--timeout-s", "1.5", nats_url=nats_url,
                         FLOTILLA_REPLICA_ID="1").returncode == 1
            assert probe("tokenizer", nats_url=nats_url, namespace="other-release").returncode == 1
        assert probe("worker", nats_url=nats_url).returncode == 1, "the worker is gone"
    finally:
        stack.stop()


def test_service_comes_from_pid1_when_not_given(tmp_path):
    (tmp_path / "1").mkdir()
    cmdline = tmp_path / "1" / "cmdline"
    cmdline.write_bytes(b"/opt/venv/bin/python\0-m\0services.scheduler\0--max-num-seqs\0" b"8\0")
    assert service_from_pid1(tmp_path) == "scheduler"
    cmdline.write_bytes(b"/bin/sh\0-c\0sleep 1\0")
    assert service_from_pid1(tmp_path) is None
    assert service_from_pid1(tmp_path / "missing") is None


def test_wrong_usage_exits_2(tmp_path, capsys):
    assert main(["router"], proc_root=tmp_path) == 2
    assert main([], proc_root=Path(tmp_path)) == 2  # no service given and none as PID 1
    assert "give one of gateway, tokenizer, scheduler, worker, kvstore" in capsys.readouterr().err


def test_kvstore_probe_asks_this_nodes_kvstore(nats_url, tmp_path):
    """The probe reads the node id as the kvstore does (FLOTILLA_NODE_ID); a Kubernetes
    node name (dots) works on both sides."""
    node = "ip-10-0-0-7.ec2.internal"
    assert probe("kvstore", "--timeout-s", "1", nats_url=nats_url,
                 FLOTILLA_NODE_ID=node).returncode == 1
    environ = {k: v for k, v in os.environ.items() if not k.startswith("FLOTILLA_")}
    environ |= {"FLOTILLA_NATS_URL": nats_url, "FLOTILLA_NAMESPACE": NAMESPACE,
                "FLOTILLA_NODE_ID": node, "FLOTILLA_KV_SHM_DIR": str(tmp_path)}
    kvstore = subprocess.Popen([sys.executable, "-m", "services.kvstore"], env=environ, cwd=ROOT,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        ok = eventually_ok("kvstore", nats_url=nats_url, FLOTILLA_NODE_ID=node, timeout_s=30)
        assert ok.returncode == 0, ok.stderr
        assert "kvstore.ip-10-0-0-7_ec2_internal.health" in ok.stdout
        other = probe("kvstore", "--timeout-s", "1", nats_url=nats_url, FLOTILLA_NODE_ID="other")
        assert other.returncode == 1 and "nothing answers" in other.stderr
    finally:
        kvstore.kill()
        kvstore.wait()
