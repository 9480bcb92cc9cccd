"""Supervision in ``flotilla serve``: a child that exits is started again after a backoff,
the nats-server on the same port; a child that keeps crashing stops everything; the stop
goes in order (gateway first, nats last) and a second signal kills at once."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from cli.stack import Backoff, RestartPolicy, ServiceFailed, Stack, StackOptions, free_port

pytestmark = pytest.mark.chaos

FLOTILLA = str(Path(sys.executable).parent / "flotilla")


# ------------------------------------------------------------ the policy, on a fake clock
def test_backoff_doubles_to_its_cap_and_gives_up_after_fast_crashes():
    backoff = Backoff(RestartPolicy())
    delays, now = [], 100.0
    for _ in range(6):
        backoff.started(now)
        now += 1.0  # up one second, then it crashes
        delays.append(backoff.exited(now))
        now += delays[-1] or 0
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, None]  # 5 restarts within 60 s, then give up

    capped = Backoff(RestartPolicy(max_restarts=100))
    got = []
    for step in range(8):
        capped.started(step * 20.0)
        got.append(capped.exited(step * 20.0 + 1))
    assert got == [0.5, 1, 2, 4, 8, 10, 10, 10]


def test_backoff_starts_over_after_a_long_run_and_forgets_old_restarts():
    backoff = Backoff(RestartPolicy())
    backoff.started(0.0)
    assert [backoff.exited(1.0), backoff.exited(2.0), backoff.exited(3.0)] == [0.5, 1.0, 2.0]
    backoff.started(10.0)
    assert backoff.exited(40.0) == 0.5  # up 30 s: the wait starts over
    # Crashes 16 s apart never put 5 restarts in one 60 s window: never given up on.
    spaced = Backoff(RestartPolicy())
    for step in range(20):
        spaced.started(step * 16.0)
        assert spaced.exited(step * 16.0 + 5.0) is not None


# ------------------------------------------------------------ the Stack, with stand-in children
CHILD = r"""
import signal, sys, time
name, mode, marks = sys.argv[1:4]
def on_term(*_):
    with open(marks, "a") as f:
        f.write(name + "\n")
    time.sleep(0.2)
    sys.exit(0)
signal.signal(signal.SIGTERM, signal.SIG_IGN if mode == "stubborn" else on_term)
print(name, "ready", flush=True)
if mode == "crash":
    print(name, "boom: CUDA out of memory (pretend)", flush=True)
    sys.exit(3)
while True:
    time.sleep(1)
"""


class FakeStack(Stack):
    """A Stack whose services are small Python processes (no nats, no model)."""

    def __init__(self, tmp_path: Path, modes: dict[str, str], **options) -> None:
        super().__init__(StackOptions(nats_url="nats://127.0.0.1:1", **options))
        self.modes, self.marks = modes, tmp_path / "marks"
        self.now = 0.0
        self.clock = lambda: self.now

    def service_command(self, name: str) -> list[str]:
        return [sys.executable, "-c", CHILD, name, self.modes.get(name, "run"), str(self.marks)]


def test_a_crashing_service_is_restarted_then_given_up_on(tmp_path):
    stack = FakeStack(tmp_path, {"tokenizer": "crash"}, supervise=True, log_dir=tmp_path)
    try:
        stack.start_service("tokenizer")
        stack.start_service("gateway")
        with pytest.raises(ServiceFailed) as failed:
            for _ in range(40):
                stack.processes["tokenizer"].wait(timeout=30)
                stack.supervise_once()  # sees the exit: a restart due after the backoff
                stack.now += 1.0  # fake time: all six exits fall within 60 s
                stack.supervise_once()  # starts it again once the backoff is over
        message = str(failed.value)
        assert "tokenizer" in message and "exit code 3" in message
        assert "boom: CUDA out of memory" in message and "tokenizer.log" in message
        assert stack.restarts == {"tokenizer": 5}
        assert json.loads((tmp_path / "restarts.json").read_text()) == {"tokenizer": 5}
        assert stack.processes["gateway"].poll() is None  # the others kept running
    finally:
        stack.stop()


def test_without_a_log_dir_the_output_is_piped_and_its_tail_kept(tmp_path, capfd):
    stack = FakeStack(tmp_path, {"tokenizer": "crash"}, supervise=True)
    try:
        stack.start_service("tokenizer").wait(timeout=30)
        stack.supervise_once()
        deadline = time.monotonic() + 5
        while len(stack.tail("tokenizer")) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "boom" in "".join(stack.tail("tokenizer"))
        stack.now += 1
        stack.supervise_once()
        assert stack.restarts == {"tokenizer": 1}
    finally:
        stack.stop()
    err = capfd.readouterr().err
    assert "tokenizer boom" in err  # echoed to our stderr
    assert "tokenizer exited (exit code 3)" in err and "restart 1 in 0.5 s" in err
    assert "tokenizer restarted (restart 1, pid" in err


def test_supervision_is_off_by_default_and_hand_stopped_services_stay_stopped(tmp_path):
    plain = FakeStack(tmp_path, {"tokenizer": "crash"}, log_dir=tmp_path)
    try:
        plain.start_service("tokenizer").wait(timeout=30)
        plain.supervise_once()
        assert plain.restarts == {} and plain.processes["tokenizer"].returncode == 3
    finally:
        plain.stop()
    stack = FakeStack(tmp_path, {}, supervise=True, log_dir=tmp_path)
    try:
        stack.start_service("worker")
        stack.stop_service("worker", signal.SIGKILL)
        stack.now += 100
        stack.supervise_once()
        assert "worker" not in stack.processes and stack.restarts == {}
        stack.start_service("worker")  # the tests' control stays as it was
        stack.supervise_once()
        assert stack.processes["worker"].poll() is None
    finally:
        stack.stop()


def wait_ready(stack: FakeStack, names: list[str]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        logs = [(stack.options.log_dir / f"{n}.log") for n in names]
        if all(log.exists() and "ready" in log.read_text() for log in logs):
            return
        time.sleep(0.05)
    raise TimeoutError("stand-in services did not start")


def test_stop_goes_gateway_first_then_schedulers_workers_tokenizer_kvstore(tmp_path):
    stack = FakeStack(tmp_path, {}, log_dir=tmp_path, replicas=2)
    names = stack.service_names()
    assert names.index("kvstore") < names.index("worker")  # started before the workers
    for name in names:
        stack.start_service(name)
    wait_ready(stack, names)
    stack.stop()
    order = stack.marks.read_text().split()  # one group at a time, any order inside one
    assert sorted(order) == sorted(names)
    assert [name.partition("-")[0] for name in order] == [
        "gateway", "scheduler", "scheduler", "worker", "worker", "tokenizer", "kvstore"]


def test_kill_ends_a_stop_at_once(tmp_path):
    stack = FakeStack(tmp_path, {"gateway": "stubborn"}, log_dir=tmp_path)
    for name in ("gateway", "tokenizer"):
        stack.start_service(name)
    wait_ready(stack, ["gateway", "tokenizer"])
    threading.Timer(0.5, stack.kill).start()  # the second Ctrl-C
    started = time.monotonic()
    stack.stop(timeout_s=60)
    assert time.monotonic() - started < 10
    assert not stack.processes


def test_shutdown_timeout_goes_only_to_services_that_take_it():
    import cli.stack

    stack = Stack(StackOptions(nats_url="nats://127.0.0.1:1", shutdown_timeout_s=30.0))
    assert "--port" in cli.stack.service_flags("gateway")  # what its --help lists
    assert cli.stack.service_flags("nosuchservice") == frozenset()
    for kind in ("gateway", "worker", "scheduler", "kvstore"):  # their configs' Drain section
        command = stack.service_command(kind)
        assert command[command.index("--shutdown-timeout") + 1] == "30"
        assert sum(item.startswith("--shutdown-timeout") for item in command) == 1
    assert "--shutdown-timeout" not in cli.stack.service_flags("tokenizer")
    assert not any(item.startswith("--shutdown") for item in stack.service_command("tokenizer"))


# ------------------------------------------------------------ a real nats-server
async def test_nats_server_restarts_on_the_same_port_and_clients_reconnect():
    import nats

    stack = Stack(StackOptions(supervise=True))
    url = stack.nats_url = stack.start_nats()
    client = await nats.connect(url, allow_reconnect=True, max_reconnect_attempts=-1,
                                reconnect_time_wait=0.2)
    try:
        async def echo(msg):
            await msg.respond(msg.data)

        await client.subscribe("echo", cb=echo)
        first_pid = stack._nats.pid
        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while stack.restarts.get("nats", 0) < 1 and time.monotonic() < deadline:
            stack.supervise_once()
            await asyncio.sleep(0.1)
        assert stack.restarts == {"nats": 1}
        assert stack._nats.pid != first_pid and stack.nats_url == url
        reply = None
        while reply is None and time.monotonic() < deadline:
            try:
                reply = await client.request("echo", b"hi", timeout=0.5)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError,
                    nats.errors.ConnectionReconnectingError):
                await asyncio.sleep(0.2)
        assert reply is not None and reply.data == b"hi"  # resubscribed on the new server
    finally:
        await client.close()
        stack.stop()


# ------------------------------------------------------------ flotilla serve, for real
def children_of(pid: int) -> dict[int, str]:
    """Every descendant of ``pid``: its command line."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child, its_parent in parents.items():
            if its_parent == parent:
                try:
                    found[child] = (Path(f"/proc/{child}/cmdline").read_bytes()
                                    .replace(b"\0", b" ").decode())
                except OSError:
                    continue
                frontier.append(child)
    return found


def pid_of(root: int, needle: str) -> int:
    matches = [pid for pid, cmdline in children_of(root).items() if needle in cmdline]
    assert len(matches) == 1, (needle, children_of(root))
    return matches[0]


def healthy(base_url: str) -> dict | None:
    try:
        response = httpx.get(base_url + "/health", timeout=5)
    except httpx.HTTPError:
        return None
    return response.json() if response.status_code == 200 else None


def wait_healthy(base_url: str, timeout_s: float, condition=lambda health: True) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        health = healthy(base_url)
        if health and condition(health):
            return health
        time.sleep(0.25)
    raise AssertionError(f"not healthy within {timeout_s} s: {healthy(base_url)}")


def complete(base_url: str, model_name: str) -> None:
    response = httpx.post(base_url + "/v1/completions", timeout=60, json={
        "model": model_name, "prompt": "The capital of France is", "max_tokens": 4})
    assert response.status_code == 200, response.text


@pytest.mark.slow  # (make test-slow: a stack of its own, half a minute or more)
@pytest.mark.integration
def test_serve_restarts_a_killed_tokenizer_and_nats_server(model_name, tmp_path):
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    stderr = open(tmp_path / "serve.err", "w")
    process = subprocess.Popen(
        [FLOTILLA, "serve", "--host", "127.0.0.1", "--port", str(port),
         "--kv-cache-memory", "256MiB", "--shutdown-timeout", "5"],
        stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
    try:
        lines = []
        while not lines or "Ctrl-C stops everything" not in lines[-1]:
            lines.append(process.stdout.readline())
            assert lines[-1], f"flotilla serve exited: {(tmp_path / 'serve.err').read_text()}"
        before = wait_healthy(base_url, 30)

        os.kill(pid_of(process.pid, "services.tokenizer"), signal.SIGKILL)
        wait_healthy(base_url, 30, lambda health: health["services"]["tokenizer"]["instance_id"]
                     != before["services"]["tokenizer"]["instance_id"])
        complete(base_url, model_name)

        nats_pid = pid_of(process.pid, "nats-server")
        nats_cmdline = children_of(process.pid)[nats_pid]
        os.kill(nats_pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # a new nats-server, on the same port
            new = [pid for pid, cmd in children_of(process.pid).items()
                   if "nats-server" in cmd and pid != nats_pid]
            if new:
                break
            time.sleep(0.2)
        assert new and children_of(process.pid)[new[0]] == nats_cmdline
        wait_healthy(base_url, 30)
        complete(base_url, model_name)
        assert process.poll() is None
        metrics = httpx.get(base_url + "/metrics").text  # the launcher's counts, via the gateway
        assert 'flotilla_service_restarts{service="tokenizer"} 1.0' in metrics
        assert 'flotilla_service_restarts{service="nats"} 1.0' in metrics

        children = children_of(process.pid)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert not [pid for pid in children if Path(f"/proc/{pid}").exists()
                    and "Z" not in (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1]
                                    .split()[0])], "orphaned processes"
        err = (tmp_path / "serve.err").read_text()
        assert "flotilla: tokenizer exited (killed by SIGKILL" in err, err[-3000:]
        assert "flotilla: tokenizer restarted (restart 1" in err
        assert "flotilla: nats restarted (restart 1" in err
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        stderr.close()
