"""Issue 4 benchmark f: benchmark c through the full service stack (gateway -> NATS ->
scheduler -> worker), to compare with the in-process engine (offline_throughput.py).

    python -m benchmarks.gpu.stack_throughput --model dummy:llama-3.1-8b \
        --num-prompts 1000 --input-len 1024 --output-len 128

Starts nats-server and every service (cli/stack.py) with the engine's settings (bf16 on CUDA,
the same max-num-seqs, max-num-batched-tokens and max-model-len, prefix caching off as in the
engine run), then sends every request at once to /v1/completions as token-id prompts (the same
seeded random prompts offline_throughput.py builds), non-streaming, greedy, EOS ignored, and
reports total and output tokens per second from the responses' usage.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import shutil
import ssl
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from benchmarks.gpu.common import device_name, done_percentiles, save
from benchmarks.gpu.online_serve import Profiler
from cli.bench.load import NUM_CLIENTS
from cli.stack import Stack, StackOptions, flags, free_port
from shared.models import resolve_model


async def send_all(base_url: str, model: str, prompts: list[list[int]], output_len: int,
                   on_start: Callable[[], None] = lambda: None) -> dict:
    # Several clients, taken in turn: one httpx client with 1,000 connections is itself
    # the bottleneck (cli.bench.client.ClientPool).
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    tls = ssl.create_default_context()  # one for all: each client making its own is slow
    clients = [httpx.AsyncClient(base_url=base_url, timeout=1800, limits=limits, verify=tls)
               for _ in range(NUM_CLIENTS)]
    turn = itertools.cycle(clients)
    client = clients[0]
    try:
        async def one(prompt: list[int]) -> dict:
            response = await next(turn).post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                "ignore_eos": True})
            response.raise_for_status()
            return response.json()["usage"]

        # Warm-up over varied shapes, so Triton compiles its kernel variants before the clock runs.
        rng = random.Random(1)
        await asyncio.gather(*(one([rng.randrange(100, 40_000) for _ in range(rng.randint(1, 2048))])
                               for _ in range(96)))
        before = await scrape(client)
        on_start()
        started = time.perf_counter()
        sampler = asyncio.create_task(sample_timeline(client, started))
        done_at: list[float] = []

        async def timed(prompt: list[int]) -> dict:
            usage = await one(prompt)
            done_at.append(time.perf_counter() - started)
            return usage

        usages = await asyncio.gather(*(timed(p) for p in prompts))
        elapsed = time.perf_counter() - started
        sampler.cancel()
        await asyncio.gather(sampler, return_exceptions=True)
        after = await scrape(client)
    finally:
        await asyncio.gather(*(c.aclose() for c in clients))
    num_in = sum(u["prompt_tokens"] for u in usages)
    num_out = sum(u["completion_tokens"] for u in usages)
    return {"elapsed_s": elapsed, "input_tokens": num_in, "output_tokens": num_out,
            "request_s": len(prompts) / elapsed, "output_tok_s": num_out / elapsed,
            "total_tok_s": (num_in + num_out) / elapsed,
            "num_steps": after.get(STEPS, 0) - before.get(STEPS, 0),
            "worker_busy_share": (after.get(BUSY, 0) - before.get(BUSY, 0)) / elapsed,
            "done_s_percentiles": done_percentiles(done_at),
            "timeline": TIMELINE}


# (s since start, running, waiting, steps, scheduled tokens): where the run spends its time
TIMELINE: list[tuple[float, ...]] = []
RUNNING, WAITING = "flotilla_num_requests_running", "flotilla_num_requests_waiting"
STEP_TOKENS = "flotilla_scheduled_tokens_per_step_sum"


async def sample_timeline(client: httpx.AsyncClient, started: float) -> None:
    while True:
        await asyncio.sleep(0.5)
        totals = parse_metrics((await client.get("/metrics")).text,
                               (RUNNING, WAITING, STEPS, STEP_TOKENS))
        TIMELINE.append((round(time.perf_counter() - started, 2), *(
            int(totals.get(name, 0)) for name in (RUNNING, WAITING, STEPS, STEP_TOKENS))))


def parse_metrics(text: str, names: tuple[str, ...]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in names:
            totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


STEPS, BUSY = "flotilla_scheduled_tokens_per_step_count", "flotilla_worker_busy_seconds_total"


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    """The gateway's counters summed over labels (replicas): steps and worker busy seconds."""
    await asyncio.sleep(1.0)  # the schedulers' stats events come every 0.5 s
    return parse_metrics((await client.get("/metrics")).text, (STEPS, BUSY))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-steps-in-flight", type=int, default=2)
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="one worker over this many GPUs (no kvstore then, as flotilla serve)")
    parser.add_argument("--profile-seconds", type=float, default=0.0,
                        help="py-spy the services for this long from the start of the timed run")
    parser.add_argument("--profile-dir", default=os.environ.get("OUT", "/tmp/out"))
    args = parser.parse_args()
    rng = random.Random(args.seed)  # the prompts offline_throughput.py's fixed workload draws
    prompts = [[rng.randrange(100, 40_000) for _ in range(args.input_len)]
               for _ in range(args.num_prompts)]
    model_name = resolve_model(args.model).name
    engine_flags = flags(max_num_seqs=args.max_num_seqs,
                         max_num_batched_tokens=args.max_num_batched_tokens)
    log_dir = Path(tempfile.mkdtemp(prefix="flotilla-stack-"))
    tp = args.tensor_parallel_size
    service_args = {
        "worker": engine_flags + flags(device="cuda", dtype="bfloat16",
                                       max_model_len=args.max_model_len,
                                       tensor_parallel_size=tp),
        "scheduler": engine_flags + flags(max_steps_in_flight=args.max_steps_in_flight)
        + ["--no-prefix-caching"]}
    stack = Stack(StackOptions(model=args.model, port=free_port(), log_dir=log_dir,
                               kvstore=tp == 1, worker_gpus=tp, service_args=service_args))
    stack.start(timeout_s=600)
    profiler = None
    if args.profile_seconds > 0 and shutil.which("py-spy"):
        profiler = Profiler(shutil.which("py-spy"), os.getpid(), Path(args.profile_dir),
                            args.profile_seconds, 100, ("gateway", "scheduler", "worker"))
    try:
        result = asyncio.run(send_all(stack.base_url, model_name, prompts, args.output_len,
                                      profiler.start if profiler else lambda: None))
    finally:
        if profiler is not None:
            print("profile:", profiler.finish())
        stack.stop()
    result = {"benchmark": "stack_throughput", "model": args.model, "device": device_name(),
              "num_prompts": args.num_prompts, "max_steps_in_flight": args.max_steps_in_flight,
              "tensor_parallel_size": tp,
              **result, "logs": str(log_dir)}
    save(f"stack_throughput_{args.max_steps_in_flight}_{args.model}", result)
    print(f"\nstack {args.model}: {result['total_tok_s']:,.0f} total tok/s, "
          f"{result['output_tok_s']:,.0f} output tok/s, {result['request_s']:.1f} req/s")


if __name__ == "__main__":
    main()
