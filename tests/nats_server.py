"""A real nats-server for tests: started on a free port, killed, started again on it."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from cli.stack import free_port, nats_server_binary


class NatsServer:
    """A nats-server on one port, which can be killed and started again on that port."""

    def __init__(self, port: int, log_path: Path, extra_args: tuple[str, ...] = ()) -> None:
        self.port = port
        self.log_path = log_path
        self.extra_args = extra_args  # e.g. ("-js", "-sd", DIR): JetStream on
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        with open(self.log_path, "a") as log:
            self.process = subprocess.Popen(
                [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port),
                 *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.log_path.read_text()
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"nats-server did not listen on {self.port}: {self.log_path.read_text()}")

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def started_nats_server(log_path: Path) -> NatsServer:
    server = NatsServer(free_port(), log_path)
    server.start()
    return server
