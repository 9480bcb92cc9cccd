"""Issue 14's acceptance figures for the tiered KV store, through the full stack
(gateway -> NATS -> scheduler -> worker, with the kvstore process).

CPU (default model, fp32; the worker's KV cache is small, so other traffic evicts a prefix):

    .venv/bin/python -m benchmarks.kvstore_tiers [--reps 5] [--prefix-len 1000]

One stack (kvstore with a host tier and a disk tier), several repetitions, medians. Each
prefix P_i is a fresh ~1,000-token token-id prompt; TTFT is measured streaming, greedy,
EOS ignored, ``--max-tokens`` tokens:
  a. recompute: P_i sent the first time (cached nowhere: it is new);
  b. host: other traffic evicts P_i from the worker's cache, then P_i again (its blocks
     load from the host tier, where they were stored write-through);
  c. disk: the kvstore is restarted (SIGTERM: it finishes its disk writes; the new one
     has an empty host tier and rebuilds its index from the disk files), the files are
     dropped from the page cache (posix_fadvise), other traffic evicts what the worker
     still holds, then each P_i again: only the disk holds it;
  d. worker restart: the worker gets SIGKILL and is started again (the kvstore lives
     on), then each P_i again: the share of its full blocks that hit (``cached_tokens``).
Ratios are host/recompute (target <= 0.20) and disk/recompute (<= 0.50) of the medians;
restart hit share >= 0.90. Every cached run's text is compared with P_i's uncached run.
The tier each hit came from is read from the scheduler's stats events
(``num_kv_tier_hits_by_tier``), per request.

GPU (``--device cuda``; each part fits one 10-minute device call):

    python3 -m benchmarks.kvstore_tiers --device cuda --model .devmodels/dummy-llama-3.1-8b \
        --parts prefix16k|offload|prefill512

  prefix16k  a 16k-token prefix evicted from the GPU cache (a small --kv-cache-memory and
             other 16k prompts): host-tier TTFT vs recompute (target <= 0.10).
  offload    benchmark c (1,000 x 1,024 in / 128 out, token ids, non-streaming, all at once)
             with prefix caching on and unique prompts, kvstore on (it stores every full
             block, hits nothing) vs --no-kvstore: the throughput cost (target <= 2%).
  prefill512 N unique 512-token prompts, max_tokens 1, in chunks that fit the host tier:
             each chunk sent once (0% hits: nothing cached anywhere; its blocks are stored),
             then again in the same order (the small GPU cache has evicted them: 100% host
             hits); throughput of the second passes vs the first (target >= 5x).

The result is printed and written as JSON under $OUT (default /tmp/out).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import os
import random
import shlex
import shutil
import signal
import statistics
import tempfile
import time
from pathlib import Path

import httpx


from cli.stack import Stack, StackOptions, flags, free_port
from shared.messages import Empty, HealthReply, decode, encode
from shared.scheduler_stats import SchedulerStats
from shared.kv_messages import KvStatsReply
from shared.models import resolve_model
from shared.subjects import Subjects

BLOCK_SIZE = 16
OUT = Path(os.environ.get("OUT", "/tmp/out"))


def prompt_ids(seed: int, length: int) -> list[int]:
    """Seeded random token ids in the ordinary vocabulary range: unique per seed."""
    rng = random.Random(seed)
    return [rng.randrange(200, 40_000) for _ in range(length)]


def hittable_tokens(prompt_len: int) -> int:
    """Tokens in the full blocks a tier may serve: never the block of the last token."""
    return (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


# ------------------------------------------------------------------ the bus side
class Probe:
    """A NATS client beside the stack: the schedulers' stats events (tier hits by tier),
    the kvstore's stats, the worker's health."""

    def __init__(self, nats_url: str, node_id: str = "local") -> None:
        self.nats_url, self.node_id, self.subjects = nats_url, node_id, Subjects()
        self.latest: SchedulerStats | None = None
        self.nc = None

    async def start(self) -> None:
        import nats

        self.nc = await nats.connect(self.nats_url)

        async def on_stats(msg) -> None:
            self.latest = decode(msg.data, SchedulerStats)

        await self.nc.subscribe(self.subjects.scheduler_stats, cb=on_stats)

    async def close(self) -> None:
        if self.nc is not None:
            await self.nc.close()

    async def fresh_stats(self, timeout_s: float = 5.0) -> SchedulerStats | None:
        """The first stats event stamped after this call (they come every 0.5 s)."""
        since, deadline = time.time(), time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.latest is not None and self.latest.timestamp > since:
                return self.latest
            await asyncio.sleep(0.05)
        return self.latest

    async def request(self, subject: str, reply_type: type, timeout_s: float = 2.0):
        try:
            msg = await self.nc.request(subject, encode(Empty()), timeout=timeout_s)
            return decode(msg.data, reply_type)
        except Exception as exc:  # noqa: BLE001 - absent or restarting: the caller retries
            return exc

    async def kv_stats(self) -> dict:
        reply = await self.request(self.subjects.kvstore(self.node_id, "stats"), KvStatsReply)
        if not isinstance(reply, KvStatsReply):
            return {"error": repr(reply)}
        return {"store_id": reply.store_id,
                "tiers": [{"tier": t.tier, "blocks": t.num_blocks, "bytes": t.num_bytes,
                           "capacity_bytes": t.capacity_bytes} for t in reply.tiers]}

    async def worker_health(self, replica_id: str = "0") -> dict:
        reply = await self.request(self.subjects.worker_ping(replica_id), HealthReply)
        return dict(reply.detail) if isinstance(reply, HealthReply) else {"error": repr(reply)}

    async def wait_worker_attached(self, timeout_s: float = 120.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            health = await self.worker_health()
            if health.get("kv_attached"):
                return health
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the worker did not attach to the kvstore: {health}")


def tier_delta(before: SchedulerStats | None, after: SchedulerStats | None) -> dict[str, int]:
    """Tier hits between two stats events (the counters start over when the scheduler
    re-attaches a worker)."""
    if after is None:
        return {}
    was = before.engine.num_kv_tier_hits_by_tier if before is not None else {}
    now = after.engine.num_kv_tier_hits_by_tier
    reset = before is not None and after.engine.num_kv_tier_hits < before.engine.num_kv_tier_hits
    return {tier: n - (0 if reset else was.get(tier, 0)) for tier, n in now.items()
            if n - (0 if reset else was.get(tier, 0))}


# ------------------------------------------------------------------ requests
async def stream_one(client: httpx.AsyncClient, model: str, prompt: list[int],
                     max_tokens: int) -> dict:
    """One streaming completion: TTFT (first chunk with a choice), text, usage, and wall
    clock stamps (sent, response headers: the submit was answered, first token) to set
    against the services' logs."""
    # encoded before the clock starts: a 16k-id body takes the client ~1.5 ms to encode,
    # which is no part of the server's time to first token
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    sent_at, started = time.time(), time.perf_counter()
    first, first_at, parts, usage = None, None, [], None
    async with client.stream("POST", "/v1/completions", content=body,
                             headers={"content-type": "application/json"}) as response:
        headers_at = time.time()
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:500]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            payload = json.loads(line[6:])
            if "error" in payload:
                raise RuntimeError(f"error event: {payload['error']}")
            if payload.get("choices"):
                if first is None:
                    first, first_at = time.perf_counter(), time.time()
                parts.append(payload["choices"][0]["text"])
            if payload.get("usage"):
                usage = payload["usage"]
    if first is None or usage is None:
        raise RuntimeError(f"stream ended without a token or usage ({len(parts)} chunks)")
    return {"ttft_s": first - started, "latency_s": time.perf_counter() - started,
            "text": "".join(parts), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "sent_at": sent_at, "headers_at": headers_at, "first_token_at": first_at}


class Clients:
    """Several httpx clients taken in turn (one client's pool bottlenecks at 1,000
    connections: cli.bench.client.ClientPool)."""

    def __init__(self, base_url: str, num: int = 32, max_in_flight: int = 0) -> None:
        self.limit = asyncio.Semaphore(max_in_flight) if max_in_flight else None
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        self.clients = [httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits)
                        for _ in range(num)]
        self.turn = itertools.cycle(self.clients)

    async def complete(self, model: str, prompt: list[int], max_tokens: int) -> dict:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True}
        if self.limit is None:
            response = await next(self.turn).post("/v1/completions", json=body)
        else:
            async with self.limit:
                response = await next(self.turn).post("/v1/completions", json=body)
        response.raise_for_status()
        return response.json()["usage"]

    async def all_at_once(self, model: str, prompts: list[list[int]], max_tokens: int) -> dict:
        started = time.perf_counter()
        usages = await asyncio.gather(*(self.complete(model, p, max_tokens) for p in prompts))
        elapsed = time.perf_counter() - started
        num_in = sum(u["prompt_tokens"] for u in usages)
        num_out = sum(u["completion_tokens"] for u in usages)
        cached = sum((u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                     for u in usages)
        return {"elapsed_s": elapsed, "num_requests": len(prompts), "input_tokens": num_in,
                "cached_tokens": cached, "request_s": len(prompts) / elapsed,
                "output_tokens": num_out,
                "prefill_tok_s": num_in / elapsed, "total_tok_s": (num_in + num_out) / elapsed}

    async def aclose(self) -> None:
        await asyncio.gather(*(c.aclose() for c in self.clients))


def start_stack(model: str, log_dir: Path, kvstore: bool, worker: list[str],
                scheduler: list[str], kv: list[str], timeout_s: float = 600) -> Stack:
    stack = Stack(StackOptions(model=model, host="127.0.0.1", port=free_port(), log_dir=log_dir,
                               kvstore=kvstore, service_args={"worker": worker,
                                                              "scheduler": scheduler,
                                                              "kvstore": kv}))
    stack.start(timeout_s=timeout_s)
    return stack


def drop_page_cache(directory: Path) -> int:
    """Written back and dropped from the page cache, so a disk hit reads the disk."""
    os.sync()
    num = 0
    for path in directory.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                num += 1
            finally:
                os.close(fd)
    return num


# ------------------------------------------------------------------ CPU
class CpuRun:
    def __init__(self, args, stack: Stack, probe: Probe, model: str) -> None:
        self.args, self.stack, self.probe, self.model = args, stack, probe, model
        self.client = httpx.AsyncClient(base_url=stack.base_url, timeout=900)
        self.seed = itertools.count(1000)
        self.num_fillers = 2

    async def send(self, prompt: list[int], max_tokens: int | None = None) -> dict:
        """One request, with the tier hits it caused (stats events before and after)."""
        before = await self.probe.fresh_stats()
        result = await stream_one(self.client, self.model, prompt,
                                  max_tokens or self.args.max_tokens)
        result["tier_hits"] = tier_delta(before, await self.probe.fresh_stats())
        result["hit_share"] = result["cached_tokens"] / hittable_tokens(len(prompt))
        return result

    async def evict(self) -> None:
        """Fresh prompts, enough blocks to push everything else out of the worker's cache."""
        for _ in range(self.num_fillers):
            await stream_one(self.client, self.model,
                             prompt_ids(next(self.seed), self.args.prefix_len), 1)

    async def control(self) -> float:
        """TTFT of a fresh prefix (cached nowhere): a recompute next to a cached run."""
        result = await stream_one(self.client, self.model,
                                  prompt_ids(next(self.seed), self.args.prefix_len),
                                  self.args.max_tokens)
        return result["ttft_s"]

    def say(self, phase: str, i: int, r: dict) -> None:
        print(f"[{phase}] P{i}: TTFT {r['ttft_s'] * 1000:7.0f} ms, cached {r['cached_tokens']:4d}"
              f"/{r['prompt_tokens']}, tiers {r['tier_hits']}", flush=True)

    async def run(self) -> dict:
        a = self.args
        stats = await self.probe.fresh_stats()
        num_blocks = stats.engine.num_blocks_total if stats else 0
        blocks_per_prompt = -(-(a.prefix_len + 1) // BLOCK_SIZE)
        self.num_fillers = max(2, -(-num_blocks // blocks_per_prompt))
        print(f"worker cache: {num_blocks} blocks ({num_blocks * BLOCK_SIZE} tokens); "
              f"{self.num_fillers} filler prompts evict a prefix", flush=True)
        await stream_one(self.client, self.model, prompt_ids(999, 16), 2)  # warm-up
        prefixes = {i: prompt_ids(i, a.prefix_len) for i in range(a.reps + 1)}  # P0: warm-up
        runs: dict[str, dict[int, dict]] = {"recompute": {}, "host": {}, "disk": {},
                                            "restart": {}}
        # disk and restart: a fresh prefix computed just before each cached run, so each
        # ratio compares two requests seconds apart (the 2 cores are shared)
        controls: dict[str, dict[int, float]] = {"disk": {}, "restart": {}}
        for i, prefix in prefixes.items():  # a and b, back to back per prefix
            runs["recompute"][i] = await self.send(prefix)
            self.say("recompute", i, runs["recompute"][i])
            await self.evict()
            runs["host"][i] = await self.send(prefix)
            self.say("host", i, runs["host"][i])
        kv_before_restart = await self.probe.kv_stats()
        # c: a new kvstore on the same disk dir holds the blocks on disk only
        self.stack.stop_service("kvstore", signal.SIGTERM, timeout_s=60)
        disk_dir = Path(a.kv_disk_dir)
        num_files = drop_page_cache(disk_dir) if a.drop_page_cache else None
        self.stack.start_service("kvstore")
        kv_after_restart = await self._wait_kvstore()
        await self.probe.wait_worker_attached()
        await self.evict()
        for i, prefix in prefixes.items():
            controls["disk"][i] = await self.control()
            runs["disk"][i] = await self.send(prefix)
            self.say("disk", i, runs["disk"][i])
        # d: the worker killed and started again; the kvstore keeps the blocks
        self.stack.stop_service("worker", signal.SIGKILL)
        killed_at = time.monotonic()
        self.stack.start_service("worker")
        self.stack.wait_ready(300)
        await self.probe.wait_worker_attached()
        ready_s = time.monotonic() - killed_at
        # the scheduler may learn of the new worker only from a step it fails (the request
        # then migrates): let that happen to a short request, not to a measured one
        await stream_one(self.client, self.model, prompt_ids(998, 16), 2)
        for i, prefix in prefixes.items():
            controls["restart"][i] = await self.control()
            runs["restart"][i] = await self.send(prefix)
            self.say("restart", i, runs["restart"][i])
        await self.client.aclose()
        controls["host"] = {i: r["ttft_s"] for i, r in runs["recompute"].items()}
        return self.summary(runs, prefixes, controls, {
            "worker_cache_blocks": num_blocks, "num_fillers": self.num_fillers,
            "kvstore_before_restart": kv_before_restart, "kvstore_after_restart": kv_after_restart,
            "disk_files_dropped_from_page_cache": num_files, "worker_restart_ready_s": ready_s})

    async def _wait_kvstore(self, timeout_s: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = await self.probe.kv_stats()
            if "store_id" in stats:
                return stats
            await asyncio.sleep(0.5)
        raise TimeoutError(f"the restarted kvstore did not answer: {stats}")

    def summary(self, runs: dict, prefixes: dict, controls: dict, extra: dict) -> dict:
        measured = [i for i in prefixes if i > 0]  # P0 warmed every path up
        ttft = {phase: median([runs[phase][i]["ttft_s"] for i in measured]) for phase in runs}
        same = {phase: sum(runs[phase][i]["text"] == runs["recompute"][i]["text"]
                           for i in prefixes) for phase in ("host", "disk", "restart")}
        # the cached runs' hits all came from the tiers, none from the worker's cache
        from_tiers = {phase: sum(sum(runs[phase][i]["tier_hits"].values())
                                 == runs[phase][i]["cached_tokens"] for i in prefixes)
                      for phase in ("host", "disk", "restart")}
        restart_share = median([runs["restart"][i]["hit_share"] for i in measured])
        tiers = {phase: {i: runs[phase][i]["tier_hits"] for i in prefixes} for phase in runs}
        recompute = ttft["recompute"]
        # each cached run over the recompute just before it (host: its own prefix's first
        # run, a few seconds earlier; disk, restart: a fresh prefix right before it)
        pairs = {phase: median([runs[phase][i]["ttft_s"] / controls[phase][i] for i in measured])
                 for phase in ("host", "disk", "restart")}
        result = {
            "ttft_median_s": ttft,
            "recompute_next_to_each_median_s": {p: median([c[i] for i in measured])
                                                for p, c in controls.items()},
            "recompute_next_to_each_s": controls,
            # headline: the median of the back-to-back ratios
            "host_over_recompute": pairs["host"], "target_host": 0.20,
            "disk_over_recompute": pairs["disk"], "target_disk": 0.50,
            "ratio_of_medians": {p: ttft[p] / recompute for p in ("host", "disk", "restart")},
            "restart_hit_share": restart_share, "target_restart": 0.90,
            "median_of_pair_ratios": pairs,
            "cached_all_from_tiers": {p: f"{n}/{len(prefixes)}" for p, n in from_tiers.items()},
            "outputs_identical": {phase: f"{n}/{len(prefixes)}" for phase, n in same.items()},
            "all_outputs_identical": all(n == len(prefixes) for n in same.values()),
            "tier_hits_tokens": tiers,
            "runs": {phase: {i: {k: v for k, v in r.items()} for i, r in per.items()}
                     for phase, per in runs.items()},
            **extra}
        return result


async def cpu_main(args, model_name: str) -> dict:
    args.kv_disk_dir = args.kv_disk_dir or tempfile.mkdtemp(prefix="flotilla-kvdisk-")
    log_dir = Path(tempfile.mkdtemp(prefix="flotilla-kvtiers-"))
    print(f"logs: {log_dir}; disk tier: {args.kv_disk_dir}", flush=True)
    stack = start_stack(args.model, log_dir, True,
                        worker=flags(kv_cache_memory=args.kv_cache_memory) + args.worker_args,
                        scheduler=list(args.scheduler_args),
                        kv=flags(kv_host_memory=args.kv_host_memory, kv_disk_dir=args.kv_disk_dir,
                                 kv_disk_size=args.kv_disk_size))
    probe = Probe(stack.nats_url)
    try:
        await probe.start()
        await probe.wait_worker_attached()
        result = await CpuRun(args, stack, probe, model_name).run()
    finally:
        await probe.close()
        stack.stop()
        if not args.keep_disk_dir:
            shutil.rmtree(args.kv_disk_dir, ignore_errors=True)
    return {"benchmark": "kvstore_tiers", "mode": "cpu", "model": args.model,
            "prefix_len": args.prefix_len, "max_tokens": args.max_tokens, "reps": args.reps,
            "kv_cache_memory": args.kv_cache_memory, "kv_host_memory": args.kv_host_memory,
            "logs": str(log_dir), **result}


# ------------------------------------------------------------------ GPU
def gpu_worker_flags(args, kv_cache_memory: str | None, max_model_len: int) -> list[str]:
    """The parts' worker: bf16 on CUDA (fp32 on CPU, where the parts run only as a smoke test)."""
    on_gpu = args.device == "cuda"
    return flags(device=args.device, dtype="bfloat16" if on_gpu else None, max_model_len=max_model_len,
                 max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                 kv_cache_memory=kv_cache_memory) + list(args.worker_args)


def gpu_scheduler_flags(args) -> list[str]:
    return flags(max_num_seqs=args.max_num_seqs,
                 max_num_batched_tokens=args.max_num_batched_tokens) + list(args.scheduler_args)


def kv_token_bytes(model: str, dtype_bytes: int = 2) -> int:
    config = json.loads((resolve_model(model).path / "config.json").read_text())
    heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * heads * head_dim * dtype_bytes


async def part_prefix16k(args, model_name: str, log_dir: Path) -> dict:
    """16k-token prefix: recompute vs loaded from the host tier after eviction from the
    GPU cache by other 16k prompts."""
    length = args.long_prefix_len
    stack = start_stack(args.model, log_dir / "prefix16k", True,
                        gpu_worker_flags(args, args.gpu_kv_cache_memory, length + 1024),
                        gpu_scheduler_flags(args), flags(kv_host_memory=args.gpu_kv_host_memory, kv_shm_dir=args.kv_shm_dir))
    probe = Probe(stack.nats_url)
    try:
        await probe.start()
        await probe.wait_worker_attached()
        num_blocks = (await probe.fresh_stats()).num_blocks_total
        num_fillers = -(-num_blocks // -(-(length + 1) // BLOCK_SIZE)) + 1
        runs = {"recompute": [], "host": []}
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=900) as client:
            for seed in range(2):  # warm-up: compiles the long-context variants
                await stream_one(client, model_name, prompt_ids(90_000 + seed, length), 1)
            seeds = itertools.count(100_000)
            for i in range(args.reps + 1):  # rep 0: warm-up of the load path
                prefix = prompt_ids(i, length)
                cold = await stream_one(client, model_name, prefix, args.max_tokens)
                # the same prompt at once: a GPU-cache hit computes the same last chunk as a
                # tier hit, so a tier hit must give its text exactly (bf16 recompute need
                # not: it sums the prefix in other chunks)
                gpu_hit = await stream_one(client, model_name, prefix, args.max_tokens)
                for _ in range(num_fillers):
                    await stream_one(client, model_name, prompt_ids(next(seeds), length), 1)
                before = await probe.fresh_stats()
                warm = await stream_one(client, model_name, prefix, args.max_tokens)
                warm["tier_hits"] = tier_delta(before, await probe.fresh_stats())
                warm["same_text"] = warm["text"] == cold["text"]
                warm["same_text_as_gpu_hit"] = warm["text"] == gpu_hit["text"]
                print(f"[prefix16k] P{i}: recompute {cold['ttft_s'] * 1000:.0f} ms, host "
                      f"{warm['ttft_s'] * 1000:.0f} ms, cached {warm['cached_tokens']} (GPU hit "
                      f"{gpu_hit['cached_tokens']}), tiers {warm['tier_hits']}, same text as "
                      f"recompute {warm['same_text']}, as the GPU hit "
                      f"{warm['same_text_as_gpu_hit']}", flush=True)
                if i > 0:
                    runs["recompute"].append(cold)
                    runs["host"].append(warm)
        recompute = median([r["ttft_s"] for r in runs["recompute"]])
        host = median([r["ttft_s"] for r in runs["host"]])
        return {"prefix_len": length, "gpu_cache_blocks": num_blocks, "num_fillers": num_fillers,
                "ttft_recompute_s": recompute, "ttft_host_s": host,
                "host_over_recompute": host / recompute, "target": 0.10,
                "outputs_identical": all(r["same_text"] for r in runs["host"]),
                "outputs_identical_to_gpu_hit": all(r["same_text_as_gpu_hit"]
                                                    for r in runs["host"]),
                "hit_share": median([r["cached_tokens"] / hittable_tokens(length)
                                     for r in runs["host"]]), "runs": runs,
                "kvstore": await probe.kv_stats()}
    finally:
        await probe.close()
        stack.stop()


async def part_offload(args, model_name: str, log_dir: Path) -> dict:
    """Benchmark c with prefix caching on and unique prompts: kvstore on (stores every
    full block, hits nothing) vs --no-kvstore, one stack after the other; in each,
    ``--offload-reps`` timed batches of new prompts (rep 0: offline_throughput.py's fixed
    workload), all at once, non-streaming, EOS ignored."""
    def workload(rep: int) -> list[list[int]]:
        rng = random.Random(rep)
        return [[rng.randrange(100, 40_000) for _ in range(args.offload_input_len)]
                for _ in range(args.num_prompts)]

    results = {}
    for kvstore in args.offload_order.split(","):
        on = kvstore == "on"
        stack = start_stack(args.model, log_dir / f"offload-{kvstore}", on,
                            gpu_worker_flags(args, None, 4096), gpu_scheduler_flags(args),
                            flags(kv_host_memory=args.gpu_kv_host_memory, kv_shm_dir=args.kv_shm_dir))
        clients = Clients(stack.base_url)
        runs = []
        try:
            # warm-up over varied shapes (as benchmark f): Triton compiles before the clock
            warm_rng = random.Random(10_000)
            await asyncio.gather(*(clients.complete(model_name, [
                warm_rng.randrange(100, 40_000) for _ in range(warm_rng.randint(1, 2048))],
                args.offload_output_len) for _ in range(args.offload_warmup)))
            for rep in range(args.offload_reps):
                runs.append(await clients.all_at_once(model_name, workload(rep),
                                                      args.offload_output_len))
                print(f"[offload] kvstore {kvstore}, rep {rep}: {runs[-1]['total_tok_s']:,.0f} "
                      f"total tok/s, {runs[-1]['cached_tokens']} cached tokens", flush=True)
            extra = {}
            if on:
                probe = Probe(stack.nats_url)
                await probe.start()
                extra = {"kvstore": await probe.kv_stats(), "worker": await probe.worker_health()}
                await probe.close()
        finally:
            await clients.aclose()
            stack.stop()
        results[kvstore] = {"total_tok_s": median([r["total_tok_s"] for r in runs]),
                            "runs": runs, **extra}
    cost = 1 - results["on"]["total_tok_s"] / results["off"]["total_tok_s"]
    return {"num_prompts": args.num_prompts, "input_len": args.offload_input_len,
            "output_len": args.offload_output_len, "reps": args.offload_reps, "cost": cost,
            "target": 0.02, **results}


async def part_prefill512(args, model_name: str, log_dir: Path) -> dict:
    """N unique 512-token prefills: each chunk once (0% hits), then again (100% host)."""
    length = args.prefill_len
    token_bytes = kv_token_bytes(args.model, 2 if args.device == "cuda" else 4)
    shm = shutil.disk_usage(args.kv_shm_dir or "/dev/shm").free
    host_bytes = min(parse_bytes(args.gpu_kv_host_memory), int(shm * 0.85))
    # a chunk's lookups may pin all of it at once: pins take at most half of the slots
    chunk = min(args.chunk, int(host_bytes * 0.4 // (token_bytes * length)))
    print(f"[prefill512] KV {token_bytes} B/token; host tier {host_bytes / 2**30:.1f} GiB "
          f"(/dev/shm free {shm / 2**30:.1f} GiB): chunks of {chunk} prompts", flush=True)
    stack = start_stack(args.model, log_dir / "prefill512", True,
                        gpu_worker_flags(args, args.prefill_kv_cache_memory, 4096),
                        gpu_scheduler_flags(args), flags(kv_host_memory=f"{host_bytes}", kv_shm_dir=args.kv_shm_dir))
    clients = Clients(stack.base_url, max_in_flight=args.prefill_in_flight)
    probe = Probe(stack.nats_url)
    passes = {"miss": [], "hit": []}
    try:
        await probe.start()
        await probe.wait_worker_attached()
        warm = [prompt_ids(900_000 + i, length) for i in range(min(chunk, 256))]
        await clients.all_at_once(model_name, warm, 1)  # warm-up: both paths compile
        await clients.all_at_once(model_name, warm, 1)
        started = time.monotonic()
        for first in range(0, args.num_prefills, chunk):
            prompts = [prompt_ids(first + i, length) for i in range(min(chunk, args.num_prefills - first))]
            passes["miss"].append(await clients.all_at_once(model_name, prompts, 1))
            passes["hit"].append(await clients.all_at_once(model_name, prompts, 1))
            m, h = passes["miss"][-1], passes["hit"][-1]
            print(f"[prefill512] {first + len(prompts)}: miss {m['request_s']:.0f} req/s, hit "
                  f"{h['request_s']:.0f} req/s ({h['cached_tokens'] / len(prompts):.0f} cached/req)"
                  f", {time.monotonic() - started:.0f} s", flush=True)
            if time.monotonic() - started > args.time_budget_s:
                print("[prefill512] time budget spent: stopping early", flush=True)
                break
        kv = await probe.kv_stats()
    finally:
        await probe.close()
        await clients.aclose()
        stack.stop()
    total = {name: {"num_requests": sum(p["num_requests"] for p in runs),
                    "elapsed_s": sum(p["elapsed_s"] for p in runs),
                    "cached_tokens": sum(p["cached_tokens"] for p in runs)}
             for name, runs in passes.items()}
    for t in total.values():
        t["request_s"] = t["num_requests"] / t["elapsed_s"]
    hit_share = total["hit"]["cached_tokens"] / (total["hit"]["num_requests"] * hittable_tokens(length))
    return {"num_prefills": total["miss"]["num_requests"], "prefill_len": length, "chunk": chunk,
            "host_tier_bytes": host_bytes, "speedup": total["hit"]["request_s"] / total["miss"]["request_s"],
            "target": 5.0, "hit_pass_hit_share": hit_share, "miss": total["miss"],
            "hit": total["hit"], "chunks": passes, "kvstore": kv}


def parse_bytes(text: str) -> int:
    from shared.config import parse_size

    return parse_size(text)


async def gpu_main(args, model_name: str) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="flotilla-kvtiers-"))
    parts = {"prefix16k": part_prefix16k, "offload": part_offload, "prefill512": part_prefill512}
    result = {"benchmark": "kvstore_tiers", "mode": "parts", "device": args.device,
              "model": args.model, "logs": str(log_dir),
              "shm_free_bytes": shutil.disk_usage(args.kv_shm_dir or "/dev/shm").free}
    for name in args.parts.split(","):
        started = time.monotonic()
        try:
            result[name] = await parts[name](args, model_name, log_dir)
        except Exception as exc:  # noqa: BLE001 - recorded; the other parts still run
            result[name] = {"error": f"{type(exc).__name__}: {exc}"}
        result[name]["wall_s"] = time.monotonic() - started
    return result


# ------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--model", default=None,
                        help="default: smollm2 on CPU, .devmodels/dummy-llama-3.1-8b on CUDA")
    parser.add_argument("--reps", type=int, default=None, help="measured repetitions "
                        "(a warm-up one comes first); default 5 on CPU, 3 on CUDA")
    parser.add_argument("--max-tokens", type=int, default=None,
                        help="output tokens of the TTFT requests (default 10 on CPU, 4 on CUDA)")
    parser.add_argument("--worker-args", type=shlex.split, default=[],
                        help='more worker flags, one string: "--log-level debug"')
    parser.add_argument("--scheduler-args", type=shlex.split, default=[])
    cpu = parser.add_argument_group("CPU")
    cpu.add_argument("--prefix-len", type=int, default=1000)
    cpu.add_argument("--kv-cache-memory", default="72MiB",
                     help="the worker's cache: ~1,600 tokens of the default model in fp32")
    cpu.add_argument("--kv-host-memory", default="2GiB")
    cpu.add_argument("--kv-disk-dir", default="", help="default: a new temporary directory")
    cpu.add_argument("--kv-disk-size", default="8GiB")
    cpu.add_argument("--keep-disk-dir", action="store_true")
    cpu.add_argument("--no-drop-page-cache", dest="drop_page_cache", action="store_false",
                     help="leave the disk files in the page cache before the disk phase")
    gpu = parser.add_argument_group("CUDA")
    parser.add_argument("--parts", default=None, help="comma-separated: cpu (the CPU figures), "
                        "prefix16k, offload, prefill512; default: cpu on CPU, the three others "
                        "on CUDA (on CPU they run only as a smoke test, with small sizes)")
    gpu.add_argument("--max-num-seqs", type=int, default=256)
    gpu.add_argument("--max-num-batched-tokens", type=int, default=8192)
    gpu.add_argument("--long-prefix-len", type=int, default=16_384)
    gpu.add_argument("--gpu-kv-cache-memory", default="4GiB",
                     help="prefix16k: the GPU cache (~32k tokens of the 8B model)")
    gpu.add_argument("--gpu-kv-host-memory", default="48GiB")
    gpu.add_argument("--kv-shm-dir", default=None, help="the kvstore's arena directory "
                     "(default /dev/shm; the kvstore caps the host tier at 90%% of its free space)")
    gpu.add_argument("--num-prompts", type=int, default=1000, help="offload: benchmark c's")
    gpu.add_argument("--offload-input-len", type=int, default=1024)
    gpu.add_argument("--offload-output-len", type=int, default=128)
    gpu.add_argument("--offload-reps", type=int, default=2,
                     help="offload: timed batches per stack (new prompts each; the median counts)")
    gpu.add_argument("--offload-warmup", type=int, default=96,
                     help="offload: warm-up requests of random lengths up to 2,048 (as benchmark f)")
    gpu.add_argument("--prefill-len", type=int, default=512)
    gpu.add_argument("--prefill-in-flight", type=int, default=128,
                     help="prefill512: requests in flight at once (both passes; 0: all)")
    gpu.add_argument("--offload-order", default="off,on")
    gpu.add_argument("--num-prefills", type=int, default=10_000)
    gpu.add_argument("--chunk", type=int, default=500, help="prefill512: prompts per chunk "
                     "(fewer if the host tier cannot hold them)")
    gpu.add_argument("--prefill-kv-cache-memory", default="8GiB",
                     help="prefill512: the GPU cache (~64k tokens of the 8B model)")
    gpu.add_argument("--time-budget-s", type=float, default=330,
                     help="prefill512: stop after the chunk that passes this")
    args = parser.parse_args()
    on_gpu = args.device == "cuda"
    args.parts = args.parts or ("prefix16k,offload,prefill512" if on_gpu else "cpu")
    args.model = args.model or (".devmodels/dummy-llama-3.1-8b" if on_gpu else "smollm2")
    args.reps = args.reps or (3 if on_gpu else 5)
    args.max_tokens = args.max_tokens or (4 if on_gpu else 10)
    model_name = resolve_model(args.model).name
    started = time.time()
    load_before = os.getloadavg()
    cpu_figures = args.parts == "cpu"
    result = asyncio.run(cpu_main(args, model_name) if cpu_figures else gpu_main(args, model_name))
    result["loadavg_before_after"] = [load_before, os.getloadavg()]
    result["num_cpus"] = os.cpu_count()
    result["date"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result["wall_s"] = time.time() - started
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"kvstore_tiers_{args.device}_{args.parts.replace(',', '_')}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    print_summary(result)
    print(f"result: {path}")


def print_summary(r: dict) -> None:
    if r["mode"] == "cpu":
        t = r["ttft_median_s"]
        print(f"\nTTFT medians (ms): recompute {t['recompute'] * 1000:.0f}, host {t['host'] * 1000:.0f}, "
              f"disk {t['disk'] * 1000:.0f}, after worker restart {t['restart'] * 1000:.0f}")
        near = {p: round(v * 1000) for p, v in r["recompute_next_to_each_median_s"].items()}
        print(f"recompute next to each phase's runs, medians (ms): {near}")
        print(f"ratio of medians: { {p: round(v, 3) for p, v in r['ratio_of_medians'].items()} }")
        print("back to back (median of each run over the recompute just before it):")
        print(f"host/recompute {r['host_over_recompute']:.3f} (target <= 0.20); disk/recompute "
              f"{r['disk_over_recompute']:.3f} (<= 0.50); restart hit share "
              f"{r['restart_hit_share']:.3f} (>= 0.90)")
        print(f"outputs identical to the uncached run: {r['outputs_identical']}")
        return
    for name in ("prefix16k", "offload", "prefill512"):
        part = r.get(name)
        if part is None:
            continue
        if "error" in part:
            print(f"{name}: FAILED {part['error']}")
        elif name == "prefix16k":
            print(f"prefix16k: recompute {part['ttft_recompute_s'] * 1000:.0f} ms, host "
                  f"{part['ttft_host_s'] * 1000:.0f} ms: {part['host_over_recompute']:.3f} (<= 0.10)"
                  f"; identical outputs {part['outputs_identical']}")
        elif name == "offload":
            print(f"offload: off {part['off']['total_tok_s']:,.0f}, on {part['on']['total_tok_s']:,.0f}"
                  f" total tok/s: cost {part['cost'] * 100:.1f}% (<= 2%)")
        else:
            print(f"prefill512: {part['num_prefills']} prompts: 0% hits {part['miss']['request_s']:.0f}"
                  f" req/s, 100% host hits {part['hit']['request_s']:.0f} req/s: x{part['speedup']:.2f}"
                  f" (>= 5); hit share {part['hit_pass_hit_share']:.3f}")


if __name__ == "__main__":
    main()
