"""A CPU worker's decode step on the default model, in process (no bus): 16 sequences at
~300 tokens of context, greedy. Prints the median step time; ``--profile`` adds a
torch.profiler table of the ops.

    .venv/bin/python -m benchmarks.cpu_decode_step [--num-seqs 16] [--context 256] [--profile]
        [--dtype float32|bfloat16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from services.worker.config import WorkerConfig
from services.worker.runner_build import build_runner
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import resolve_model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-seqs", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--num-threads", type=int, default=0)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--dtype", default="auto", help="the worker's --dtype (auto: fp32 on CPU)")
    args = parser.parse_args()
    block_size = 16
    runner = build_runner(WorkerConfig(device="cpu", kv_cache_memory="256MiB",
                                      block_size=block_size, num_threads=args.num_threads,
                                      dtype=args.dtype),
                         resolve_model("smollm2"))
    rng = random.Random(0)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.steps + 1)
    total_len = args.context + args.steps + 1
    blocks_per_seq = -(-total_len // block_size)
    new_requests = [
        NewRequestData(request_id=f"r{i}", token_ids=[rng.randrange(100, 40000)
                                                      for _ in range(args.context)],
                       sampling=greedy, block_ids=list(range(i * blocks_per_seq,
                                                             (i + 1) * blocks_per_seq)),
                       num_computed_tokens=0)
        for i in range(args.num_seqs)]
    step_id = 0
    start = time.perf_counter()
    for new in new_requests:  # prefill one by one
        runner.execute(StepPlan(step_id=step_id, new_requests=[new], scheduled=[
            ScheduledRequest(request_id=new.request_id, num_new_tokens=args.context)]))
        step_id += 1
    print(f"prefill {time.perf_counter() - start:.1f} s")
    times = []
    decode = [ScheduledRequest(request_id=n.request_id, num_new_tokens=1) for n in new_requests]

    def step() -> None:
        nonlocal step_id
        start = time.perf_counter()
        runner.execute(StepPlan(step_id=step_id, new_requests=[], scheduled=decode))
        times.append(time.perf_counter() - start)
        step_id += 1

    for _ in range(args.steps // 2 if args.profile else args.steps):
        step()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps - args.steps // 2):
                step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    print(f"dtype {args.dtype} threads {torch.get_num_threads()} seqs {args.num_seqs} context {args.context}: "
          f"decode step median {statistics.median(times) * 1e3:.1f} ms, "
          f"min {min(times) * 1e3:.1f} ms over {len(times)} steps")


if __name__ == "__main__":
    main()
