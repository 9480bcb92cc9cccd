"""The kvstore's control plane on CPU (issue 14): how many requests per second one kvstore
process answers, and how long each waits, with no GPU and no model.

    .venv/bin/python -m benchmarks.kvstore_requests [--prompts 2000] [--concurrency 128]

A real nats-server and a real ``python -m services.kvstore`` (its own process, as served);
this process plays the worker and the scheduler on one NATS connection each (uvloop and
tracing set up as the services do: with the default exporter ``none`` no span is made and
no message carries a ``traceparent``; ``--caller-spans`` records the client's spans, not
exported, so every message carries one, as when the caller exports spans), ``--concurrency``
calls in flight:
  commit  the worker's side: per prompt, reserve 31 slots, then commit the 31-block batch
          (as a request, so it is timed until applied); this fills the host tier;
  lookup  a bare KvLookupRequest of each prompt's 31 blocks (all host hits);
  hit     the scheduler's admission path, ``KvClient.find_hit`` (lookup and pin, in
          however many round trips the client takes), inside a span as the scheduler's
          submit handler runs it; the pins are released (published) 16 at a time, as the
          scheduler releases a step's loads; ``--reps`` passes. A hit the client gives up
          on (past ``--deadline-s``) is counted as a miss.
First, ``core``: the same prompts through ``KvStore`` in this process (no NATS, no
span; as the service's handlers call it): a reservation of 31 slots, the commit of
those 31 blocks (its message decoded), a bare lookup, a pin + its release, and a
pinning lookup + its release; the microseconds each (the kvstore's own
work, beside the cost of a message), and the garbage collector's time meanwhile (all of
it, and its longest full pass: the kvstore's event loop stalls that long).
Each prompt is 512 tokens: 31 full 16-token blocks that a tier may serve (the last
token's block never is). The slots are tiny (the kvstore never touches the bytes on
these paths). Reported per phase: operations/s, latency p50/p99 (ms), and the CPU time of
the kvstore process and of this one per operation (robust to a shared machine, unlike
the rates). Printed, and written as JSON to ``--out`` when given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path


from cli.stack import free_port, nats_server_binary
from services.scheduler import kv_client
from services.scheduler.kv_client import KvClient
from services.scheduler.intake import PrefixQuery
from services.scheduler.tiering import TierSpeeds
from shared.bus import Bus
from shared.messages import Empty
from shared.kv_messages import (
    KvAttachReply, KvAttachRequest, KvCommitRequest, KvLayout, KvLookupReply, KvLookupRequest,
    KvReserveReply, KvReserveRequest, KvStatsReply,
)
from shared.logging import setup_logging
from shared.runtime import run_event_loop
from shared.subjects import Subjects
from shared.tracing import setup_tracing, tracer

BLOCK_SIZE = 16
NUM_BLOCKS = 31  # a 512-token prompt's blocks a tier may serve
RELEASE_BATCH = 16  # pins released together: a step's loads (8,192 tokens / 512)
# 512-byte slots: the kvstore's work per block does not depend on their size
LAYOUT = KvLayout(weights_version="bench", dtype="float16", num_layers=1, block_size=BLOCK_SIZE,
                  num_kv_heads=1, head_dim=8)
ITEMSIZE = 2
SUBJECTS = Subjects()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Prompt:
    def __init__(self, rng: random.Random) -> None:
        self.block_hashes = [rng.randbytes(32) for _ in range(NUM_BLOCKS)]
        self.token_ids = [rng.randrange(200, 40_000) for _ in range(NUM_BLOCKS * BLOCK_SIZE + 1)]

    def commit_columns(self, slot_ids: list[int]) -> dict:
        """A KvCommitRequest's block fields: its blocks in ``slot_ids``."""
        return dict(block_hashes=self.block_hashes[:len(slot_ids)], slot_ids=list(slot_ids),
                    token_ids=self.token_ids[:len(slot_ids) * BLOCK_SIZE], block_size=BLOCK_SIZE)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def percentile(sorted_values: Sequence[float], share: float) -> float:
    return sorted_values[min(len(sorted_values) - 1, int(share * len(sorted_values)))]


async def timed_phase(name: str, items: Sequence, concurrency: int, kvstore_pid: int,
                      call: Callable[[object], Awaitable[None]]) -> dict:
    """Run ``call`` on every item, ``concurrency`` at a time; rate, latency and CPU time."""
    latencies: list[float] = []
    pending = iter(items)

    async def client() -> None:
        for item in pending:
            started = time.perf_counter()
            await call(item)
            latencies.append(time.perf_counter() - started)

    kv_cpu, own_cpu, started = cpu_seconds(kvstore_pid), time.process_time(), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    kv_cpu, own_cpu = cpu_seconds(kvstore_pid) - kv_cpu, time.process_time() - own_cpu
    latencies.sort()
    result = {"phase": name, "num_ops": len(latencies), "seconds": round(elapsed, 3),
              "ops_per_s": round(len(latencies) / elapsed, 1),
              "p50_ms": round(percentile(latencies, 0.50) * 1e3, 2),
              "p99_ms": round(percentile(latencies, 0.99) * 1e3, 2),
              "kvstore_cpu_ms_per_op": round(kv_cpu / len(latencies) * 1e3, 3),
              "client_cpu_ms_per_op": round(own_cpu / len(latencies) * 1e3, 3)}
    print(json.dumps(result), flush=True)
    return result


async def wait_ready(bus: Bus, subject: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await bus.request(subject, Empty(), KvStatsReply, timeout=0.5)
            return
        except Exception:  # noqa: BLE001 - not up yet
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.1)


async def bench(args: argparse.Namespace, nats_url: str, kvstore_pid: int, node_id: str) -> dict:
    setup_logging("bench", level="info")  # as served: the client's debug lines off
    setup_tracing("bench")  # as every service, exporter "none"
    spans = tracer
    if args.caller_spans:  # every message carries a traceparent, which the kvstore passes on
        from opentelemetry.sdk.trace import TracerProvider

        spans = TracerProvider().get_tracer("bench")
    caller_span = spans.start_as_current_span if args.caller_spans \
        else lambda name: contextlib.nullcontext()
    subject = lambda verb: SUBJECTS.kvstore(node_id, verb)  # noqa: E731
    worker = await Bus.connect(nats_url, "bench-worker")
    scheduler = await Bus.connect(nats_url, "bench-scheduler")
    await wait_ready(worker, subject("stats"))
    attached = await worker.request(subject("attach"), KvAttachRequest(
        owner_id="bench-worker", layout=LAYOUT, itemsize=ITEMSIZE), KvAttachReply)
    namespace, store_id = attached.namespace, attached.store_id
    rng = random.Random(args.seed)
    prompts = [Prompt(rng) for _ in range(args.prompts)]

    async def commit(prompt: Prompt) -> None:
        with caller_span("reserve"):
            reserved = await worker.request(subject("reserve"), KvReserveRequest(
                namespace=namespace, owner_id="bench-worker", num_slots=NUM_BLOCKS),
                KvReserveReply)
        assert len(reserved.slot_ids) == NUM_BLOCKS, "the host tier is too small"
        with caller_span("commit"):
            await worker.request(subject("commit"), KvCommitRequest(
                namespace=namespace, owner_id="bench-worker", store_id=store_id,
                **prompt.commit_columns(reserved.slot_ids)), Empty)

    async def lookup(prompt: Prompt) -> None:
        with caller_span("lookup"):
            reply = await scheduler.request(subject("lookup"), KvLookupRequest(
                namespace=namespace, block_hashes=prompt.block_hashes), KvLookupReply)
        assert len(reply.tiers) == NUM_BLOCKS

    client = KvClient(scheduler, SUBJECTS, owner_id="bench-scheduler", node_id=node_id,
                      namespace=namespace, block_bytes=1 << 21, block_size=BLOCK_SIZE,
                      speeds=TierSpeeds())

    misses: list[Prompt] = []
    to_release: list[str] = []

    async def hit(prompt: Prompt) -> None:
        with spans.start_as_current_span("submit"):
            found = await client.find_hit(PrefixQuery(prompt.block_hashes, 0), prompt.token_ids)
        if found is None:  # past the client's deadline (LOOKUP_TIMEOUT_S): a miss
            misses.append(prompt)
            return
        assert len(found.slot_ids) == NUM_BLOCKS, found
        to_release.append(found.pin_id)
        if len(to_release) >= RELEASE_BATCH:  # the scheduler releases a step's loads at once
            pin_ids = to_release[:]
            to_release.clear()
            await client.release(pin_ids)

    results = [await timed_phase("commit", prompts, args.concurrency, kvstore_pid, commit),
               await timed_phase("lookup", prompts, args.concurrency, kvstore_pid, lookup)]
    for _ in range(args.reps):
        misses.clear()
        results.append(await timed_phase("hit", prompts, args.concurrency, kvstore_pid, hit))
        results[-1]["num_misses"] = len(misses)
        await client.release(to_release[:])
        to_release.clear()
        print(json.dumps({"num_misses": len(misses)}), flush=True)
    await worker.close()
    await scheduler.close()
    hits = [r for r in results if r["phase"] == "hit"]
    summary = {key: statistics.median(r[key] for r in hits)
               for key in ("ops_per_s", "p50_ms", "p99_ms", "kvstore_cpu_ms_per_op",
                           "client_cpu_ms_per_op")}
    print(json.dumps({"hit_median_of_passes": summary}), flush=True)
    return {"hit_median_of_passes": summary, "prompts": args.prompts, "blocks_per_prompt": NUM_BLOCKS,
            "concurrency": args.concurrency, "results": results}


class GcPauses:
    """The garbage collector's passes while it is installed: total and longest full pass."""

    def __init__(self) -> None:
        self.total_s = self.max_full_s = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        took = time.perf_counter() - self._started
        self.total_s += took
        if info["generation"] == 2:
            self.max_full_s = max(self.max_full_s, took)


def core_phases(prompts: Sequence[Prompt], work: Path) -> list[dict]:
    """Microseconds per call of the kvstore's synchronous core, without NATS, and the time
    the garbage collector took meanwhile (what this process built beforehand is frozen,
    so the collector walks what the kvstore keeps and makes, as in its own process)."""
    from services.kvstore.store import KvStore, Namespace, slot_nbytes_of
    from shared.kv_arena import KvArena
    from shared.messages import decode, encode
    from shared.kv_messages import KvPinRequest

    slot_nbytes = slot_nbytes_of(LAYOUT, ITEMSIZE)
    num_slots = 2 * (len(prompts) + 1) * NUM_BLOCKS
    store = KvStore("core", "core", disk=None, owner_timeout_s=3600.0, max_pinned_fraction=0.5,
                    max_reserved_fraction=0.5)
    arena = KvArena.create(work / "core-arena", num_slots, slot_nbytes, "core")
    namespace = LAYOUT.namespace
    store.add_namespace(Namespace(namespace, slot_nbytes, arena, store.new_host_tier(num_slots)))
    reserved: list[list[int]] = []
    commits: list[bytes] = []

    def reserve(_: Prompt, __: int) -> None:
        reserved.append(store.reserve(namespace, "w", NUM_BLOCKS, 0.0))

    def encode_commits() -> None:
        for prompt, slot_ids in zip(prompts, reserved):
            commits.append(encode(KvCommitRequest(
                namespace=namespace, owner_id="w", store_id="core",
                **prompt.commit_columns(slot_ids))))

    def commit(_: Prompt, index: int) -> None:  # decoded as the service does
        store.commit(decode(commits[index], KvCommitRequest), 0.0)

    def lookup(prompt: Prompt, _: int) -> None:
        store.lookup(KvLookupRequest(namespace=namespace, block_hashes=prompt.block_hashes))

    def pin(prompt: Prompt, index: int) -> None:
        plan = store.begin_pin(KvPinRequest(namespace=namespace, owner_id="s", pin_id=str(index),
                                            block_hashes=prompt.block_hashes), 0.0)
        store.finish_pin(plan, [])
        store.release(namespace, "s", [str(index)], 0.0)

    def pinning_lookup(prompt: Prompt, index: int) -> None:
        store.lookup(KvLookupRequest(namespace=namespace, block_hashes=prompt.block_hashes,
                                     owner_id="s", pin_id=f"l{index}"), 0.0)
        store.release(namespace, "s", [f"l{index}"], 0.0)

    phases = [("reserve", reserve), ("commit", commit), ("lookup", lookup), ("pin_release", pin),
              ("pinning_lookup_release", pinning_lookup)]
    results = []
    for name, call in phases:
        if name == "commit":
            encode_commits()
        gc.collect()
        gc.freeze()
        pauses = GcPauses()
        gc.callbacks.append(pauses)
        elapsed = 0.0
        for index, prompt in enumerate(prompts):
            started = time.perf_counter()
            call(prompt, index)
            elapsed += time.perf_counter() - started
        gc.callbacks.remove(pauses)
        gc.unfreeze()
        results.append({"phase": f"core_{name}", "num_ops": len(prompts),
                        "us_per_op": round(elapsed / len(prompts) * 1e6, 1),
                        "gc_s": round(pauses.total_s, 3),
                        "longest_full_gc_ms": round(pauses.max_full_s * 1e3, 1)})
        print(json.dumps(results[-1]), flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=128)
    parser.add_argument("--reps", type=int, default=3, help="passes of the hit phase")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="", help="write the result as JSON here")
    parser.add_argument("--deadline-s", type=float, default=1.0,
                        help="the scheduler client's deadlines for a lookup and a pin (as "
                        "served: 0.05 and 0.2 s); past one a hit is a miss, and after three "
                        "in a row the client leaves the kvstore alone for 2 s")
    parser.add_argument("--caller-spans", action="store_true",
                        help="record this process's spans (not exported): every message then "
                        "carries a traceparent")
    parser.add_argument("--profile", default="", help="run the kvstore under cProfile, "
                        "its stats written to this file")
    args = parser.parse_args()
    kv_client.LOOKUP_TIMEOUT_S = kv_client.HOST_PIN_TIMEOUT_S = args.deadline_s
    work = Path(tempfile.mkdtemp(prefix="kvstore-requests-"))
    core = core_phases([Prompt(random.Random(f"core-{args.seed}-{i}")) for i in range(args.prompts)],
                       work)
    port, node_id = free_port(), f"bench-{uuid.uuid4().hex[:8]}"
    nats_url = f"nats://127.0.0.1:{port}"
    slot_nbytes = 2 * BLOCK_SIZE * 8 * ITEMSIZE
    # room for every prompt, plus reservations and pins in flight (each capped at half)
    host_memory = 2 * (args.prompts + 2 * args.concurrency) * NUM_BLOCKS * slot_nbytes
    processes = [subprocess.Popen([nats_server_binary(), "-a", "127.0.0.1", "-p", str(port)],
                                  stdout=open(work / "nats.log", "w"), stderr=subprocess.STDOUT)]
    try:
        processes.append(subprocess.Popen(
            [sys.executable, *(["-m", "cProfile", "-o", args.profile] if args.profile else []),
             "-m", "services.kvstore", "--nats-url", nats_url, "--node-id", node_id,
             "--kv-shm-dir", str(work), "--kv-host-memory", str(host_memory)],
            stdout=open(work / "kvstore.log", "w"), stderr=subprocess.STDOUT,
            cwd=Path(__file__).resolve().parents[1]))
        result = {"command": " ".join(sys.argv), "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "caller_spans": args.caller_spans,
                  "load_average": os.getloadavg(), "core": core}
        run_event_loop(_run(result, args, nats_url, processes[1].pid, node_id))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=10)


async def _run(result: dict, args, nats_url: str, kvstore_pid: int, node_id: str) -> None:
    result.update(await bench(args, nats_url, kvstore_pid, node_id))


if __name__ == "__main__":
    main()
