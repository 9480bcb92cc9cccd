"""Kill each part of a running stack under load and measure what clients see (issue 13).

    python -m benchmarks.chaos_recovery [--streams 8] [--max-tokens 48] [--restart-after 2]

For each victim in turn (tokenizer, worker, scheduler, gateway, nats-server; ``worker-rank``:
rank 1 of a tensor-parallel worker, with ``--worker-args "--tensor-parallel-size 2 ..."``,
after which rank 0 must exit by itself): the services
run one by one on their own nats-server (the operator's setup the issue describes, no
supervisor), N greedy streams are in flight, the victim gets SIGKILL, and it is started
again (same flags; nats-server on the same port) ``--restart-after`` seconds later.
Reported per victim: how the in-flight streams ended (same text as their solo run, an
error event, a connection error, or still hanging at the deadline), the seconds from the
restart to the first good request, the migrations the gateway counted, and where the
restarted process spent its start (its ``startup_phase`` log lines: seconds from its exec
to imports done, tokenizer or model loaded, serving, attached).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx


from cli.stack import Stack, StackOptions, free_port, nats_server_binary
from shared.models import resolve_model

PROMPT = "Tell me a story about {topic}."
TOPICS = ["a dragon", "the sea", "a robot", "a city", "winter", "a cat", "the moon", "a train",
          "a garden", "music", "a river", "bread", "a lighthouse", "a forest", "snow", "bees"]
VICTIMS = ("tokenizer", "worker", "scheduler", "gateway", "nats")
RANK_EXIT_DEADLINE_S = 30.0


class Stream(threading.Thread):
    def __init__(self, base_url: str, body: dict, deadline_s: float) -> None:
        super().__init__(daemon=True)
        self.base_url, self.body, self.deadline_s = base_url, body, deadline_s
        self.text, self.outcome, self.num_chunks = "", "hang", 0

    def run(self) -> None:
        parts = []
        try:
            with httpx.stream("POST", self.base_url + "/v1/completions", json=self.body,
                              timeout=httpx.Timeout(self.deadline_s)) as response:
                for line in response.iter_lines():
                    if line == "data: [DONE]":
                        self.outcome = "done"
                    elif line.startswith("data: "):
                        payload = json.loads(line[6:])
                        if "error" in payload:
                            self.outcome = "error event"
                        elif payload["choices"]:
                            parts.append(payload["choices"][0]["text"])
                            self.num_chunks += 1
            if self.outcome == "hang":
                self.outcome = "cut (no [DONE], no error)"
        except httpx.TimeoutException:
            self.outcome = "hang"
        except httpx.TransportError:
            self.outcome = "connection error"
        self.text = "".join(parts)


class NatsServer:
    def __init__(self, port: int) -> None:
        self.port, self.process = port, None

    def start(self) -> None:
        self.process = subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p",
                                         str(self.port)], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        time.sleep(0.3)

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()


def migrations(base_url: str) -> float:
    try:
        text = httpx.get(base_url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return float("nan")
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("flotilla_request_migrations_total{"))


def startup_phases(log_path: Path) -> dict[str, float]:
    """The restarted process's phases (its last start's ``startup_phase`` lines): phase ->
    seconds since it was started."""
    phases: dict[str, float] = {}
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return phases
    for line in lines:
        if "startup_phase" not in line:
            continue
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        if fields.get("phase") == "imported":
            phases = {}  # a later start: only the last one counts
        if "phase" in fields and "since_start_s" in fields:
            phases.setdefault(fields["phase"], float(fields["since_start_s"]))
    return phases


def first_good_request(base_url: str, model: str, timeout_s: float) -> float | None:
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        try:
            response = httpx.post(base_url + "/v1/completions", timeout=10, json={
                "model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
            if response.status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    return None


def child_pids(pid: int) -> list[int]:
    """The processes ``pid`` started (a tensor-parallel worker's ranks 1.., and spawn's
    resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children
            if b"resource_tracker" not in Path(f"/proc/{child}/cmdline").read_bytes()]


def kill_rank(stack: Stack) -> float:
    """SIGKILL rank 1 of the worker -> seconds until rank 0 exited by itself."""
    worker = stack.processes["worker"]
    ranks = child_pids(worker.pid)
    if not ranks:
        raise SystemExit("--victims worker-rank needs a tensor-parallel worker: pass "
                         "--worker-args \"--tensor-parallel-size 2 ...\"")
    rank_1 = ranks[0]
    killed_at = time.monotonic()
    os.kill(rank_1, signal.SIGKILL)
    try:
        worker.wait(RANK_EXIT_DEADLINE_S)
    except subprocess.TimeoutExpired:
        stack.stop_service("worker", signal.SIGKILL)
        return float("inf")
    return time.monotonic() - killed_at


def run_victim(victim: str, args, model: str, log_dir: Path) -> dict:
    nats = NatsServer(free_port())
    nats.start()
    stack = Stack(StackOptions(model=args.model, host="127.0.0.1", port=free_port(),
                               nats_url=f"nats://127.0.0.1:{nats.port}", log_dir=log_dir / victim,
                               service_args={"worker": args.worker_args.split()},
                               kvstore="--tensor-parallel-size" not in args.worker_args))
    try:
        stack.start(timeout_s=300)
        bodies = [{"model": model, "prompt": PROMPT.format(topic=TOPICS[i % len(TOPICS)]),
                   "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True,
                   "stream": True} for i in range(args.streams)]
        solo = [httpx.post(stack.base_url + "/v1/completions", json={**b, "stream": False},
                           timeout=120).json()["choices"][0]["text"] for b in bodies]
        before = migrations(stack.base_url)
        streams = [Stream(stack.base_url, body, args.deadline) for body in bodies]
        for stream in streams:
            stream.start()
        while not all(s.num_chunks >= 3 or not s.is_alive() for s in streams):
            time.sleep(0.05)
        rank_0_exit_s = None
        if victim == "nats":
            nats.kill()
        elif victim == "worker-rank":
            rank_0_exit_s = kill_rank(stack)
        else:
            stack.stop_service(victim, signal.SIGKILL)
        time.sleep(args.restart_after)
        restarted_at = time.monotonic()
        if victim == "nats":
            nats.start()
        else:
            stack.start_service("worker" if victim == "worker-rank" else victim)
        recovery_s = first_good_request(stack.base_url, model, args.deadline)
        for stream in streams:
            stream.join(max(0.0, args.deadline - (time.monotonic() - restarted_at)))
        outcomes: dict[str, int] = {}
        for stream, expected in zip(streams, solo):
            outcome = stream.outcome
            if outcome == "done":
                outcome = "done, same text" if stream.text == expected else "done, DIFFERENT text"
            outcomes[outcome] = outcomes.get(outcome, 0) + 1
        phases = {} if victim == "nats" else startup_phases(
            log_dir / victim / f"{'worker' if victim == 'worker-rank' else victim}.log")
        return {"victim": victim, "outcomes": outcomes, "rank_0_exit_s": rank_0_exit_s,
                "startup_phases_s": phases,
                "streams_ended_s": round(time.monotonic() - restarted_at, 1),
                "first_good_request_s": None if recovery_s is None else round(recovery_s, 1),
                "migrations": migrations(stack.base_url) - before}
    finally:
        stack.stop()
        if nats.process and nats.process.poll() is None:
            nats.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--restart-after", type=float, default=2.0)
    parser.add_argument("--deadline", type=float, default=120.0,
                        help="a stream or the recovery still waiting after this is a hang")
    parser.add_argument("--victims", default=",".join(VICTIMS),
                        help=f"comma-separated, of {', '.join(VICTIMS)}, worker-rank")
    parser.add_argument("--worker-args", default="--kv-cache-memory 256MiB",
                        help="the worker's flags, e.g. \"--tensor-parallel-size 2\" on GPUs")
    parser.add_argument("--result-json", default=None)
    args = parser.parse_args()
    model = resolve_model(args.model).name
    log_dir = Path(tempfile.mkdtemp(prefix="flotilla-chaos-"))
    results = [run_victim(victim, args, model, log_dir) for victim in args.victims.split(",")]
    print(f"{'killed':<10} {'in-flight streams':<45} {'first good request':>20} {'migrations':>11}")
    for r in results:
        outcomes = ", ".join(f"{n} {what}" for what, n in r["outcomes"].items())
        recovery = "never" if r["first_good_request_s"] is None else f"{r['first_good_request_s']} s"
        print(f"{r['victim']:<10} {outcomes:<45} {recovery:>20} {r['migrations']:>11g}")
        if r["startup_phases_s"]:
            print(f"{'':<10} its start: " + ", ".join(
                f"{phase} {seconds:g} s" for phase, seconds in r["startup_phases_s"].items()))
        if r["rank_0_exit_s"] is not None:
            print(f"{'':<10} rank 0 exited {r['rank_0_exit_s']:.1f} s after rank 1 was killed; "
                  f"streams ended {r['streams_ended_s']} s after the restart")
    print(f"logs: {log_dir}")
    if args.result_json:
        Path(args.result_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
