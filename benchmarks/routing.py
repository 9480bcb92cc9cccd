"""Issue 17's routing benchmark: the same multi-turn workload through
``flotilla serve --replicas 3 --routing POLICY`` for each policy, one stack at a time.

    .venv/bin/python -m benchmarks.routing [--cases multi-tenant,multi-tenant-kvstore,low-diversity]
                                           [--policies kv,least-loaded,round-robin]
    python3 -m benchmarks.routing --device cuda --model DIR --cases multi-tenant-large ...

For each case and policy: start ``flotilla serve`` (default model, CPU, a small worker
KV cache so that the multi-tenant prefixes exceed one replica's cache but fit in three:
each case names its cache in tokens, turned into bytes for the model and dtype),
wait until every replica is ready, run ``flotilla bench serve --dataset-name multi-turn``
with the case's flags and one seed (the same texts for every policy; only the generated
replies, sent back as each next turn's assistant message, come from the server), stop
the stack. Then one table per case (TTFT p50/p90/p99, req/s, tok/s, hit rates, routing
decisions) with kv's ratios to least-loaded, and JSON in --out. During each run a passive
NATS subscriber (BusObserver) also counts what only the schedulers know: the block hashes
each replica's GPU cache evicted, and the decode cost their stats carried; with the
requests that found nothing cached ("cold"), that tells a miss the routing chose from one
an eviction caused.

Cases:
  multi-tenant          6 tenants x 3 conversations x 4 turns, 800-token system prompts,
                        6 conversations in flight, --no-kvstore (a miss is a recompute).
                        Acceptance: kv P90 TTFT <= 0.5x least-loaded's, req/s >= 1.2x.
  multi-tenant-kvstore  the same with the kvstore: replicas on one node share its host
                        tier, so a miss in a replica's cache is a cheap load.
  low-diversity         1 tenant, 72 single-turn conversations, a 128-token system prompt,
                        24 in flight (saturation), --no-kvstore: nothing for the cache to
                        decide. Acceptance: kv within 3% of least-loaded (never worse).
  multi-tenant-large    for a GPU (--device cuda): 12 tenants x 4 conversations x 4 turns,
                        2,000-token system prompts, 24 conversations in flight, --no-kvstore;
                        ~63,000 distinct tokens, 24,576 per replica's cache.

On CUDA the replicas share one GPU: each worker gets an explicit --kv-cache-memory (a
worker left to size its cache takes a share of the card's free memory, and the others
then find none) and CUDA graphs up to 64 sequences (not 1,024: three workers capture
theirs at once, and no case runs more than 24 conversations).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import signal
import re
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

from cli.stack import free_port
from services.gateway.config import RoutingPolicy
from shared.messages import SchedulerBlockEvent, decode
from shared.scheduler_stats import SchedulerStats
from shared.subjects import Subjects

POLICIES = tuple(RoutingPolicy)
STOP_TIMEOUT_S = 40.0  # the serve's --shutdown-timeout (5) + its children's own exit


@dataclass(frozen=True)
class Case:
    name: str
    bench_args: tuple[str, ...]  # flotilla bench serve's dataset and load flags
    kvstore: bool
    what: str
    kv_cache_tokens: int = 4912  # each worker's cache (307 blocks; CPU: 216MiB of SmolLM2 fp32)


MULTI_TENANT = ("--num-tenants", "6", "--conversations-per-tenant", "3", "--num-turns", "4",
                "--system-prompt-len", "800", "--user-message-len", "48", "--output-len", "24",
                "--max-concurrency", "6")
CASES = {case.name: case for case in (
    Case("multi-tenant", MULTI_TENANT, kvstore=False,
         what="prefixes exceed one replica's cache, fit in three; no kvstore"),
    Case("multi-tenant-kvstore", MULTI_TENANT, kvstore=True,
         what="the same, with the node's kvstore (shared host tier)"),
    # One turn each: no conversation to keep together, one short prefix every replica
    # holds after its first request, so where a request goes can only matter for load.
    Case("low-diversity", ("--num-tenants", "1", "--conversations-per-tenant", "72",
                           "--num-turns", "1", "--system-prompt-len", "128",
                           "--user-message-len", "32", "--output-len", "32",
                           "--max-concurrency", "24"), kvstore=False,
         what="one shared 128-token prefix, single turns, 24 in flight (saturated); no kvstore"),
    # The multi-tenant shape scaled for a GPU, where a 1,000-token prefill is milliseconds:
    # longer prefixes, more of them, more in flight; the same cache-to-working-set ratio.
    Case("multi-tenant-large", ("--num-tenants", "12", "--conversations-per-tenant", "4",
                                "--num-turns", "4", "--system-prompt-len", "2000",
                                "--user-message-len", "128", "--output-len", "64",
                                "--max-concurrency", "24"), kvstore=False, kv_cache_tokens=24576,
         what="12 tenants' 2,000-token prefixes exceed one replica's cache, fit in three; "
              "no kvstore (for a GPU)"),
)}
GPU_SERVE_ARGS = ("--max-num-seqs", "64")  # graphs captured per worker (see above)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="multi-tenant,multi-tenant-kvstore,low-diversity",
                        help=f"comma-separated, of {', '.join(CASES)}")
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--model", default="smollm2",
                        help="flotilla serve's --model; the bench builds prompts with its "
                        "tokenizer (e.g. a dummy model directory on a GPU machine)")
    parser.add_argument("--device", default=None,
                        help="the workers' device (cpu, cuda; default: theirs, auto); on CUDA "
                        "every replica shares the one GPU")
    parser.add_argument("--dtype", default=None, help="the workers' dtype (default: theirs, "
                        "fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--kv-cache-memory", default=None,
                        help="each worker's KV cache, e.g. 216MiB (default: the case's token "
                        "count for the model and dtype: SmolLM2 fp32 is 45 KiB a token, so "
                        "4,912 tokens are 216MiB; the multi-tenant working set is ~10,600)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1,
                        help="run every policy this many times, the order rotated each time "
                        "(a shared machine's load drifts); the table adds medians")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="skip the discarded first run (the first stack of an invocation "
                        "ran 5-7%% slower than the same placement later on the 2-core machine)")
    parser.add_argument("--bench-args", default="",
                        help="more flags for every flotilla bench serve, e.g. '--num-turns 3'")
    parser.add_argument("--serve-args", default="", help="more flags for every flotilla serve")
    parser.add_argument("--max-duration", type=float, default=420.0,
                        help="each bench run's --max-duration (seconds)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT", "/tmp/out")) / "routing")
    args = parser.parse_args()
    args.cases = [name.strip() for name in args.cases.split(",") if name.strip()]
    args.policies = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [c for c in args.cases if c not in CASES] + [p for p in args.policies
                                                           if p not in POLICIES]
    if unknown:
        parser.error(f"unknown cases or policies: {', '.join(unknown)}")
    return args


def flotilla(*args: str) -> list[str]:
    return [sys.executable, "-m", "cli.main", *args]


@cache
def has_routing_flag() -> bool:
    help_text = subprocess.run(flotilla("serve", "--help"), cwd=ROOT, capture_output=True,
                               text=True, check=True).stdout
    return "--routing" in help_text


def check_routing_flag(policies: list[str]) -> None:
    """Fail clearly on a tree whose ``flotilla serve`` has no --routing (least-loaded
    alone can still run: it is what such a gateway does)."""
    if not has_routing_flag() and policies != ["least-loaded"]:
        sys.exit("benchmarks/routing.py: this tree's `flotilla serve` has no --routing flag "
                 "(issue 17's routing is not in yet); only --policies least-loaded can run")


def git_commit() -> str:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--",
                            "services", "shared", "cli", "kernels"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    return commit + (" (+ uncommitted changes in services/shared/cli/kernels)" if dirty else "")


def gpu_name() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=30).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def service_cpu_seconds(serve_pid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of each child of ``flotilla serve``, summed by
    kind (gateway, tokenizer, scheduler, worker, nats): what a policy costs the services."""
    tick = os.sysconf("SC_CLK_TCK")
    totals: dict[str, float] = {}
    for stat_path in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat_path.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) != serve_pid:  # fields[1]: the parent pid
                continue
            cmdline = (stat_path.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        kind = next((k for k in ("gateway", "tokenizer", "scheduler", "worker", "kvstore")
                     if f"services.{k}" in cmdline), "nats" if "nats-server" in cmdline else "")
        if kind:
            totals[kind] = totals.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return totals


def load_average() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def on_cuda(args: argparse.Namespace) -> bool:
    return bool(args.device) and args.device.startswith("cuda")


def kv_bytes_per_token(model_config: dict, dtype_bytes: int) -> int:
    """K and V of every layer for one token (the worker's paged cache layout)."""
    num_heads = model_config["num_attention_heads"]
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // num_heads
    num_kv_heads = model_config.get("num_key_value_heads") or num_heads
    return 2 * model_config["num_hidden_layers"] * num_kv_heads * head_dim * dtype_bytes


def kv_cache_memory(args: argparse.Namespace, case: Case) -> str:
    """--kv-cache-memory, else the case's token count in bytes for this model and dtype
    (always explicit: several workers on one GPU must not size theirs from free memory)."""
    if args.kv_cache_memory:
        return args.kv_cache_memory
    from shared.models import resolve_model  # the serve converts or finds it the same way

    dtype = args.dtype if args.dtype not in (None, "auto") else \
        ("bfloat16" if on_cuda(args) else "float32")
    dtype_bytes = {"float32": 4, "bfloat16": 2, "float16": 2}[dtype]
    per_token = kv_bytes_per_token(resolve_model(args.model).config, dtype_bytes)
    return str(case.kv_cache_tokens * per_token)


# ------------------------------------------------------------------ the stack
def serve_command(args: argparse.Namespace, case: Case, policy: str, port: int,
                  log_dir: Path) -> list[str]:
    command = flotilla("serve", "--model", args.model, "--host", "127.0.0.1", "--port", str(port),
                       "--replicas", str(args.replicas), "--kv-cache-memory",
                       kv_cache_memory(args, case), "--log-dir", str(log_dir),
                       "--shutdown-timeout", "5")
    if args.device:
        command += ["--device", args.device]
    if args.dtype:
        command += ["--dtype", args.dtype]
    if has_routing_flag():
        command += ["--routing", policy]
    if not case.kvstore:
        command.append("--no-kvstore")
    if on_cuda(args):
        command += GPU_SERVE_ARGS  # before --serve-args: those win
    return command + shlex.split(args.serve_args)


def bench_command(args: argparse.Namespace, case: Case, base_url: str,
                  result_json: Path) -> list[str]:
    """flotilla bench serve against the stack; --model: its name in requests and the
    tokenizer that builds the prompts, both from the served model's own files."""
    return flotilla("bench", "serve", "--base-url", base_url, "--model", args.model,
                    "--dataset-name", "multi-turn", *case.bench_args, "--ignore-eos",
                    "--seed", str(args.seed), "--max-duration", str(args.max_duration),
                    "--disable-tqdm", "--result-json", str(result_json),
                    *shlex.split(args.bench_args))


def all_replicas_ready(base_url: str, num_replicas: int) -> bool:
    try:
        health = httpx.get(base_url + "/health", timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return False
    replicas = health.get("replicas", {}) if isinstance(health, dict) else {}
    return (health.get("status") == "ok"
            and sum(1 for r in replicas.values() if r.get("worker_ready")) >= num_replicas)


def start_stack(command: list[str], base_url: str, num_replicas: int, timeout_s: float,
                log_path: Path) -> subprocess.Popen:
    log = log_path.open("w")
    process = subprocess.Popen(command, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"flotilla serve exited ({process.returncode}): "
                               + log_path.read_text()[-2000:])
        if all_replicas_ready(base_url, num_replicas):
            return process
        time.sleep(1.0)
    stop_stack(process)
    raise TimeoutError(f"the stack was not ready within {timeout_s:.0f} s (see {log_path})")


def stop_stack(process: subprocess.Popen) -> None:
    """SIGTERM to flotilla serve (it stops its children in order), SIGKILL to its
    process group if it is not gone in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)  # stragglers of its group, if any
    except ProcessLookupError:
        pass
    process.wait()


# ------------------------------------------------------------------ the bus
class BusObserver:
    """Listens on the stack's NATS during a run, as a gateway does, and keeps what the
    schedulers publish that the bench cannot see: each replica's block hashes stored in
    and evicted from its GPU prefix cache (SchedulerBlockEvent) and the decode cost its
    stats carry (0: not measured). Passive: it publishes nothing."""

    def __init__(self, nats_log: Path, namespace: str = "flotilla") -> None:
        self.nats_log = nats_log
        self.subjects = Subjects(namespace)
        self.blocks: dict[str, list[int]] = {}  # replica id -> [stored, evicted]
        self.decode_costs: dict[str, list[float]] = {}  # replica id -> each stats' figure
        self.error = ""
        self._loop = asyncio.new_event_loop()
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> BusObserver:
        self._thread.start()
        self._ready.wait(15.0)
        return self

    def stop(self) -> dict:
        if self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10.0)
        costs = {replica: [c for c in figures if c > 0]
                 for replica, figures in sorted(self.decode_costs.items())}
        return {"error": self.error,
                "blocks": {replica: {"stored": stored, "evicted": evicted}
                           for replica, (stored, evicted) in sorted(self.blocks.items())},
                "decode_cost_tokens": {
                    replica: {"num_stats": len(self.decode_costs[replica]),
                              "num_measured": len(measured),
                              **({"min": min(measured), "median": statistics.median(measured),
                                  "max": max(measured)} if measured else {})}
                    for replica, measured in costs.items()}}

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._listen())
        except Exception as exc:  # a diagnostic: the run goes on without it
            self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self._ready.set()

    async def _listen(self) -> None:
        import nats

        self._stop = asyncio.Event()
        match = re.search(r"Listening for client connections on (\S+)",
                          self.nats_log.read_text())
        if match is None:
            raise RuntimeError(f"no client address in {self.nats_log}")
        client = await nats.connect(f"nats://{match.group(1)}", name="routing-bench-observer")

        async def on_blocks(msg) -> None:
            event = decode(msg.data, SchedulerBlockEvent)
            counts = self.blocks.setdefault(event.replica_id, [0, 0])
            counts[0] += len(event.stored_hashes)
            counts[1] += len(event.removed_hashes)

        async def on_stats(msg) -> None:
            stats = decode(msg.data, SchedulerStats)
            self.decode_costs.setdefault(stats.replica_id, []).append(
                stats.routing.decode_seq_cost_tokens)

        await client.subscribe(self.subjects.scheduler_blocks, cb=on_blocks)
        await client.subscribe(self.subjects.scheduler_stats, cb=on_stats)
        await client.flush()
        self._ready.set()
        await self._stop.wait()
        await client.close()


# ------------------------------------------------------------------ one run
def run_policy(args: argparse.Namespace, case: Case, policy: str, repeat: int = 0,
               name: str = "") -> dict:
    name = name or f"{case.name}-{policy}" + (f"-r{repeat}" if args.repeats > 1 else "")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    command = serve_command(args, case, policy, port, args.out / "logs" / name)
    (args.out / "logs" / name).mkdir(parents=True, exist_ok=True)
    print(f"[{name}] $ {shlex.join(command[1:])}", flush=True)
    started = time.monotonic()
    process = start_stack(command, base_url, args.replicas, args.start_timeout,
                          args.out / "logs" / f"{name}.serve.log")
    print(f"[{name}] ready in {time.monotonic() - started:.0f} s", flush=True)
    observer = BusObserver(args.out / "logs" / name / "nats.log").start()
    result_json = args.out / f"{name}.json"
    bench = bench_command(args, case, base_url, result_json)
    print(f"[{name}] $ {shlex.join(bench[1:])}", flush=True)
    load_before, cpu_before = load_average(), service_cpu_seconds(process.pid)
    try:
        completed = subprocess.run(bench, cwd=ROOT, capture_output=True, text=True)
    finally:
        load_after, cpu_after = load_average(), service_cpu_seconds(process.pid)
        schedulers = observer.stop()
        stop_stack(process)
    service_cpu = {kind: round(cpu_after[kind] - cpu_before.get(kind, 0.0), 2)
                   for kind in cpu_after}
    (args.out / "logs" / f"{name}.bench.log").write_text(completed.stdout + completed.stderr)
    print(completed.stdout, flush=True)
    if not result_json.exists():
        raise RuntimeError(f"[{name}] the bench wrote no result (exit {completed.returncode}): "
                           + completed.stderr[-2000:])
    run_ = json.loads(result_json.read_text())["runs"][0]
    return {"case": case.name, "policy": policy, "repeat": repeat,
            "bench_exit": completed.returncode,
            "serve_command": shlex.join(command[1:]), "bench_command": shlex.join(bench[1:]),
            "load_average_before": load_before, "load_average_after": load_after,
            "service_cpu_s": service_cpu, "summary": run_["summary"], "turns": run_["turns"],
            "server_prefix_cache": run_["server_prefix_cache"],
            "server_counters": run_["server_counters"], "dataset": run_["dataset"],
            "schedulers": schedulers,
            "num_cold": sum(1 for r in run_["requests"] if not r.get("num_cached_tokens")),
            "cold": [(r["conversation_id"], r["turn"]) for r in run_["requests"]
                     if not r.get("num_cached_tokens")]}


# ------------------------------------------------------------------ the table
def row_figures(result: dict) -> dict:
    s, server = result["summary"], result["server_prefix_cache"] or {}
    decisions = (result["server_counters"] or {}).get("flotilla_routing_decisions_total", {})
    return {"ttft_p50": s["ttft_ms"]["median"], "ttft_p90": s["ttft_ms"]["p90"],
            "ttft_p99": s["ttft_ms"]["p99"], "tpot_p50": s["tpot_ms"]["median"],
            "req_s": s["request_throughput"],
            "out_tok_s": s["output_throughput"], "total_tok_s": s["total_token_throughput"],
            "hit_rate": s["prefix_cache_hit_rate"], "scheduler_hit_rate": server.get("hit_rate"),
            "failed": s["failed"] + s["outstanding"], "replica_split": replica_split(server),
            "num_cold": result.get("num_cold"), "evicted": evicted(result),
            "decode_cost": decode_cost(result),
            "decisions": {key.split("reason=")[-1]: int(value)
                          for key, value in decisions.items() if value}}


def evicted(result: dict) -> str:
    """Block hashes each replica's GPU cache evicted during the run (the bus observer)."""
    blocks = (result.get("schedulers") or {}).get("blocks") or {}
    return "/".join(str(figures["evicted"]) for figures in blocks.values()) or "n/a"


def decode_cost(result: dict) -> str:
    """The schedulers' measured decode cost (tokens a stream), median over every stats
    message that carried one, and the share of stats that did."""
    costs = (result.get("schedulers") or {}).get("decode_cost_tokens") or {}
    medians = [c["median"] for c in costs.values() if c.get("num_measured")]
    num_stats = sum(c["num_stats"] for c in costs.values())
    num_measured = sum(c["num_measured"] for c in costs.values())
    if not num_stats:
        return "n/a"
    return (f"{statistics.median(medians):.1f}" if medians else "-") + \
        f"({num_measured / num_stats:.0%})"


def replica_split(server: dict) -> str:
    """Each replica's share of the prompt tokens (the schedulers' lookups): the balance."""
    queries = [figures["queries"] for figures in server.get("by_replica", {}).values()]
    total = sum(queries)
    return "/".join(f"{q / total:.0%}" for q in queries) if total else "n/a"


def _pct(value) -> str:
    return "n/a" if value is None else f"{value:.1%}"


def _num(value, width: int, digits: int = 0) -> str:
    """A figure of the bench's JSON (null where it had no samples)."""
    return f"{'n/a':>{width}}" if value is None else f"{value:>{width}.{digits}f}"


def _ratio(a, b) -> str:
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def case_table(case: Case, results: list[dict]) -> str:
    """One row per run (``r<i>``: the repeat), the 1-minute load average beside it; with
    repeats, each policy's medians; kv's ratios to least-loaded."""
    lines = [f"## {case.name}: {case.what}",
             f"{'policy':<16}{'TTFT p50':>9}{'p90':>8}{'p99':>8}{'TPOT p50':>9}{'req/s':>7}"
             f"{'out tok/s':>10}{'tot tok/s':>10}{'hit':>7}{'sched':>7}{'fail':>5}{'load':>6}"
             f"{'gw cpu':>7}{'cold':>5}  {'evicted':<14}{'dc':<10}"
             f"  {'split':<12}decisions"]
    repeats = len({r["repeat"] for r in results})
    runs: dict[str, list[dict]] = {}
    for result in results:
        f = row_figures(result)
        runs.setdefault(result["policy"], []).append(f)
        label = result["policy"] + (f" r{result['repeat']}" if repeats > 1 else "")
        load = (result["load_average_before"][0] + result["load_average_after"][0]) / 2
        decisions = " ".join(f"{k}={v}" for k, v in sorted(f["decisions"].items()))
        gateway_cpu = result.get("service_cpu_s", {}).get("gateway")
        lines.append(f"{label:<16}{_num(f['ttft_p50'], 9)}{_num(f['ttft_p90'], 8)}"
                     f"{_num(f['ttft_p99'], 8)}{_num(f['tpot_p50'], 9)}{_num(f['req_s'], 7, 3)}"
                     f"{_num(f['out_tok_s'], 10, 1)}{_num(f['total_tok_s'], 10, 1)}"
                     f"{_pct(f['hit_rate']):>7}{_pct(f['scheduler_hit_rate']):>7}"
                     f"{f['failed']:>5}{load:>6.1f}{_num(gateway_cpu, 7, 1)}"
                     f"{_num(f['num_cold'], 5)}  {f['evicted']:<14}{f['decode_cost']:<10}"
                     f"  {f['replica_split']:<12}{decisions}")
    lines.append("(TTFT, TPOT in ms over all turns; hit = usage cached/prompt tokens; sched = the "
                 "schedulers' counters, worker cache + kvstore tiers; load = the 1-minute load "
                 "average around the run; gw cpu = the gateway's CPU seconds during the bench; "
                 "cold = requests that found nothing cached; evicted = block hashes each "
                 "replica's GPU cache evicted; dc = the schedulers' measured decode cost, tokens "
                 "a stream (median; in parentheses the share of stats that carried one); "
                 "split = each replica's share of the prompt tokens; decisions = the gateway's "
                 "routing reasons)")
    medians = {policy: {key: _median([f[key] for f in figures])
                        for key in ("ttft_p50", "ttft_p90", "ttft_p99", "req_s", "total_tok_s")}
               for policy, figures in runs.items()}
    if repeats > 1:
        for policy, m in medians.items():
            lines.append(f"{'median ' + policy:<16}{_num(m['ttft_p50'], 9)}{_num(m['ttft_p90'], 8)}"
                         f"{_num(m['ttft_p99'], 8)}{'':>9}{_num(m['req_s'], 7, 3)}{'':>10}"
                         f"{_num(m['total_tok_s'], 10, 1)}")
    if "kv" in medians and "least-loaded" in medians:
        kv, ll = medians["kv"], medians["least-loaded"]
        lines.append(f"kv / least-loaded{' (medians)' if repeats > 1 else ''}: TTFT p90 "
                     f"{_ratio(kv['ttft_p90'], ll['ttft_p90'])}, req/s "
                     f"{_ratio(kv['req_s'], ll['req_s'])}, total tok/s "
                     f"{_ratio(kv['total_tok_s'], ll['total_tok_s'])}")
        if repeats > 1:  # each repeat's pair ran back to back
            pairs = zip(runs["kv"], runs["least-loaded"])
            lines.append("  per repeat: " + ", ".join(
                f"p90 {_ratio(k['ttft_p90'], l['ttft_p90'])} req/s {_ratio(k['req_s'], l['req_s'])}"
                for k, l in pairs))
    return "\n".join(lines)


def _median(values: list) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


def main() -> None:
    args = parse_args()
    check_routing_flag(args.policies)
    args.out.mkdir(parents=True, exist_ok=True)
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "commit": git_commit(), "machine": {"platform": platform.platform(),
                                                "cpu_count": os.cpu_count()},
            "replicas": args.replicas, "device": args.device or "auto",
            "gpu": gpu_name() if on_cuda(args) else None,
            "kv_cache_memory": {name: kv_cache_memory(args, CASES[name]) for name in args.cases},
            "seed": args.seed, "command": shlex.join(sys.argv)}
    print(f"routing benchmark: tree {meta['commit']}, {os.cpu_count()} CPUs, out {args.out}",
          flush=True)
    results, tables = [], []
    if args.warm_up:  # the first stack of an invocation runs slow: not a policy's fault
        case = CASES[args.cases[0]]
        warm = run_policy(args, case, args.policies[0], name=f"{case.name}-warm-up")
        print(f"[warm-up, discarded] {args.policies[0]}: "
              f"{warm['summary']['request_throughput']:.3f} req/s", flush=True)
    for case_name in args.cases:
        case = CASES[case_name]
        case_results = []
        for repeat in range(args.repeats):
            shift = repeat % len(args.policies)  # rotated: no policy always runs first
            for policy in args.policies[shift:] + args.policies[:shift]:
                case_results.append(run_policy(args, case, policy, repeat))
        results += case_results
        tables.append(case_table(case, case_results))
        print(tables[-1], flush=True)
        summary_path = args.out / "routing_summary.json"
        summary_path.write_text(json.dumps({**meta, "results": results}, indent=2) + "\n")
    if len(tables) > 1:
        print("\n\n".join(tables))
    print(f"wrote {args.out / 'routing_summary.json'}")


if __name__ == "__main__":
    main()
