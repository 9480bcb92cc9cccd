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


SERVED_NAME = "acme/smol-chat"
CONTEXT_LEN = 1024  # below SmolLM2's 8192


def assert_api_serves(port: int, api_name: str, other_name: str) -> None:
    """/v1/models lists ``api_name``, a request for it is answered under that name and one
    for ``other_name`` is a 404."""
    base = f"http://127.0.0.1:{port}/v1"
    assert [m["id"] for m in httpx.get(f"{base}/models", timeout=30).json()["data"]] == [api_name]

    def chat(name: str) -> httpx.Response:
        return httpx.post(f"{base}/chat/completions", timeout=60, json={
            "model": name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})

    answered, refused = chat(api_name), chat(other_name)
    assert answered.status_code == 200 and answered.json()["model"] == api_name, answered.text
    assert refused.status_code == 404 and refused.json()["error"]["code"] == "model_not_found"


# The Ctrl-C run also renames the model (--served-model-name) and sets the context length
# (--max-model-len, which the tokenizer must report as the worker serves it): one stack
# start covers all three.
@pytest.mark.parametrize(("stop_signal", "served_name"),
                         [(signal.SIGTERM, None),
                          pytest.param(signal.SIGINT, SERVED_NAME, marks=pytest.mark.slow)])
def test_serve_prints_the_api_and_stops_cleanly(stop_signal, served_name, model_name):
    port = free_port()
    options = (["--served-model-name", served_name, "--max-model-len", str(CONTEXT_LEN)]
               if served_name else [])
    process = subprocess.Popen([FLOTILLA, "serve", "--host", "127.0.0.1", "--port", str(port),
                                *options],
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
        api_name = served_name or model_name
        assert f'"model": "{api_name}"' in output  # the curl line to try
        assert_api_serves(port, api_name, other_name=model_name if served_name else "other")
        if served_name:
            card = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).json()["data"][0]
            assert card["max_model_len"] == CONTEXT_LEN
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
