"""Issue 51: the W4A16 / W8A16 GEMM (kernels/int_gemm.py) on packed weights against torch's
bf16 matmul on the same weights dequantized, on the Llama-3.1-8B projections, per row count.

    python -m benchmarks.gpu.int_gemm                        # M = 1 .. 4096, the worker's configs
    python -m benchmarks.gpu.int_gemm --bits 8 --group-size -1 --symmetric
    python -m benchmarks.gpu.int_gemm --sweep --shapes o_proj,down   # decode + prefill grids

Per (shape, M), µs per call: one CUDA graph of ``--calls`` back-to-back calls, each on the next
of several copies of the weight (together over 1 GiB, so nothing is served from the 50 MB L2),
replayed ``--replays`` times, the median (``common.graph_us``, as benchmarks/gpu/skinny_gemm.py
times them):
- ``int``: ``int_gemm`` with the worker's launch (decode up to 16 rows, prefill above), on the
  packed weight (default AWQ-like: 4 bits, groups of 128, zero points);
- ``torch``: ``F.linear`` (cuBLAS) on the dequantized bf16 weight;
- ``worker_bf16`` (M <= 16): what the worker runs for a bf16 weight (``ops.linear``: the
  skinny GEMM where its table serves).
GB/s counts the weight's bytes once (packed: words, scales, zeros). ``err``: the int GEMM's
relative error against fp32 on the dequantized weight (bf16 rounding: ~3e-3).
``--sweep`` compiles a grid of decode configs (timed at ``--sweep-m``'s rows up to 16) and of
prefill configs (the rows above) in parallel processes, then prints the five fastest per
shape and row count (the tables in kernels/int_gemm.py take the winners).
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.gpu.common import graph_us
from kernels.int_gemm import DECODE_MAX_M, IntGemmConfig, int_gemm
from kernels.int_pack import dequantize, random_int_weight
from services.worker import ops

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
          "down": (4096, 14336)}  # (N, K) of the Llama-3.1-8B projections


def int_weights(n: int, k: int, args, copies: int) -> list:
    generator = torch.Generator(device="cuda").manual_seed(n + k)
    return [random_int_weight(n, k, args.bits, args.group_size, "cuda", generator,
                              zero_points=not args.symmetric, act_order=args.act_order)
            for _ in range(copies)]


def copies_over(num_bytes: int) -> int:
    return max(2, -(-(1 << 30) // num_bytes))


def timed(fn, ws: list, x: torch.Tensor, calls: int, replays: int) -> float:
    """µs per call: one graph of ``calls`` calls on rotating weights, the median replay."""
    return graph_us(lambda i: fn(x, ws[i % len(ws)]), calls, replays, warm_calls=2)


def rel_err(weight, m: int, config: IntGemmConfig | None = None) -> float:
    x = torch.randn(m, weight.in_features, device="cuda", dtype=torch.bfloat16)
    y = int_gemm(x, weight, config=config).double()
    ref = F.linear(x.double(), dequantize(weight).double())
    return ((y - ref).norm() / ref.norm()).item()


def table_rows(name: str, ms: list[int], args) -> list[dict]:
    """The worker's launch, torch bf16 and (M <= 16) the worker's bf16 path at each M."""
    n, k = SHAPES[name]
    packed_ws = int_weights(n, k, args, copies_over(n * k * args.bits // 8))
    packed = packed_ws[0]
    bf16_ws = [dequantize(w, torch.bfloat16) for w in packed_ws[:copies_over(n * k * 2)]]
    rows = []
    for m in ms:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        row = {"shape": name, "n": n, "k": k, "m": m,
               "int_us": timed(lambda x_, w_: int_gemm(x_, w_), packed_ws, x, args.calls,
                               args.replays),
               "torch_us": timed(F.linear, bf16_ws, x, args.calls, args.replays),
               "err": rel_err(packed, m), "int_bytes": packed.num_bytes,
               "bf16_bytes": n * k * 2}
        if m <= DECODE_MAX_M:
            row["worker_bf16_us"] = timed(lambda x_, w_: ops.linear(x_, w_), bf16_ws, x,
                                          args.calls, args.replays)
        rows.append(row)
        print(json.dumps(row), flush=True)
    del packed_ws, bf16_ws
    torch.cuda.empty_cache()
    return rows


def decode_grid(bits: int) -> list[IntGemmConfig]:
    block_kw = 16 if bits == 4 else 32
    return [IntGemmConfig(16, block_n, block_kw, split, warps, stages, one_dot=one_dot)
            for block_n, split, warps, stages, one_dot in itertools.product(
                (32, 64, 128), (1, 2, 4, 8), (4, 8), (3, 4), (False, True))]


def prefill_grid(bits: int) -> list[IntGemmConfig]:
    block_kw = 16 if bits == 4 else 32
    return [IntGemmConfig(block_m, block_n, block_kw, 1, warps, stages, one_dot=one_dot)
            for block_m, block_n, warps, stages, one_dot in itertools.product(
                (64, 128), (64, 128, 256), (4, 8), (2, 3, 4), (False, True))]


def _compile(job) -> None:
    """Sweep helper, in a spawned process: compile each config (fills Triton's disk cache)."""
    n, k, bits, group_size, symmetric, act_order, configs = job
    torch.cuda.init()
    generator = torch.Generator(device="cuda").manual_seed(0)
    weight = random_int_weight(n, k, bits, group_size, "cuda", generator,
                               zero_points=not symmetric, act_order=act_order)
    for config in configs:
        x = torch.zeros(min(config.block_m, 16), k, device="cuda", dtype=torch.bfloat16)
        try:
            int_gemm(x, weight, config=config)
        except Exception as exc:  # a config that does not compile is skipped by the sweep
            print(f"compile failed {config}: {type(exc).__name__}: {exc}", flush=True)
    torch.cuda.synchronize()


def sweep(names: list[str], ms: list[int], args) -> list[dict]:
    """Each shape's decode grid at the rows up to 16 and prefill grid above: the five
    fastest per (shape, M) printed, every timing returned."""
    grids = {"decode": decode_grid(args.bits), "prefill": prefill_grid(args.bits)}
    job_args = (args.bits, args.group_size, args.symmetric, args.act_order)
    # the shapes (multiples of 16) compile alike: one shape's compiles serve them all
    work = [(*SHAPES[names[0]], *job_args, configs[i::4]) for configs in grids.values()
            for i in range(4)]
    with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(work))) as pool:
        pool.map(_compile, work)
    results = []
    for name in names:
        n, k = SHAPES[name]
        ws = int_weights(n, k, args, copies_over(n * k * args.bits // 8))
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            timings = []
            for config in grids["decode" if m <= DECODE_MAX_M else "prefill"]:
                try:
                    t = timed(lambda x_, w_, c=config: int_gemm(x_, w_, config=c), ws, x,
                              args.calls, args.replays)
                    err = rel_err(ws[0], m, config)
                except Exception as exc:
                    print(f"{name} M={m} {config}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                timings.append((t, config, err))
                results.append({"shape": name, "m": m, "config": vars(config), "us": t,
                                "err": err})
            timings.sort(key=lambda r: r[0])
            print(f"\n{name} N={n} K={k} M={m}:", flush=True)
            for t, config, err in timings[:5]:
                print(f"  {t:8.1f} us  {config}  err {err:.1e}"
                      + ("" if err < 1e-2 else " FAILED"), flush=True)
        del ws
        torch.cuda.empty_cache()
    return results


def print_table(rows: list[dict], args) -> None:
    print(f"\n{torch.cuda.get_device_name()}, int{args.bits} group {args.group_size}, "
          f"{'symmetric' if args.symmetric else 'zero points'}"
          f"{', act-order' if args.act_order else ''}; bf16 x; median of {args.replays} graph "
          f"replays of {args.calls} calls (weights rotated, > L2)")
    print("| shape | M | int us | int GB/s | torch bf16 us | torch GB/s | worker bf16 us | "
          "int speedup | err |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        worker = f"{r['worker_bf16_us']:.1f}" if "worker_bf16_us" in r else "-"
        best_bf16 = min(r["torch_us"], r.get("worker_bf16_us", r["torch_us"]))
        print(f"| {r['shape']} | {r['m']} | {r['int_us']:.1f} | "
              f"{r['int_bytes'] / r['int_us'] / 1e3:.0f} | {r['torch_us']:.1f} | "
              f"{r['bf16_bytes'] / r['torch_us'] / 1e3:.0f} | {worker} | "
              f"{best_bf16 / r['int_us']:.2f}x | {r['err']:.1e} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--m", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=128, help="-1: channel-wise")
    parser.add_argument("--symmetric", action="store_true", help="no zero points")
    parser.add_argument("--act-order", action="store_true", help="a random input order")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-m", default="1,16,256,4096")
    parser.add_argument("--jobs", type=int, default=12)
    args = parser.parse_args()
    names = args.shapes.split(",")
    results = {"device": torch.cuda.get_device_name(), "args": vars(args)}
    if args.sweep:
        results["sweep"] = sweep(names, [int(m) for m in args.sweep_m.split(",")], args)
    rows = [row for name in names
            for row in table_rows(name, [int(m) for m in args.m.split(",")], args)]
    results["rows"] = rows
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "int_gemm.json").write_text(json.dumps(results, indent=1))
    print_table(rows, args)


if __name__ == "__main__":
    main()
