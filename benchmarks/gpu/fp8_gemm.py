"""Issue 29: the FP8 projections against bf16 on the Llama-3.1-8B (and, with ``--shapes
qkv_70b,...``, Llama-3.3-70B) shapes, per row count.

    python -m benchmarks.gpu.fp8_gemm                      # M = 1 .. 4096, the table's configs
    python -m benchmarks.gpu.fp8_gemm --sweep --m 1,8      # skinny FP8 configs, best per shape
    python -m benchmarks.gpu.fp8_gemm --sweep --gated --shapes gate_up  # gate_up + SwiGLU

Per (shape, M), µs per call (one CUDA graph of back-to-back calls on rotating weight copies
over 1 GiB, as benchmarks/gpu/skinny_gemm.py times them):
- ``bf16``: what the worker runs for a bf16 weight (``ops.linear``: the skinny GEMM where its
  table serves, else cuBLAS);
- ``skinny_fp8``: the skinny GEMM on the FP8 weight (weight-only FP8), M <= 16;
- ``scaled_fp8``: per-token activation quantization + ``torch._scaled_mm`` (row-wise scales).
The worker's choice for an FP8 weight is the skinny GEMM where ``skinny_gemm.serves`` holds and
the scaled GEMM elsewhere; the table shows where that choice is right. ``--gated`` sweeps the
gate_up + SwiGLU launch on FP8 weights against the plain one plus silu_and_mul (the fused one
lost, 49.3 against 40.4 µs, while FP8 tiles were widened to bf16; with fp16 products it won).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
from pathlib import Path

import torch

from benchmarks.gpu.skinny_gemm import SHAPES as PLAIN_SHAPES, graph_time_us, sweep_grid, weights
from kernels import fp8
from kernels.skinny_gemm import MAX_M, SkinnyConfig, skinny_gemm, skinny_gemm_silu_and_mul
from services.worker import ops

SHAPES = {**PLAIN_SHAPES,
          # Llama-3.3-70B's projections
          "qkv_70b": (10240, 8192), "o_proj_70b": (8192, 8192), "gate_up_70b": (57344, 8192),
          "down_70b": (8192, 28672)}
def ops_for(name: str):
    """(the worker's bf16 op, the skinny FP8 op, the scaled FP8 op), each (x, w, scale)."""
    return (lambda x, w, s: ops.linear(x, w),
            lambda x, w, s, config=None: skinny_gemm(x, w, config=config, weight_scale=s),
            fp8.fp8_linear)


def fp8_weights(n: int, k: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Copies of an FP8 [n, k] weight and its scale, together over 1 GiB."""
    return [fp8.quantize_per_channel(w) for w in weights(n, k, torch.bfloat16)[::2]]


def time_row(name: str, m: int, bf16_ws, fp8_ws, calls: int, replays: int) -> dict:
    n, k = SHAPES[name]
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    scaled = [w for w, _ in fp8_ws]
    scale_of = {id(w): s for w, s in fp8_ws}
    bf16_op, skinny_op, scaled_op = ops_for(name)
    row = {"shape": name, "n": n, "k": k, "m": m,
           "bf16_us": graph_time_us(lambda x_, w_: bf16_op(x_, w_, None), bf16_ws, x, calls,
                                    replays),
           "scaled_fp8_us": graph_time_us(
               lambda x_, w_: scaled_op(x_, w_, scale_of[id(w_)]), scaled, x, calls, replays)}
    if m <= MAX_M:
        row["skinny_fp8_us"] = graph_time_us(
            lambda x_, w_: skinny_op(x_, w_, scale_of[id(w_)]), scaled, x, calls, replays)
    return row


def fp8_grid(n: int, k: int) -> list[SkinnyConfig]:
    """benchmarks/gpu/skinny_gemm.py's grid, widened where an FP8 tile (half the bytes) may
    want it: 16-column tiles, 512-wide K tiles, 5 stages, two splits for the widest N."""
    grid = sweep_grid(n, k)
    splits = (1, 2) if n >= 16384 else (1, 2, 4)
    grid += [SkinnyConfig(16, block_k, split, 4, stages)
             for block_k in (256, 512) for split in splits for stages in (3, 4, 5)]
    grid += [SkinnyConfig(32, block_k, split, 4, 5) for block_k in (256, 512) for split in splits]
    if n >= 16384:
        grid += [SkinnyConfig(32, 256, 2, 4, stages) for stages in (3, 4)]
    # wide tiles (fp16 products are cheap: 128 x 256 won gate_up and down, 2026-11-27)
    grid += [SkinnyConfig(block_n, block_k, split, warps, stages)
             for block_n, block_k in ((256, 128), (256, 256), (128, 512)) for split in splits
             for warps in (4, 8) for stages in (2, 3)]
    return list(dict.fromkeys(grid))


def gated_grid(n: int, k: int) -> list[SkinnyConfig]:
    """The gated launch's grid (block_n counts output columns: a program streams twice as many
    weight rows); K is never split."""
    return [SkinnyConfig(block_n, block_k, 1, warps, stages)
            for block_n, block_k, warps, stages in itertools.product(
                (16, 32, 64, 128), (128, 256), (4, 8), (3, 4))]


def launcher(gated: bool):
    """The swept op (x, w, scale, config): the plain skinny GEMM, or with ``gated`` its
    gate_up + SwiGLU launch."""
    if gated:
        return lambda x, w, s, config=None: skinny_gemm_silu_and_mul(x, w, config=config,
                                                                     weight_scale=s)
    return lambda x, w, s, config=None: skinny_gemm(x, w, config=config, weight_scale=s)


def _compile(job) -> None:
    """Sweep helper, in a spawned process: compile each config (fills Triton's disk cache)."""
    n, k, configs, gated = job
    torch.cuda.init()
    w = torch.zeros(n, k, device="cuda", dtype=torch.bfloat16).to(fp8.FP8_DTYPE)
    scale = torch.ones(n, device="cuda")
    x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
    for config in configs:
        try:
            launcher(gated)(x, w, scale, config)
        except Exception as exc:  # a config that does not compile is skipped by the sweep
            print(f"compile failed {config}: {type(exc).__name__}: {exc}", flush=True)
    torch.cuda.synchronize()


def sweep(names: list[str], ms: list[int], calls: int, replays: int, jobs: int,
          gated: bool = False) -> list[dict]:
    """Each shape's grid (wider K tiles too: an FP8 tile is half the bytes) at ``ms``; the
    five fastest at ms[0] printed per shape. ``gated``: the gate_up + SwiGLU launch's grid,
    against the plain launch at its table config plus silu_and_mul."""
    grids = {name: (gated_grid if gated else fp8_grid)(*SHAPES[name]) for name in names}
    work = [(*SHAPES[name], grids[name][i::3], gated) for name in names for i in range(3)]
    with multiprocessing.get_context("spawn").Pool(min(jobs, len(work))) as pool:
        pool.map(_compile, work)
    rows = []
    for name in names:
        fp8_ws = fp8_weights(*SHAPES[name])
        scale_of = {id(w): s for w, s in fp8_ws}
        scaled = [w for w, _ in fp8_ws]
        skinny_op = launcher(gated)
        xs = {m: torch.randn(m, SHAPES[name][1], device="cuda", dtype=torch.bfloat16)
              for m in ms}
        timed = []
        if gated:
            plain = {m: graph_time_us(lambda x_, w_: ops.silu_and_mul(
                skinny_gemm(x_, w_, weight_scale=scale_of[id(w_)])), scaled, xs[m], calls,
                replays) for m in ms}
            print(f"\n{name}: plain launch + silu_and_mul " + ", ".join(
                f"M={m} {t:.1f}" for m, t in plain.items()), flush=True)
        for config in grids[name]:
            try:
                times = {m: graph_time_us(
                    lambda x_, w_, c=config: skinny_op(x_, w_, scale_of[id(w_)], config=c),
                    scaled, xs[m], calls, replays) for m in ms}
            except Exception as exc:
                print(f"{name} {config}: {type(exc).__name__}: {exc}", flush=True)
                continue
            timed.append((times[ms[0]], config, times))
            rows.append({"shape": name, "config": vars(config), "us": times})
        timed.sort(key=lambda t: t[0])
        print(f"\n{name} {SHAPES[name]}: fastest {'gated ' if gated else ''}skinny FP8 configs",
              flush=True)
        for _, config, times in timed[:5]:
            print(f"  {config}  " + ", ".join(f"M={m} {t:.1f}" for m, t in times.items()))
        del fp8_ws, scaled
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down")  # lm_head stays bf16
    parser.add_argument("--m", default="1,2,4,8,16,32,64,256,1024,4096")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--gated", action="store_true", help="sweep the gate_up + SwiGLU launch")
    args = parser.parse_args()
    names, ms = args.shapes.split(","), [int(m) for m in args.m.split(",")]
    results = {"device": torch.cuda.get_device_name(), "rows": []}
    if args.sweep:
        results["sweep"] = sweep(names, ms, args.calls, args.replays, args.jobs, args.gated)
    print(f"\n{results['device']}: µs per call, median of {args.replays} graph replays")
    print("| shape | M | bf16 (worker) | skinny FP8 | scaled FP8 | best FP8 / bf16 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in names:
        n, k = SHAPES[name]
        bf16_ws, fp8_ws = weights(n, k, torch.bfloat16), fp8_weights(n, k)
        for m in ms:
            row = time_row(name, m, bf16_ws, fp8_ws, args.calls, args.replays)
            results["rows"].append(row)
            best = min(row["scaled_fp8_us"], row.get("skinny_fp8_us", float("inf")))
            print(f"| {name} | {m} | {row['bf16_us']:.1f} | "
                  f"{row.get('skinny_fp8_us', float('nan')):.1f} | {row['scaled_fp8_us']:.1f} | "
                  f"{best / row['bf16_us']:.2f} |", flush=True)
        del bf16_ws, fp8_ws
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8_gemm.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
