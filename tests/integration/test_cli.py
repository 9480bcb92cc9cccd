"""`flotilla serve` as a user runs it: prints where the API is, serves, and stops
every process it started on SIGTERM or Ctrl-C. (Restarts of killed children:
tests/chaos/test_supervision.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import free_port

pytestmark = pytest.mark.integration

FLOTILLA = str(Path(sys.executable).parent / "flotilla")


def descendants(pid: int) -> set[int]:
    children = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                child = int(entry.name)
                children |= {child} | descendants(child)
    return children


def parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize("stop_signal", [signal.SIGTERM, signal.SIGINT])
def test_serve_prints_the_api_and_stops_cleanly(stop_signal, model_name):
    port = free_port()
    process = subprocess.Popen([FLOTILLA, "serve", "--host", "127.0.0.1", "--port", str(port)],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                               start_new_session=True)
    try:
        lines = []
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = process.stdout.readline()
            assert line, f"flotilla serve exited: {''.join(lines)}"
            lines.append(line)
            if "Ctrl-C stops everything" in line:
                break
        output = "".join(lines)
        assert f"http://127.0.0.1:{port}/v1" in output and "curl " in output
        response = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60, json={
            "model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
        assert response.status_code == 200
        children = descendants(process.pid)
        assert len(children) >= 6  # nats-server and five services (the kvstore included)
        # Each child in its own process group: a Ctrl-C typed in the terminal reaches only
        # the launcher, which stops the services in order (gateway first, nats last).
        direct = [pid for pid in children if parent(pid) == process.pid]
        assert len(direct) == 6 and all(os.getpgid(pid) == pid for pid in direct)
        process.send_signal(stop_signal)
        assert process.wait(timeout=30) == 0
        assert not [pid for pid in children if alive(pid)], "orphaned processes"
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
