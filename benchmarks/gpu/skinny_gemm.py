"""Issue 15 item 5: the skinny GEMM (kernels/skinny_gemm.py) against torch F.linear (cuBLAS)
at decode batch sizes, on the Llama-3.1-8B projections.

    python -m benchmarks.gpu.skinny_gemm                  # the table's configs, M = 1, 2, 4, 8, 16
    python -m benchmarks.gpu.skinny_gemm --sweep          # try the grids below; best per shape
    python -m benchmarks.gpu.skinny_gemm --shapes o_proj,down --m 1,8
    python -m benchmarks.gpu.skinny_gemm --sweep --gated --shapes tp2_gate_up  # + SwiGLU

Each timing is one CUDA graph of ``--calls`` back-to-back calls, each on the next of several
copies of the weight (together over 1 GiB, so nothing is served from the 50 MB L2), replayed
``--replays`` times: the median replay over the calls, as a decode step's graph runs them.
Bytes are the weight read once plus x read and y written; TB/s is those over the time.
Every config is first checked against F.linear in fp32 (relative error) and for batch
invariance (row 0 alone equals row 0 of the M-row batch, bitwise). ``--sweep`` compiles the
grid in parallel processes first (Triton's disk cache), then times each at ``--sweep-m``.
``--gated`` times the gate_up launch with SwiGLU in its epilogue (``skinny_gemm_silu_and_mul``,
block_n counting output columns) against F.linear + silu_and_mul.
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
from kernels.activation import silu_and_mul
from kernels.skinny_gemm import (MAX_M, SkinnyConfig, config_for, gated_config_for,
                                 skinny_gemm, skinny_gemm_silu_and_mul)

SHAPES = {  # name: (N, K) of the Llama-3.1-8B projections
    "qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
    "down": (4096, 14336), "lm_head": (128256, 4096),
    # Llama-3.2-1B's (speculative decoding's draft model for the 8B; --shapes 1b_qkv,...)
    "1b_qkv": (3072, 2048), "1b_o_proj": (2048, 2048), "1b_gate_up": (16384, 2048),
    "1b_down": (2048, 8192), "1b_lm_head": (128256, 2048),
    # one rank's of the 8B at --tensor-parallel-size 2 (--shapes tp2_qkv,...)
    "tp2_qkv": (3072, 4096), "tp2_o_proj": (4096, 2048), "tp2_gate_up": (14336, 4096),
    "tp2_down": (4096, 7168), "tp2_lm_head": (64128, 4096),
}


def launcher(gated: bool):
    """The timed op (x, w, config): the plain launch, or the gated one (gate_up + SwiGLU)."""
    if gated:
        return lambda x, w, config=None: skinny_gemm_silu_and_mul(x, w, config=config)
    return lambda x, w, config=None: skinny_gemm(x, w, config=config)


def baseline(gated: bool):
    """What the launch replaces: F.linear (cuBLAS), and with ``gated`` silu_and_mul after it."""
    return (lambda x, w: silu_and_mul(F.linear(x, w))) if gated else F.linear


def sweep_grid(n: int, k: int, gated: bool = False) -> list[SkinnyConfig]:
    """The grid of the second sweep (2026-11-23), less its programmatic-dependent-launch half,
    which won nowhere; the first also tried BLOCK_K 512, five stages and an FMA-unit path.
    The gated launch does not split K."""
    splits = (1,) if n >= 16384 or gated else (1, 2, 4)
    return [SkinnyConfig(block_n, block_k, split, warps, stages)
            for block_n, block_k, warps, stages, split in itertools.product(
                (32, 64, 128), (128, 256), (4, 8), (3, 4), splits)]


def weights(n: int, k: int, dtype: torch.dtype) -> list[torch.Tensor]:
    copies = max(2, -(-(1 << 30) // (n * k * dtype.itemsize)))
    return [torch.randn(n, k, device="cuda", dtype=torch.float32).to(dtype) / k ** 0.5
            for _ in range(copies)]


def graph_time_us(fn, ws: list[torch.Tensor], x: torch.Tensor, calls: int, replays: int) -> float:
    """Median over replays of one graph of ``calls`` calls (rotating weights), per call."""
    return graph_us(lambda i: fn(x, ws[i % len(ws)]), calls, replays, warm_calls=2)


def check(config: SkinnyConfig | None, w: torch.Tensor, m: int, gated: bool = False
          ) -> tuple[float, bool]:
    """(relative error against fp32, row 0 alone == row 0 in the batch)."""
    x = torch.randn(m, w.shape[1], device="cuda", dtype=w.dtype)
    op = launcher(gated)
    y = op(x, w, config)
    ref = F.linear(x.float(), w.float())
    if gated:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    err = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    alone = op(x[:1].clone(), w, config)
    return err, bool(torch.equal(alone[0], y[0])) and not bool(y.isnan().any())


def _compile(job) -> None:
    """Sweep helper, in a spawned process: compile each config (fills Triton's disk cache)."""
    n, k, configs, gated = job
    torch.cuda.init()
    w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16)
    x = torch.zeros(1, k, device="cuda", dtype=torch.bfloat16)
    for config in configs:
        try:
            launcher(gated)(x, w, config)
        except Exception as exc:  # a config that does not compile is skipped by the sweep
            print(f"compile failed {config}: {type(exc).__name__}: {exc}", flush=True)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="qkv,o_proj,gate_up,down,lm_head")
    parser.add_argument("--m", default="1,2,4,8,16")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--replays", type=int, default=15)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--sweep-m", default="1,8")
    parser.add_argument("--jobs", type=int, default=12)
    parser.add_argument("--gated", action="store_true",
                        help="the gate_up launch with SwiGLU (shapes are gate_up weights)")
    args = parser.parse_args()
    dtype = torch.bfloat16
    names = args.shapes.split(",")
    results = {"device": torch.cuda.get_device_name(), "dtype": str(dtype), "rows": []}

    if args.sweep:
        jobs = []
        for name in names:
            n, k = SHAPES[name]
            grid = sweep_grid(n, k, args.gated)
            jobs += [(n, k, grid[i::3], args.gated) for i in range(3)]
        with multiprocessing.get_context("spawn").Pool(min(args.jobs, len(jobs))) as pool:
            pool.map(_compile, jobs)
        print("compiled", flush=True)
        for name in names:
            n, k = SHAPES[name]
            ws = weights(n, k, dtype)
            sweep_ms = [int(m) for m in args.sweep_m.split(",")]
            xs = {m: torch.randn(m, k, device="cuda", dtype=dtype) for m in sweep_ms}
            cublas = {m: graph_time_us(baseline(args.gated), ws, xs[m], args.calls,
                                       args.replays)
                      for m in sweep_ms}
            rows = []
            for config in sweep_grid(n, k, args.gated):
                try:
                    err, invariant = check(config, ws[0], max(sweep_ms), args.gated)
                    op = launcher(args.gated)
                    times = {m: graph_time_us(lambda x, w, c=config: op(x, w, c),
                                              ws, xs[m], args.calls, args.replays)
                             for m in sweep_ms}
                except Exception as exc:
                    print(f"{name} {config}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                ok = err < 1e-2 and invariant
                rows.append((times[sweep_ms[0]], config, times, err, ok))
                results["rows"].append({"shape": name, "config": vars(config), "us": times,
                                        "err": err, "invariant": invariant})
            rows.sort(key=lambda r: r[0])
            gb = n * k * dtype.itemsize / 1e9
            print(f"\n{name} N={n} K={k} ({gb:.3f} GB): cuBLAS "
                  + ", ".join(f"M={m} {t:.1f} us" for m, t in cublas.items()), flush=True)
            for t1, config, times, err, ok in rows[:5]:
                print(f"  {config}  " + ", ".join(f"M={m} {t:.1f}" for m, t in times.items())
                      + f"  ({gb / t1 * 1e3:.2f} TB/s) err {err:.1e}{'' if ok else ' FAILED'}")
            del ws
            torch.cuda.empty_cache()

    # the table's configs (or default_config) against cuBLAS at every M
    table = []
    for name in names:
        n, k = SHAPES[name]
        ws = weights(n, k, dtype)
        config = gated_config_for(n, k) if args.gated else config_for(n, k)
        op = launcher(args.gated)
        for m in [int(v) for v in args.m.split(",")]:
            if m > MAX_M:
                continue
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            err, invariant = check(None, ws[0], m, args.gated)
            t_cublas = graph_time_us(baseline(args.gated), ws, x, args.calls, args.replays)
            t_skinny = graph_time_us(lambda x_, w_: op(x_, w_), ws, x, args.calls,
                                     args.replays)
            num_bytes = (n * k + m * k + m * n) * dtype.itemsize
            row = {"shape": name, "n": n, "k": k, "m": m, "config": vars(config),
                   "cublas_us": t_cublas, "skinny_us": t_skinny,
                   "cublas_tb_s": num_bytes / t_cublas / 1e6,
                   "skinny_tb_s": num_bytes / t_skinny / 1e6, "rel_err": err,
                   "batch_invariant": invariant}
            results["rows"].append(row)
            table.append(row)
        del ws
        torch.cuda.empty_cache()
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "skinny_gemm.json").write_text(json.dumps(results, indent=1))
    print(f"\n{results['device']}, {dtype}, median of {args.replays} graph replays of "
          f"{args.calls} calls (weights rotated, > L2)")
    print("| shape | N | K | M | cuBLAS us | TB/s | skinny us | TB/s | speedup | err | invariant |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in table:
        print(f"| {r['shape']} | {r['n']} | {r['k']} | {r['m']} | {r['cublas_us']:.1f} | "
              f"{r['cublas_tb_s']:.2f} | {r['skinny_us']:.1f} | {r['skinny_tb_s']:.2f} | "
              f"{r['cublas_us'] / r['skinny_us']:.2f}x | {r['rel_err']:.1e} | "
              f"{r['batch_invariant']} |")


if __name__ == "__main__":
    main()
