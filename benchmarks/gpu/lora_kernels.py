"""Issue 50: GPU time of the LoRA kernels (kernels/lora.py: shrink + expand, one projection)
at Llama-3.1-8B's projections, rank 16 over 8 adapters, against the base projection's GEMM
(F.linear, bf16) and the torch path's segment ops, per row count; each timed as a CUDA
graph of ``--calls`` launches (common.graph_us), median of the replays.

    python -m benchmarks.gpu.lora_kernels [--rank 16] [--rows 1,4,16,64,256,1024,4096]
    python -m benchmarks.gpu.lora_kernels --sweep --out kernels/lora_configs.json

``--sweep``: per projection and row bucket (kernels/lora_configs.py's), the shrink's
candidates with the default expand, then the expand's with the best shrink, each pair timed
as above; the fastest pair of each bucket is written as the table the worker reads, with the
default plan's time beside it (a bucket where no candidate beats the default keeps it).

Rows are every adapter's in turn (a decode batch spread round-robin, the kernels' worst
grouping); the torch path gets the same rows sorted into 8 segments (its best case: one
segment an adapter). What the kernels add to a step is their time per projection here,
times the layers.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

import triton

from benchmarks.gpu.common import device_name, graph_us, save
from kernels.lora import lora_expand, lora_rows_of, lora_shrink
from kernels.lora_configs import (
    BUCKETS, ExpandConfig, LoraPlan, ShrinkConfig, default_plan, shape_key)

# name -> (in_features, parts, out_features)
SHAPES = {"qkv_proj": (4096, 3, 6144), "o_proj": (4096, 1, 4096),
          "gate_up_proj": (4096, 2, 28672), "down_proj": (14336, 1, 4096)}
NUM_ADAPTERS = 8


def measure(name: str, num_rows: int, rank: int, calls: int, replays: int) -> dict:
    in_features, parts, out_features = SHAPES[name]
    width = parts * rank
    device, dtype = "cuda", torch.bfloat16
    x = torch.randn(num_rows, in_features, device=device, dtype=dtype)
    weight = torch.randn(out_features, in_features, device=device, dtype=dtype) / 64
    a = torch.randn(NUM_ADAPTERS, width, in_features, device=device, dtype=dtype) / 64
    b = torch.randn(NUM_ADAPTERS, out_features, width, device=device, dtype=dtype) / 8
    out = torch.zeros(num_rows, out_features, device=device, dtype=dtype)
    token_slots = (torch.arange(num_rows, device=device) % NUM_ADAPTERS).to(torch.int32)
    lora_rows = lora_rows_of(token_slots)
    per_slot = -(-num_rows // NUM_ADAPTERS)
    segments = [(slot, start, min(start + per_slot, num_rows)) for slot, start in
                zip(range(NUM_ADAPTERS), range(0, num_rows, per_slot))]

    def kernels(_):
        lora_expand(lora_shrink(x, a, lora_rows), b, lora_rows, out)

    def torch_path(_):
        for slot, start, end in segments:
            out[start:end] += x[start:end] @ a[slot].T @ b[slot].T

    return {"projection": name, "rows": num_rows, "rank": rank,
            "base_gemm_us": graph_us(lambda _: F.linear(x, weight), calls, replays),
            "kernels_us": graph_us(kernels, calls, replays),
            "torch_path_us": graph_us(torch_path, calls, replays)}


def shrink_candidates(num_rows: int) -> list[ShrinkConfig]:
    if num_rows <= 16:  # one tile of rows: how finely in_features is split decides
        return [ShrinkConfig(16, block_k, target, max_splits)
                for block_k in (64, 128, 256) for target in (64, 256)
                for max_splits in (16, 64)]
    return [ShrinkConfig(block_m, 64, target, 16, warps)
            for block_m in (16, 32, 64) for target in (132, 528) for warps in (4, 8)]


def expand_candidates(num_rows: int) -> list[ExpandConfig]:
    if num_rows <= 16:
        return [ExpandConfig(16, block_n) for block_n in (32, 64, 128)]
    return [ExpandConfig(block_m, block_n, warps)
            for block_m in (16, 32, 64) for block_n in (64, 128) for warps in (4, 8)]


def sweep_shape(name: str, rank: int, calls: int, replays: int) -> tuple[dict, dict]:
    """({bucket: plan json}, {bucket: {default_us, best_us}}) of one projection."""
    in_features, parts, out_features = SHAPES[name]
    width = parts * rank
    device, dtype = "cuda", torch.bfloat16
    a = torch.randn(NUM_ADAPTERS, width, in_features, device=device, dtype=dtype) / 64
    b = torch.randn(NUM_ADAPTERS, out_features, width, device=device, dtype=dtype) / 8
    plans, timings = {}, {}
    for num_rows in BUCKETS:
        x = torch.randn(num_rows, in_features, device=device, dtype=dtype)
        out = torch.zeros(num_rows, out_features, device=device, dtype=dtype)
        slots = (torch.arange(num_rows, device=device) % NUM_ADAPTERS).to(torch.int32)
        lora_rows = lora_rows_of(slots)

        def time_plan(plan: LoraPlan) -> float:
            def pair(_):
                y = lora_shrink(x, a, lora_rows, plan.shrink)
                lora_expand(y, b, lora_rows, out, plan.expand)
            try:
                return graph_us(pair, calls, replays)
            except (triton.runtime.errors.OutOfResources, RuntimeError):
                return float("inf")  # (a config the GPU cannot launch)

        default = default_plan(num_rows, width)
        best_us, best = time_plan(default), default
        default_us = best_us
        for shrink in shrink_candidates(num_rows):
            us = time_plan(LoraPlan(shrink, default.expand))
            if us < best_us:
                best_us, best = us, LoraPlan(shrink, default.expand)
        for expand in expand_candidates(num_rows):
            us = time_plan(LoraPlan(best.shrink, expand))
            if us < best_us:
                best_us, best = us, LoraPlan(best.shrink, expand)
        plans[str(num_rows)] = best.to_json()
        timings[str(num_rows)] = {"default_us": round(default_us, 2), "best_us": round(best_us, 2)}
        print(f"{name:<14}{num_rows:>6}{default_us:>10.1f}{best_us:>10.1f}  {best}", flush=True)
    return plans, timings


def sweep(args) -> None:
    table = {"device": device_name(), "triton": triton.__version__, "rank": args.rank,
             "plans": {}, "timings_us": {}}
    for name, (in_features, parts, out_features) in SHAPES.items():
        key = shape_key(in_features, parts * args.rank, out_features, torch.bfloat16)
        table["plans"][key], table["timings_us"][key] = sweep_shape(
            name, args.rank, args.calls, args.replays)
    Path(args.out).write_text(json.dumps(table, indent=1) + "\n")
    save(f"lora_sweep_r{args.rank}", table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--out", default="kernels/lora_configs.json")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--calls", type=int, default=20, help="launches a graph holds")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
    if args.sweep:
        sweep(args)
        return
    results = []
    for name in SHAPES:
        for num_rows in map(int, args.rows.split(",")):
            result = measure(name, num_rows, args.rank, args.calls, args.replays)
            results.append(result)
            print(json.dumps(result), flush=True)
    save(f"lora_kernels_r{args.rank}", {"benchmark": "lora_kernels", "device": device_name(),
                                        "results": results})
    print(f"\n{'projection':<14}{'rows':>6}{'base us':>10}{'kernels us':>12}{'torch us':>10}")
    for r in results:
        print(f"{r['projection']:<14}{r['rows']:>6}{r['base_gemm_us']:>10.1f}"
              f"{r['kernels_us']:>12.1f}{r['torch_path_us']:>10.1f}")


if __name__ == "__main__":
    main()
