"""Issue 12 item 6: online serving, flotilla and then vLLM, on one machine with one workload.

    python3 -m benchmarks.gpu.online_serve --model .devmodels/dummy-llama-3.1-8b --out $OUT/online \
        --serve-args "--max-num-seqs 256 --max-num-batched-tokens 8192" --profile-seconds 20

1. flotilla: ``flotilla serve --model MODEL --max-model-len 4096 SERVE_ARGS`` on a free port;
   once /health is ok, ``flotilla bench serve --dataset-name sharegpt --num-prompts 1000
   --ignore-eos --request-rate inf --timed-chunks tokens`` with ``--result-json`` (chunks
   timed as vLLM's client times them: each engine's random weights give their own share of
   ids that decode to no text). With ``--profile-seconds N`` and
   py-spy on PATH, py-spy samples the gateway and tokenizer processes for N seconds from the
   moment the measured load starts, or until it ends (speedscope and flamegraph files, and
   one ``py-spy dump`` of their stacks halfway, 10 s at most). Then the stack is stopped.
2. vLLM, when its kit is installed (``/tmp/vsite/env.sh``, see shared/peers/vllm/README.md)
   and not ``--skip-vllm``: ``vllm serve MODEL --load-format dummy --served-model-name NAME
   --max-model-len 4096`` in its own process with vLLM's PYTHONPATH only, then the identical
   bench command (same seed, prompts and tokenizer: ``--tokenizer`` is the model directory,
   so both engines get the same token ids), then it is stopped. ``--skip-flotilla`` runs
   this half alone: a sweep too long for one device call runs as two calls in one lease.
3. A side-by-side table; ``online_summary.json``, the bench JSONs and every log in --out,
   with a digest of each server's /metrics after its load (online_clients.py: tokens per
   chunk, delivery lag, step times, preemptions).

``--client vllm`` loads both servers with vLLM's own client (``vllm bench serve`` from the
kit) instead, as issue 27 measures streams (``--bench-args`` carries its dataset flags):

    python3 -m benchmarks.gpu.online_serve --model .devmodels/dummy-llama-3.1-8b --client vllm \
        --dataset-name random --bench-args "--random-input-len 1024 --random-output-len 256"

Every phase has a hard limit inside ``--budget`` (540 s: the device tool stops a command at
600 s): a server start ``--start-timeout`` (180 s; vLLM ``--vllm-start-timeout``, 300 s),
a bench ``--max-duration`` (150 s) plus its setup, a stop 40 s. A phase that no longer
fits is skipped and says so. On CPU, for a quick check:

    .venv/bin/python -m benchmarks.gpu.online_serve --model dummy:tiny-llama --num-prompts 20 \
        --skip-vllm --out /tmp/o
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

from cli.bench.deadline import EXIT_DEADLINE, RUN_STARTED
from benchmarks.gpu.online_clients import (digest_lines, loads_of, metrics_digest,
                                           summaries_of, table, vllm_client_command,
                                           vllm_client_result)
from cli.stack import _die_with_parent, free_port
from shared.models import resolve_model

TERM_GRACE_S = 30.0  # a server's orderly stop after SIGTERM; then SIGKILL
STOP_S = TERM_GRACE_S + 10.0  # the most a stop takes
BENCH_SETUP_S = 60.0  # the bench's tokenizer, dataset and prompts before its deadline starts
MIN_START_S, MIN_BENCH_S = 30.0, 30.0  # a phase with less time than this left is skipped
PROFILED = ("gateway", "tokenizer")


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def repo_env() -> dict[str, str]:
    """This environment with the repository first on PYTHONPATH (for ``-m cli.main``)."""
    paths = [str(REPO), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


def log(message: str) -> None:
    print(f"[online {time.strftime('%H:%M:%S')}] {message}", flush=True)


# ---------------------------------------------------------------- servers
def start_server(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    """In its own session (so its children stop with it), SIGTERM if this script dies."""
    with open(log_path, "w") as handle:
        return subprocess.Popen(command, env=env, cwd=REPO, stdout=handle,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_die_with_parent)


def stop_server(process: subprocess.Popen) -> None:
    """SIGTERM to the server's whole process group, SIGKILL after TERM_GRACE_S; returns once
    no process of the group is left (the next server needs the GPU memory back)."""
    deadline = time.monotonic() + TERM_GRACE_S
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        while time.monotonic() < deadline and _group_alive(process):
            time.sleep(0.2)
        if not _group_alive(process):
            break
        deadline = time.monotonic() + STOP_S - TERM_GRACE_S
    process.wait()


def _group_alive(process: subprocess.Popen) -> bool:
    """A live (not zombie) process is left in the group whose id is the leader's pid."""
    process.poll()  # reap the leader once it exits
    return any(stat[2] == str(process.pid) and stat[0] != "Z" for stat in _proc_stats().values())


def _proc_stats() -> dict[int, list[str]]:
    """{pid: [state, ppid, pgrp, ...]} from /proc/*/stat."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stats[int(entry.name)] = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                pass
    return stats


def flotilla_ready(health: dict | None) -> bool:
    replicas = (health or {}).get("replicas") or {}
    return (health or {}).get("status") == "ok" and bool(replicas) and all(
        r.get("worker_ready") for r in replicas.values())


def wait_healthy(base_url: str, process: subprocess.Popen, timeout_s: float,
                 ready: Callable[[dict | None], bool]) -> float:
    """Poll GET /health until ``ready(its JSON or None)``; seconds waited. Raises if the
    server exits or the time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode}")
        try:
            with urllib.request.urlopen(base_url + "/health", timeout=5) as response:
                body = response.read()
            try:
                health = json.loads(body) if body.strip() else None
            except ValueError:
                health = None
            if ready(health):
                return time.monotonic() - started
        except (urllib.error.URLError, OSError):
            pass  # not listening yet, or 503 while a service starts
        time.sleep(1.0)
    raise TimeoutError(f"not healthy within {timeout_s:.0f} s")


# ---------------------------------------------------------------- py-spy
def descendants(root_pid: int) -> list[int]:
    parents = {pid: int(stat[1]) for pid, stat in _proc_stats().items()}
    found, frontier = [], [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [child for child, parent in parents.items() if parent == pid]
        found += children
        frontier += children
    return found


def service_pids(root_pid: int, names: tuple[str, ...] = PROFILED) -> dict[str, int]:
    """{"gateway": pid, "tokenizer": pid, ...} among the stack's processes."""
    pids = {}
    for pid in descendants(root_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        for name in names:
            if f"services.{name}".encode() in argv and name not in pids:
                pids[name] = pid
    return pids


class Profiler:
    """py-spy record (speedscope and flamegraph) on the gateway and tokenizer for N
    seconds (or until the load ends), and one py-spy dump of each halfway (10 s at most)."""

    def __init__(self, py_spy: str, root_pid: int, out: Path, seconds: float, rate: int,
                 services: tuple[str, ...] = PROFILED) -> None:
        self.py_spy, self.root_pid, self.out = py_spy, root_pid, out
        self.services = services
        self.seconds, self.rate = seconds, rate
        self.records: list[subprocess.Popen] = []
        self.files: list[str] = []
        self.errors: list[str] = []
        self.timer: threading.Timer | None = None

    def start(self) -> None:
        pids = service_pids(self.root_pid, self.services)
        log(f"py-spy: sampling {pids} for {self.seconds:g} s")
        seconds = str(max(1, round(self.seconds)))
        for name, pid in pids.items():
            for fmt, suffix in (("speedscope", "speedscope.json"), ("flamegraph", "svg")):
                path = self.out / f"pyspy_{name}.{suffix}"
                self.files.append(str(path))
                self.records.append(subprocess.Popen(
                    [self.py_spy, "record", "--pid", str(pid), "--duration", seconds,
                     "--rate", str(self.rate), "--nonblocking", "--format", fmt, "--output",
                     str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        self.timer = threading.Timer(min(self.seconds / 2, 10.0), self.dump, args=(pids,))
        self.timer.start()

    def dump(self, pids: dict[str, int]) -> None:
        for name, pid in pids.items():
            path = self.out / f"pyspy_dump_{name}.txt"
            try:
                done = subprocess.run([self.py_spy, "dump", "--pid", str(pid), "--nonblocking"],
                                      capture_output=True, text=True, timeout=30)
                path.write_text(done.stdout + done.stderr)
                self.files.append(str(path))
            except (OSError, subprocess.TimeoutExpired) as exc:
                self.errors.append(f"dump {name}: {exc}")

    def finish(self) -> dict:
        """After the load: stop the samplers still running (py-spy writes its file on
        SIGINT) and collect what they wrote."""
        if self.timer is not None:
            self.timer.cancel()  # a dump not taken yet would show idle stacks
            self.timer.join(timeout=40)
        for process in self.records:
            if process.poll() is None:
                process.send_signal(signal.SIGINT)
            try:
                _, stderr = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                _, stderr = process.communicate()
            if process.returncode:
                first_line = (stderr.strip().splitlines() or [""])[0]
                self.errors.append(f"py-spy record exited {process.returncode}: {first_line}")
        return {"files": [f for f in self.files if Path(f).exists()], "errors": self.errors}


# ---------------------------------------------------------------- the benchmark
def bench_command(args: argparse.Namespace, base_url: str, name: str, tokenizer: str,
                  max_duration_s: float, result_json: Path) -> list[str]:
    command = [sys.executable, "-m", "cli.main", "bench", "serve", "--base-url", base_url,
               "--model", name, "--tokenizer", tokenizer, "--dataset-name", args.dataset_name,
               "--num-prompts", str(args.num_prompts), "--ignore-eos",
               "--request-rate", args.request_rate, "--seed", str(args.seed),
               "--max-duration", f"{max_duration_s:.0f}", "--disable-tqdm",
               # chunks timed by the tokens they carry: each engine's random weights emit
               # their own share of ids without text (--bench-args may say otherwise)
               "--timed-chunks", "tokens", "--result-json", str(result_json)]
    if args.dataset_path:
        command += ["--dataset-path", args.dataset_path]
    return command + shlex.split(args.bench_args)


def run_bench(engine: str, command: list[str], timeout_s: float, out: Path,
              on_run_started: Callable[[], None] = lambda: None) -> int:
    """Run the bench, its output teed to the console and bench_ENGINE.log; kill it after
    ``timeout_s`` (its own --max-duration should end it well before)."""
    process = subprocess.Popen(command, env=repo_env(), cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, preexec_fn=_die_with_parent)

    def pump() -> None:
        with open(out / f"bench_{engine}.log", "w") as handle:
            for line in process.stdout:
                handle.write(line)
                print(f"  {engine} | {line}", end="", flush=True)
                if RUN_STARTED in line:
                    on_run_started()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        log(f"{engine}: the bench ran past {timeout_s:.0f} s: killed")
        process.kill()
        process.wait()
    reader.join(timeout=10)
    return process.returncode


@dataclass
class Server:
    engine: str  # "flotilla" or "vllm"
    command: list[str]
    env: dict[str, str]
    port: int
    start_timeout_s: float
    ready: Callable[[dict | None], bool]  # on /health's JSON (None: not JSON)
    profile: bool = False  # py-spy its gateway and tokenizer (--profile-seconds)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def flotilla_server(args: argparse.Namespace, model: str, port: int) -> Server:
    command = [sys.executable, "-m", "cli.main", "serve", "--model", model, "--host", "127.0.0.1",
               "--port", str(port), "--max-model-len", str(args.max_model_len),
               *shlex.split(args.serve_args)]
    return Server("flotilla", command, repo_env(), port, args.start_timeout, flotilla_ready,
                  profile=True)


def vllm_server(args: argparse.Namespace, model_dir: str, name: str, port: int) -> Server:
    """vLLM in its own process with only its kit's PYTHONPATH (flotilla's wheels pin other
    fastapi/pydantic versions); /health answers 200 once it serves."""
    command = ["bash", "-c", 'unset PYTHONPATH; source "$0" && exec vllm serve "$@"',
               args.vllm_env, model_dir, "--load-format", "dummy", "--served-model-name", name,
               "--max-model-len", str(args.max_model_len), "--host", "127.0.0.1",
               "--port", str(port), *shlex.split(args.vllm_args)]
    env = {**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0"}  # FlashInfer is not in the kit
    return Server("vllm", command, env, port, args.vllm_start_timeout, lambda health: True)


def phase(server: Server, args: argparse.Namespace, budget: Budget, out: Path, name: str,
          tokenizer: str) -> list[dict]:
    """Start a server, wait for it, run each load against it in turn, stop it: a result
    per load."""
    engine = server.engine
    result: dict = {"engine": engine, "server_command": server.command,
                    "server_log": str(out / f"server_{engine}.log")}
    time_for_start_s = budget.left() - STOP_S - BENCH_SETUP_S - MIN_BENCH_S
    if time_for_start_s < MIN_START_S:
        log(f"{engine}: skipped, {budget.left():.0f} s of the --budget left")
        return [{**result, "status": "skipped: out of time"}]
    log(f"{engine}: starting: {shlex.join(server.command)}")
    process = start_server(server.command, server.env, out / f"server_{engine}.log")
    try:
        try:
            result["start_s"] = wait_healthy(server.base_url, process,
                                             min(server.start_timeout_s, time_for_start_s),
                                             server.ready)
        except (RuntimeError, TimeoutError) as exc:
            log(f"{engine}: did not start: {exc} (log: {result['server_log']})")
            return [{**result, "status": f"start failed: {exc}"}]
        log(f"{engine}: healthy after {result['start_s']:.0f} s")
        results, metrics_before = [], ""
        for index, load in enumerate(loads_of(args)):
            if budget.left() - STOP_S - BENCH_SETUP_S < MIN_BENCH_S:
                results.append({**result, "load": load.load_name, "status": "skipped: out of time"})
                continue
            load_result, metrics_before = run_load(server, process.pid, load, budget, out, name,
                                                   tokenizer, metrics_before,
                                                   profile=index == 0)
            results.append({**result, **load_result})
        return results
    finally:
        stop_server(process)
        log(f"{engine}: stopped")


def run_load(server: Server, server_pid: int, args: argparse.Namespace, budget: Budget,
             out: Path, name: str, tokenizer: str, metrics_before: str,
             profile: bool) -> tuple[dict, str]:
    """One load against a running server: its result, and the server's /metrics after it
    (the next load's digest counts from there)."""
    engine = server.engine
    label = f"{engine}/{args.load_name}" if args.load_name else engine
    suffix = f"_{args.load_name}" if args.load_name else ""
    max_duration_s = min(args.max_duration, budget.left() - STOP_S - BENCH_SETUP_S)
    if args.client == "vllm":
        result_json = out / vllm_client_result(engine + suffix)
        command = vllm_client_command(args, server.base_url, name, tokenizer, out,
                                      engine + suffix)
    else:
        result_json = out / f"bench_{engine}{suffix}.json"
        command = bench_command(args, server.base_url, name, tokenizer, max_duration_s,
                                result_json)
    result: dict = {"engine": label, "load": args.load_name, "bench_command": command}
    profiler = None
    if profile and server.profile and args.profile_seconds > 0:
        py_spy = (shutil.which("py-spy")
                  or shutil.which("py-spy", path=Path(sys.executable).parent))
        if py_spy is None:
            log("py-spy is not on PATH: no profile")
        else:
            profiler = Profiler(py_spy, server_pid, out,
                                min(args.profile_seconds, max_duration_s), args.profile_rate,
                                tuple(args.profile_services.split(",")))
    result["bench_exit"] = run_bench(engine + suffix, command, max_duration_s + BENCH_SETUP_S,
                                     out, profiler.start if profiler else lambda: None)
    if profiler is not None:
        result["profile"] = profiler.finish()
    result["server_metrics"], metrics_text = save_metrics(
        server.base_url, out / f"metrics_{engine}{suffix}.txt", metrics_before)
    if result_json.exists():
        result.update(summaries_of(json.loads(result_json.read_text()), args))
    exit_code = result["bench_exit"]
    result["status"] = {0: "ok", EXIT_DEADLINE: "cut short"}.get(exit_code,
                                                                 f"bench exit {exit_code}")
    return result, metrics_text or metrics_before


def save_metrics(base_url: str, path: Path, before: str = "") -> tuple[dict, str]:
    """The server's Prometheus /metrics after a load (step times, idle ratio, queues),
    saved whole; its digest (online_clients.DIGESTED, less the ``before`` scrape's counts)
    printed; both returned."""
    try:
        with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
            text = response.read().decode()
    except (OSError, urllib.error.URLError) as exc:
        log(f"no /metrics from {base_url}: {exc}")
        return {}, ""
    path.write_text(text)
    digest = metrics_digest(text, before)
    print("\n".join([f"server metrics ({path.name}):", *digest_lines(digest)]), flush=True)
    return digest, text


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory or dummy:<preset>")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "online"))
    parser.add_argument("--max-model-len", type=int, default=4096, help="both engines")
    parser.add_argument("--serve-args", default="", help="more flotilla serve flags, one string")
    parser.add_argument("--vllm-args", default="", help="more vllm serve flags, one string")
    parser.add_argument("--dataset-name", default="sharegpt")
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--request-rate", default="inf")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--client", choices=("flotilla", "vllm"), default="flotilla",
                        help="the load: flotilla bench serve, or vLLM's own `vllm bench serve` "
                             "from the kit (needs --vllm-env; no --max-duration)")
    parser.add_argument("--bench-args", default="", help="more flags for the client")
    parser.add_argument("--loads", default="", metavar="JSON",
                        help="several loads, in turn, on each started server: a JSON list of "
                             "objects, each the flags (by their names here, with underscores, "
                             "and a name) that differ from these")
    parser.add_argument("--max-duration", type=float, default=150.0, help="each bench's deadline")
    parser.add_argument("--start-timeout", type=float, default=180.0)
    parser.add_argument("--vllm-start-timeout", type=float, default=300.0)
    parser.add_argument("--budget", type=float, default=540.0, help="seconds for everything")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-flotilla", action="store_true",
                        help="vLLM only (its half of a comparison too long for one device "
                             "call: the next call in the same lease)")
    parser.add_argument("--vllm-env", default="/tmp/vsite/env.sh", help="the vLLM kit's env.sh")
    parser.add_argument("--profile-seconds", type=float, default=0.0,
                        help="py-spy the gateway and tokenizer this long under load (0: off)")
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--profile-services", default=",".join(PROFILED),
                        help="the flotilla services py-spy samples, comma-separated")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    budget = Budget(args.budget)

    def out_of_time(_signum, _frame) -> None:
        raise TimeoutError(f"the --budget of {args.budget:.0f} s ran out")

    signal.signal(signal.SIGALRM, out_of_time)  # the last resort: the phases have limits
    signal.alarm(int(args.budget) + 15)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # stop the servers on the way out
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = resolve_model(args.model)  # a dummy:<preset> is written out here once
    name, model_dir = model.name, str(model.path)
    # a path made absolute (the servers run in the repository), a dummy:<preset> as given
    serve_model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    results = []
    try:
        if args.skip_flotilla:
            log("flotilla: skipped (--skip-flotilla)")
        else:
            results += phase(flotilla_server(args, serve_model, free_port()), args, budget,
                             out, name, model_dir)
        if args.skip_vllm:
            log("vllm: skipped (--skip-vllm)")
        elif not Path(args.vllm_env).is_file():
            log(f"vllm: skipped, no kit at {args.vllm_env} (shared/peers/vllm/README.md)")
            results.append({"engine": "vllm", "status": f"skipped: no {args.vllm_env}"})
        else:
            results += phase(vllm_server(args, model_dir, name, free_port()), args, budget,
                             out, name, model_dir)
    finally:
        signal.alarm(0)
        print(table(results), flush=True)
        summary = {"benchmark": "online_serve", "model": args.model, "served_name": name,
                   "flags": vars(args), "seconds": args.budget - budget.left(),
                   "results": results}
        (out / "online_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        log(f"wrote {out / 'online_summary.json'}")
    return 0 if all(r["status"] == "ok" or r["status"].startswith("skipped")
                    for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
