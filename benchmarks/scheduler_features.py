"""Scheduler features measured on the running stack (issue 3's acceptance), CPU, default model.

    .venv/bin/python -m benchmarks.scheduler_features [--only prefix,chunked,idle,preempt,replicas]

Each scenario starts its own stack (nats-server + services on free ports) with the
settings it names, and prints what it measured.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from cli.stack import Stack, StackOptions, free_port
from shared.models import resolve_model

MODEL = resolve_model("smollm2").name



def start(**options) -> Stack:
    stack = Stack(StackOptions(host="127.0.0.1", port=free_port(),
                               log_dir=Path(tempfile.mkdtemp(prefix="flotilla-sched-")), **options))
    stack.start()
    return stack


def token_prompt(seed: int, length: int) -> list[int]:
    """Deterministic token ids in the ordinary-vocabulary range."""
    return [200 + (seed * 7919 + i * 104729) % 40000 for i in range(length)]


async def stream(client: httpx.AsyncClient, prompt, max_tokens: int) -> dict:
    """One streaming completion; returns the send time and each chunk's arrival time."""
    started = time.perf_counter()
    times, text = [], []
    async with client.stream("POST", "/v1/completions", json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                payload = json.loads(line[6:])
                if payload.get("choices"):
                    times.append(time.perf_counter())
                    text.append(payload["choices"][0]["text"])
    return {"started": started, "times": times, "text": "".join(text)}


def metric_sum(base_url: str, name: str) -> dict[str, float]:
    """A metric's value per replica_id, summed over its other labels."""
    values: dict[str, float] = {}
    for line in httpx.get(base_url + "/metrics").text.splitlines():
        if line.startswith(name + "{"):
            replica = line.split('replica_id="')[1].split('"')[0]
            values[replica] = values.get(replica, 0.0) + float(line.rsplit(" ", 1)[1])
    return values


async def prefix_scenario() -> None:
    stack = start()
    try:
        prefix = token_prompt(1, 1000)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
            await stream(client, token_prompt(99, 16), 2)  # warm-up, unrelated prompt
            first = await stream(client, prefix + token_prompt(2, 20), 4)
            second = await stream(client, prefix + token_prompt(3, 20), 4)
        ttft1 = first["times"][0] - first["started"]
        ttft2 = second["times"][0] - second["started"]
        print(f"[prefix] 1,000-token shared prefix: TTFT first {ttft1 * 1000:.0f} ms, second "
              f"{ttft2 * 1000:.0f} ms, ratio {ttft2 / ttft1:.3f} (target <= 0.25)")
    finally:
        stack.stop()


async def chunked_scenario(budget: int, chunk_step_ratio: float, worker_threads: int) -> None:
    stack = start(service_args={"scheduler": ["--max-num-batched-tokens", str(budget),
                                              "--chunk-step-ratio", str(chunk_step_ratio),
                                              "--log-level", "debug"],
                                "worker": ["--num-threads", str(worker_threads)]})
    print(f"[chunked] logs in {stack.options.log_dir}")
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
            streams = [asyncio.create_task(stream(client, token_prompt(10 + i, 32), 400))
                       for i in range(8)]
            await asyncio.sleep(4.0)  # the 8 streams are decoding
            big = await stream(client, token_prompt(50, 4000), 1)
            results = await asyncio.gather(*streams)
        prefill_start, prefill_end = big["started"], big["times"][0]
        gaps_all, gaps_during = [], []
        for result in results:
            times = result["times"]
            for before, after in zip(times, times[1:]):
                gaps_all.append(after - before)
                if after > prefill_start and before < prefill_end:
                    gaps_during.append(after - before)
        median = statistics.median(gaps_all)
        during = sorted(gaps_during)
        print(f"[chunked] gaps during the prefill (ms): p50 {during[len(during) // 2] * 1000:.0f}, "
              f"p90 {during[int(len(during) * 0.9)] * 1000:.0f}, p99 {during[int(len(during) * 0.99)] * 1000:.0f}, "
              f"top 5 {[round(g * 1000) for g in during[-5:]]}")
        print(f"[chunked] budget {budget} tokens/step, chunk-step ratio {chunk_step_ratio}, "
              f"worker threads {worker_threads or 'default'}: "
              f"4,000-token prefill took "
              f"{prefill_end - prefill_start:.1f} s; the 8 streams' median gap {median * 1000:.0f} ms, "
              f"largest gap during the prefill {max(gaps_during) * 1000:.0f} ms = "
              f"{max(gaps_during) / median:.2f}x the median (target < 3x)")
    finally:
        stack.stop()


async def idle_scenario(steps_in_flight: int) -> None:
    stack = start(service_args={"scheduler": ["--max-steps-in-flight", str(steps_in_flight)]})
    try:
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
            tasks = [asyncio.create_task(stream(client, token_prompt(i, 32), 160)) for i in range(16)]
            await asyncio.sleep(5.0)  # past the prefill: steady decode
            busy_before, wall_before = metric_sum(stack.base_url, "flotilla_worker_busy_seconds_total"), time.monotonic()
            await asyncio.sleep(6.0)
            busy_after, wall_after = metric_sum(stack.base_url, "flotilla_worker_busy_seconds_total"), time.monotonic()
            await asyncio.gather(*tasks)
        idle = 1 - (busy_after["0"] - busy_before["0"]) / (wall_after - wall_before)
        print(f"[idle] 16 streams at steady decode, {steps_in_flight} step(s) in flight: worker idle "
              f"{idle * 100:.1f}% of wall time (target < 10% with overlap)")
    finally:
        stack.stop()


async def preempt_scenario() -> None:
    stack = start(service_args={"worker": ["--kv-cache-memory", "13MiB"],
                                "scheduler": ["--max-num-seqs", "16"]})
    try:
        prompts = [token_prompt(100 + i, 40) for i in range(16)]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
            alone = [(await stream(client, p, 32))["text"] for p in prompts]
            together = await asyncio.gather(*(stream(client, p, 32) for p in prompts))
        preemptions = sum(metric_sum(stack.base_url, "flotilla_preemptions_total").values())
        same = sum(a == t["text"] for a, t in zip(alone, together))
        print(f"[preempt] KV for ~{13 * 2**20 // (16 * 46080) * 16} tokens, 16 requests x 72 tokens: "
              f"{same}/16 texts equal to their solo runs, {preemptions:.0f} preemptions in /metrics")
    finally:
        stack.stop()


async def replicas_scenario() -> None:
    stack = start(replicas=2, service_args={"worker": ["--kv-cache-memory", "256MiB"]})
    try:
        prompts = [token_prompt(300 + i, 24) for i in range(32)]
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
            started = time.perf_counter()
            results = await asyncio.gather(*(stream(client, p, 32) for p in prompts))
            elapsed = time.perf_counter() - started
        busy = metric_sum(stack.base_url, "flotilla_worker_busy_seconds_total")
        print(f"[replicas] --replicas 2: 32 requests in {elapsed:.1f} s, "
              f"{sum(len(r['times']) > 0 for r in results)}/32 completed; worker busy seconds per "
              f"replica {json.dumps({k: round(v, 1) for k, v in sorted(busy.items())})}")
    finally:
        stack.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="prefix,chunked,idle,preempt,replicas")
    parser.add_argument("--chunk-budget", type=int, default=48)
    parser.add_argument("--chunk-step-ratio", type=float, default=0.0,
                        help="the scheduler's --chunk-step-ratio (0: off)")
    parser.add_argument("--worker-threads", type=int, default=0,
                        help="chunked: the worker's --num-threads (0: torch's default)")
    args = parser.parse_args()
    chosen = args.only.split(",")
    if "prefix" in chosen:
        asyncio.run(prefix_scenario())
    if "chunked" in chosen:
        asyncio.run(chunked_scenario(args.chunk_budget, args.chunk_step_ratio,
                                     args.worker_threads))
    if "idle" in chosen:
        asyncio.run(idle_scenario(2))
        asyncio.run(idle_scenario(1))
    if "preempt" in chosen:
        asyncio.run(preempt_scenario())
    if "replicas" in chosen:
        asyncio.run(replicas_scenario())


if __name__ == "__main__":
    main()
