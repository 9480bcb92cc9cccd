"""Run the whole stack as OS processes: a nats-server (unless one is given) and every
service. Used by ``flotilla serve`` and by the integration tests, so both start
the stack the same way.

With ``StackOptions.supervise`` (``flotilla serve`` turns it on) a child that exits is
started again after a backoff by ``Stack.supervise_once()``, which the caller runs every
~0.5 s; the integration tests leave it off and stop and start services by hand."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from cli.processes import (  # noqa: F401 (free_port, flags: the tests' and benchmarks' too)
    _die_with_parent, _terminate, describe_exit, flags, free_port, nats_config_file,
    nats_server_binary, replica_gpus, service_flags)
from cli.restarts import Backoff, RestartPolicy

REPLICATED = ("worker", "scheduler")  # one pair per model replica
STOP_ORDER = ("gateway", "scheduler", "worker")  # then the rest (tokenizer), then LAST, then nats
LAST_TO_STOP = "kvstore"  # after the workers that map its arenas; it finishes its disk writes
TAIL_LINES = 20  # of a child's output, shown when it is given up on


class ServiceFailed(RuntimeError):
    """A supervised child exited too often: the stack should stop."""


@dataclass
class StackOptions:
    model: str = "smollm2"
    host: str = "127.0.0.1"
    port: int = 8000
    nats_url: str | None = None  # None: start our own nats-server on a free port
    namespace: str = "flotilla"
    replicas: int = 1  # scheduler + worker pairs
    gateways: int = 1  # gateway processes sharing the port (SO_REUSEPORT when more than one)
    tokenizers: int = 1  # tokenizer processes (one queue group)
    cache_dir: str = "~/.cache/flotilla"
    log_level: str = "info"
    log_dir: Path | None = None  # None: children's output goes to our stderr
    # extra flags per service, e.g. {"worker": ["--kv-cache-memory", "2GiB"]}
    service_args: dict[str, list[str]] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)  # extra environment for every service
    supervise: bool = False  # supervise_once() restarts children that exited
    restart_policy: RestartPolicy = field(default_factory=RestartPolicy)
    # Given to each service whose flags include --shutdown-timeout (its drain on SIGTERM).
    shutdown_timeout_s: float | None = None
    # The node's kvstore (docs/kvstore.md): started before the workers; every worker and
    # scheduler gets --kv-node-id. Its own flags go in service_args["kvstore"].
    kvstore: bool = True
    kv_node_id: str = "local"
    # GPUs per worker (its tensor parallel size) when the stack picks them: replica r's worker
    # gets GPUs r*N..r*N+N-1 (replica_gpus), so replicas don't all land on cuda:0. None: the
    # workers' environment is left alone (CPU, or their --device names the GPU).
    worker_gpus: int | None = None


class Stack:
    def __init__(self, options: StackOptions) -> None:
        self.options = options
        self.nats_url = options.nats_url
        self.processes: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {}  # supervised restarts per child ("nats" included)
        self.clock: Callable[[], float] = time.monotonic  # supervision's clock (tests: fake)
        self._nats: subprocess.Popen | None = None
        self._nats_port: int | None = None  # fixed once chosen: a restart reuses it
        self._backoff: dict[str, Backoff] = {}
        self._restart_due: dict[str, float] = {}  # child -> when supervise_once starts it
        self._tails: dict[str, deque[str]] = {}  # last output lines of piped children
        self._pumps: list[threading.Thread] = []
        self._stopping = False
        self._metrics_dir: Path | None = None
        self._jetstream_dir: Path | None = None
        # where the restart counts go (the gateway shows them in /metrics)
        self.restarts_file = (options.log_dir / "restarts.json" if options.log_dir is not None
                              else Path(tempfile.gettempdir())
                              / f"flotilla-restarts-{os.getpid()}.json")

    def metrics_dir(self) -> Path:
        """The gateways' shared prometheus_client multiprocess folder (several gateways):
        emptied when the stack starts, so no earlier run's counts add in; kept over a
        gateway's restart, so the counts of one that exited stay in the sums."""
        if self._metrics_dir is None:
            self._metrics_dir = Path(tempfile.mkdtemp(prefix="flotilla-metrics-"))
        return self._metrics_dir

    def jetstream_dir(self) -> Path:
        """Our nats-server's JetStream store (stored responses: docs/openai-api.md): in the
        log dir, else a temp dir; the same one over restarts, so stored responses survive."""
        if self._jetstream_dir is None:
            self._jetstream_dir = (self.options.log_dir / "nats-jetstream" if self.options.log_dir
                                   else Path(tempfile.mkdtemp(prefix="flotilla-jetstream-")))
        return self._jetstream_dir

    @property
    def base_url(self) -> str:
        host = "127.0.0.1" if self.options.host in ("0.0.0.0", "") else self.options.host
        return f"http://{host}:{self.options.port}"

    # ------------------------------------------------------------ start
    def start(self, timeout_s: float = 300.0) -> None:
        """Start everything and wait until healthy. A child that exits during the start
        fails it at once (a bad flag should not wait out the backoffs); supervision, when
        on, begins with the first supervise_once()."""
        self._stopping = False
        try:
            if self.nats_url is None:
                self.nats_url = self.start_nats()
            for name in self.service_names():
                self.start_service(name)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def start_nats(self) -> str:
        """Our own nats-server: on a free port the first time, on the same port on every
        restart, so the services' clients reconnect to it. Returns its URL."""
        for _ in range(1 if self._nats_port else 3):  # a free port can be taken meanwhile
            port = self._nats_port or free_port()
            if self._spawn_nats(port):
                self._nats_port = port
                return f"nats://127.0.0.1:{port}"
        raise RuntimeError("nats-server did not start: " + "".join(self._tails.get("nats", [])))

    def _spawn_nats(self, port: int) -> bool:
        ready = threading.Event()
        process = subprocess.Popen(
            [nats_server_binary(), "-c", nats_config_file(), "-a", "127.0.0.1", "-p",
             str(port), "--jetstream", "--store_dir", str(self.jetstream_dir())],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            text=True, errors="replace", preexec_fn=_die_with_parent, process_group=0)
        self._nats = process
        self._backoff.setdefault("nats", Backoff(self.options.restart_policy)).started(self.clock())
        self._pump("nats", process.stderr, self._log_target("nats"), echo=False,
                   on_line=lambda line: "Server is ready" in line and ready.set())
        deadline = time.monotonic() + 15
        while not ready.wait(0.05):
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                process.wait()
                return False
        return True

    def _pump(self, name: str, stream: IO[str], log: IO | None, echo: bool,
              on_line: Callable[[str], object] | None = None) -> None:
        """Read a child's output on a thread (so the pipe never fills): into its log file,
        and to our stderr when ``echo``; keep the last lines for a failure message."""
        tail = self._tails[name] = deque(maxlen=TAIL_LINES)

        def pump() -> None:
            to_stderr = echo
            with stream:
                for line in stream:
                    tail.append(line)
                    if log is not None:
                        log.write(line)
                        log.flush()
                    if to_stderr:
                        try:
                            sys.stderr.write(line)
                            sys.stderr.flush()
                        except (OSError, ValueError):  # our stderr is gone: keep draining
                            to_stderr = False
                    if on_line is not None:
                        on_line(line)
            if log is not None:
                log.close()

        thread = threading.Thread(target=pump, name=f"output-{name}", daemon=True)
        thread.start()
        self._pumps = [t for t in self._pumps if t.is_alive()] + [thread]

    def service_names(self) -> list[str]:
        """'worker' and 'scheduler' for replica 0, 'worker-1', 'scheduler-1', ... after."""
        names = [f"tokenizer-{index}" if index else "tokenizer"
                 for index in range(self.options.tokenizers)]
        names += ["kvstore"] if self.options.kvstore else []
        for replica_id in range(self.options.replicas):
            names += [f"{kind}-{replica_id}" if replica_id else kind for kind in REPLICATED]
        return names + [f"gateway-{index}" if index else "gateway"
                        for index in range(self.options.gateways)]

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
            # one of several counts the figures they all hear alike (metrics.py)
            command += ["--reuse-port"] + (["--no-fleet-metrics"] if replica_id else []) \
                if o.gateways > 1 else []
        if kind == "kvstore":
            command += ["--node-id", o.kv_node_id]
        if kind in REPLICATED and o.kvstore and "--kv-node-id" in service_flags(kind):
            command += ["--kv-node-id", o.kv_node_id]
        drains = "--shutdown-timeout" in service_flags(kind)  # (every service's, Drain)
        if o.shutdown_timeout_s is not None and drains:
            command += ["--shutdown-timeout", f"{o.shutdown_timeout_s:g}"]
        return command + list(o.service_args.get(kind, []))

    def service_env(self, name: str) -> dict[str, str]:
        """The environment a service starts with (start_service adds PYTHONUNBUFFERED when
        its output is piped)."""
        o = self.options
        env = {**os.environ, **o.env, "TOKENIZERS_PARALLELISM": "false"}
        kind, _, replica_id = name.partition("-")
        if kind == "gateway" and o.supervise:
            env["FLOTILLA_RESTARTS_FILE"] = str(self.restarts_file)
        if kind == "gateway" and o.gateways > 1:  # a scrape of any sums them all
            env["PROMETHEUS_MULTIPROC_DIR"] = str(self.metrics_dir())
        if kind != "worker":
            env["OMP_NUM_THREADS"] = "1"  # the cores belong to the workers
        elif o.worker_gpus is not None and (o.replicas > 1 or o.worker_gpus > 1):
            # one replica on one GPU keeps the launcher's view (what the worker did before)
            env["CUDA_VISIBLE_DEVICES"] = replica_gpus(int(replica_id or 0), o.worker_gpus,
                                                       env.get("CUDA_VISIBLE_DEVICES"))
        return env

    def start_service(self, name: str) -> subprocess.Popen:
        """Start (or start again) one service. Its own process group: a Ctrl-C in the
        terminal reaches only the launcher, which stops the services in order."""
        env = self.service_env(name)
        log = self._log_target(name)
        if log is None:
            env["PYTHONUNBUFFERED"] = "1"  # piped to our stderr: lines as they come
        try:
            process = subprocess.Popen(
                self.service_command(name), env=env, stdin=subprocess.DEVNULL,
                stdout=log or subprocess.PIPE, stderr=log or subprocess.STDOUT,
                text=True, errors="replace", preexec_fn=_die_with_parent, process_group=0)
        finally:
            if log is not None:
                log.close()  # the child has its own copy
        if log is None:
            self._pump(name, process.stdout, None, echo=True)
        self.processes[name] = process
        self._backoff.setdefault(name, Backoff(self.options.restart_policy)).started(self.clock())
        return process

    def _log_target(self, name: str) -> IO | None:
        if self.options.log_dir is None:
            return None
        self.options.log_dir.mkdir(parents=True, exist_ok=True)
        return open(self.options.log_dir / f"{name}.log", "a", buffering=1)

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

    # ------------------------------------------------------------ supervision
    def supervise_once(self) -> None:
        """Start again, after its backoff, each child that exited (nothing unless
        ``options.supervise``). Call it every ~0.5 s from the thread that started the stack.
        A service stopped with stop_service() is no longer watched. Raises ServiceFailed
        when a child exits too often (RestartPolicy); the caller then stops the stack."""
        if not self.options.supervise or self._stopping:
            return
        now = self.clock()
        children = {**({"nats": self._nats} if self._nats is not None else {}), **self.processes}
        for name, process in children.items():  # nats first: the services need it
            due = self._restart_due.get(name)
            if due is None:
                if process.poll() is None:
                    continue
                due = self._restart_due[name] = self._schedule_restart(name, process, now)
            if now >= due:
                del self._restart_due[name]
                self._restart(name)

    def _schedule_restart(self, name: str, process: subprocess.Popen, now: float) -> float:
        backoff = self._backoff.setdefault(name, Backoff(self.options.restart_policy))
        uptime = "" if backoff.started_at is None else f" after {now - backoff.started_at:.1f} s"
        how = describe_exit(process.returncode)
        delay = backoff.exited(now)
        if delay is None:
            policy = self.options.restart_policy
            raise ServiceFailed(
                f"the {name} service exited again{uptime} ({how}); it was restarted "
                f"{policy.max_restarts} times within {policy.window_s:g} s: giving up and "
                f"stopping everything.\n"
                f"Last lines of its {self._log_name(name)}:\n" +
                "".join(f"    {line.rstrip()}\n" for line in self.tail(name)))
        self._say(f"{name} exited ({how}){uptime}; restart {self.restarts.get(name, 0) + 1} "
                  f"in {delay:g} s")
        return now + delay

    def _restart(self, name: str) -> None:
        count = self.restarts[name] = self.restarts.get(name, 0) + 1
        self._save_restarts()
        try:
            if name == "nats":
                self.start_nats()
                pid = self._nats.pid
            else:
                pid = self.start_service(name).pid
        except (OSError, RuntimeError) as exc:  # seen as exited again at the next call
            self._say(f"{name} did not start again (restart {count}): {exc}")
            return
        self._say(f"{name} restarted (restart {count}, pid {pid})")

    def _save_restarts(self) -> None:
        """Restarts per child, as JSON in ``restarts_file`` (the log folder's restarts.json
        when there is one): the gateway reads it for /metrics."""
        path = self.restarts_file
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(json.dumps(self.restarts, sort_keys=True))
        path.with_suffix(".tmp").replace(path)

    def tail(self, name: str) -> list[str]:
        """The last lines a child wrote (its log file, or what we piped)."""
        if name in self._tails:
            return list(self._tails[name])
        if self.options.log_dir is None:
            return []
        try:
            with open(self.options.log_dir / f"{name}.log", "rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - 16384))
                return log.read().decode(errors="replace").splitlines()[-TAIL_LINES:]
        except OSError:
            return []

    def _log_name(self, name: str) -> str:
        if self.options.log_dir is None:
            return "output"
        return f"log ({self.options.log_dir / f'{name}.log'})"

    @staticmethod
    def _say(message: str) -> None:
        print(f"flotilla: {message}", file=sys.stderr, flush=True)

    # ------------------------------------------------------------ stop
    def stop_service(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 10.0) -> None:
        process = self.processes.pop(name, None)
        self._restart_due.pop(name, None)
        if process is not None:
            _terminate([process], sig, timeout_s)

    def stop(self, timeout_s: float = 10.0, min_per_tier_s: float = 2.0) -> None:
        """SIGTERM in order, each group once the one before has exited: the gateway (it can
        finish its streams while the rest still runs), schedulers, workers, the tokenizer,
        then our nats-server. One deadline for all, ``timeout_s`` away, but each group gets
        at least ``min_per_tier_s``; what is still running then is killed."""
        self._stopping = True
        self._restart_due.clear()
        deadline = time.monotonic() + timeout_s
        for tier in self._stop_tiers():
            _terminate(tier, signal.SIGTERM, max(deadline - time.monotonic(), min_per_tier_s))
        self.processes.clear()
        self._nats = None
        for thread in self._pumps:  # the pipes are closed: let them finish their writes
            thread.join(timeout=2)
        self._pumps.clear()
        if self.options.log_dir is None:  # our temporary restart counts
            self.restarts_file.unlink(missing_ok=True)
        if self._metrics_dir is not None:
            shutil.rmtree(self._metrics_dir, ignore_errors=True)
            self._metrics_dir = None
        self._stopping = False

    def _stop_tiers(self) -> list[list[subprocess.Popen]]:
        tiers = [[p for n, p in self.processes.items() if n.partition("-")[0] == kind]
                 for kind in STOP_ORDER]
        tiers.append([p for n, p in self.processes.items()
                      if n.partition("-")[0] not in (*STOP_ORDER, LAST_TO_STOP)])
        tiers.append([p for n, p in self.processes.items() if n == LAST_TO_STOP])
        return tiers + [[self._nats] if self._nats is not None else []]

    def kill(self) -> None:
        """SIGKILL every child now (a second Ctrl-C); a stop() under way then ends at once.
        Safe in a signal handler: it only sends signals."""
        for process in [*self.processes.values(), *([self._nats] if self._nats else [])]:
            if process.returncode is None:
                try:
                    os.kill(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
