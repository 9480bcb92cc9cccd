"""The fused MoE kernels (kernels/fused_moe.py) on the MoE models' layer shapes: times, the
config sweep that writes kernels/moe_configs.json, and a check against the torch reference.

    python -m benchmarks.gpu.fused_moe                     # the table's plans (or the default)
    python -m benchmarks.gpu.fused_moe --check             # Triton vs fused_moe_ref, max errors
    python -m benchmarks.gpu.fused_moe --sweep --out /tmp/moe_configs.json
    python -m benchmarks.gpu.fused_moe --sweep --shapes qwen3-30b-a3b --dtypes bf16 --rows 1,8

Each timing is one CUDA graph of ``--calls`` back-to-back ``fused_moe`` calls (route not
included), each with its own random routing from a seeded generator (a step's layers touch
other experts, so nothing is served from the 50 MB L2), replayed several times: the median
replay over the calls. MB is the touched experts' weight bytes, read once per call; TB/s is
those over the time. ``--sweep`` compiles the candidates in parallel processes first
(Triton's disk cache), then per row count picks BLOCK_M and each GEMM's config by coordinate
descent (gate_up with the default down, then down with the best gate_up), prints the best
beside the untuned default, and writes the winners (and one batch-invariant plan per shape:
the bucket winner with the best geometric-mean slowdown over all buckets) as JSON to --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import statistics
import time

import torch
import triton

from benchmarks.gpu.common import graph_us
from kernels.fp8 import FP8_DTYPE
from kernels.fused_moe import fused_moe_ref, fused_moe_triton
from kernels.moe_configs import (BUCKETS, INVARIANT, MoeConfig, MoePlan, config_source,
                                 default_plan, plan_for, shape_key)
from kernels.moe_routing import route

SHAPES = {  # name: (num_experts, top_k, hidden, inter)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}
DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}
SMEM_BYTES = 200 * 1024  # of the H200's 227 KiB a block may take, with room for the epilogue


def make_layer(shape: tuple, dtype: torch.dtype, seed: int = 0, fill: bool = True) -> dict:
    """Random expert weights of the shape (FP8: per-output-channel quantized, with scales);
    ``fill`` False: zeros (enough to compile)."""
    num_experts, _, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(seed)
    layer = {}
    for name, rows, cols in (("w13", 2 * inter, hidden), ("w2", hidden, inter)):
        weight = torch.zeros(num_experts, rows, cols, dtype=torch.bfloat16, device="cuda")
        for e in range(num_experts if fill else 0):  # an expert at a time: no fp32 copy
            weight[e] = torch.randn(rows, cols, generator=gen, device="cuda") / cols ** 0.5
        if dtype == FP8_DTYPE:
            scale = weight.abs().amax(dim=2).float().clamp(min=1e-12) / 448.0  # [E, rows]
            layer[name + "_scale"] = scale
            weight = (weight / scale[:, :, None]).to(FP8_DTYPE)
        layer[name] = weight
    return layer


def routings(shape: tuple, num_tokens: int, count: int, seed: int = 1) -> list[tuple]:
    """``count`` random routings (renormalized top-k of random logits) of num_tokens rows."""
    num_experts, top_k, hidden, _ = shape
    gen = torch.Generator(device="cuda").manual_seed(seed + num_tokens)
    return [route(torch.randn(num_tokens, num_experts, generator=gen, device="cuda"), top_k,
                  True) for _ in range(count)]


def touched_mb(layer: dict, shape: tuple, routes: list[tuple]) -> float:
    """Mean weight megabytes a call reads: its touched experts' w13 and w2, once each."""
    num_experts = shape[0]
    per_expert = sum(layer[n][0].numel() * layer[n].element_size() for n in ("w13", "w2"))
    touched = [torch.unique(ids[ids < num_experts]).numel() for _, ids in routes]
    return statistics.mean(touched) * per_expert / 1e6


class Bench:
    """One shape and dtype: its layer, and per row count an x and a routing per call."""

    def __init__(self, name: str, dtype_name: str, calls: int, replays: int,
                 fill: bool = True):
        self.name, self.dtype_name = name, dtype_name
        self.shape, self.dtype = SHAPES[name], DTYPES[dtype_name]
        self.layer = make_layer(self.shape, self.dtype, fill=fill)
        self.calls, self.replays = calls, replays
        self.inputs: dict[int, tuple] = {}

    def rows_inputs(self, num_tokens: int) -> tuple:
        if num_tokens not in self.inputs:
            gen = torch.Generator(device="cuda").manual_seed(num_tokens)
            x = torch.randn(num_tokens, self.shape[2], generator=gen, device="cuda")
            self.inputs[num_tokens] = (x.to(torch.bfloat16),
                                       routings(self.shape, num_tokens, self.calls))
        return self.inputs[num_tokens]

    def run(self, num_tokens: int, plan: MoePlan | None, i: int = 0) -> torch.Tensor:
        x, routes = self.rows_inputs(num_tokens)
        weights, ids = routes[i % len(routes)]
        lay = self.layer
        return fused_moe_triton(x, lay["w13"], lay["w2"], weights, ids, lay.get("w13_scale"),
                                lay.get("w2_scale"), plan=plan)

    def time_us(self, num_tokens: int, plan: MoePlan | None) -> float:
        """Fewer calls and replays where a call is long (a 4096-row Mixtral step: ~10 ms)."""
        calls = self.calls if num_tokens <= 256 else max(2, self.calls // 4)
        replays = self.replays if num_tokens <= 256 else 3
        return graph_us(lambda i: self.run(num_tokens, plan, i), calls, replays)

    def default(self, num_tokens: int) -> MoePlan:
        return default_plan(self.shape[0], self.shape[1], num_tokens)

    def key(self) -> str:
        num_experts, _, hidden, inter = self.shape
        return shape_key(num_experts, inter, hidden, self.dtype)


def block_ms(shape: tuple, num_tokens: int) -> list[int]:
    """BLOCK_M candidates: up to twice the mean pairs per expert (16 at least)."""
    mean = num_tokens * shape[1] / shape[0]
    return [bm for bm in (16, 32, 64, 128) if bm <= max(16, 2 * mean)]


def gemm_candidates(block_m: int, weight_bytes: int, gated: bool) -> list[MoeConfig]:
    """One GEMM's configs at a BLOCK_M: block_n {32, 64, 128}, block_k {64, 128, 256} (256 up
    to 32 rows), warps {4, 8} (8 from 4096 outputs a program), stages {2, 3, 4} (3, 4 from
    64 rows), none that overflows shared memory (x tile in bf16, one or two weight tiles)."""
    small = block_m <= 32
    configs = []
    for bn, bk, warps, stages in itertools.product((32, 64, 128), (64, 128, 256), (4, 8),
                                                   (2, 3, 4)):
        smem = (block_m * bk * 2 + (2 if gated else 1) * bn * bk * weight_bytes) * stages
        if ((bk == 256 and not small) or (stages == 2 and not small) or smem > SMEM_BYTES
                or (warps == 8 and block_m * bn < 4096)):
            continue
        configs.append(MoeConfig(block_m, bn, bk, 1 if block_m == 16 else 8, warps, stages))
    return configs


def all_candidates(bench: Bench, rows: list[int]) -> list[MoePlan]:
    """Every (gate_up, down) pair the sweep may launch, as plans: what to compile."""
    plans = set()
    wbytes = bench.layer["w13"].element_size()
    for bm in sorted({bm for n in rows for bm in block_ms(bench.shape, n)}):
        gate_ups = gemm_candidates(bm, wbytes, True)
        downs = gemm_candidates(bm, wbytes, False)
        for a, b in itertools.zip_longest(gate_ups, downs):
            plans.add(MoePlan(a or gate_ups[0], b or downs[0]))
    return sorted(plans, key=str)


def _compile(job) -> None:
    """Sweep helper, in a spawned process: run each plan once at one row (fills Triton's disk
    cache; the kernels do not specialize on the row count)."""
    name, dtype_name, plans = job
    bench = Bench(name, dtype_name, calls=1, replays=1, fill=False)
    for plan in plans:
        try:
            bench.run(1, plan)
        except Exception as exc:  # a config that does not compile is skipped by the sweep
            print(f"compile failed {plan}: {type(exc).__name__}: {exc}", flush=True)
    torch.cuda.synchronize()


def best_of(bench: Bench, num_tokens: int, plans: list[MoePlan]) -> tuple[float, MoePlan]:
    timed = []
    for plan in plans:
        try:
            timed.append((bench.time_us(num_tokens, plan), plan))
        except Exception as exc:
            print(f"  {plan}: {type(exc).__name__}: {exc}", flush=True)
    return min(timed, key=lambda t: t[0])


def sweep_rows(bench: Bench, num_tokens: int) -> tuple[float, MoePlan]:
    """Coordinate descent per BLOCK_M: gate_up against the default down, then down."""
    wbytes = bench.layer["w13"].element_size()
    best = None
    for bm in block_ms(bench.shape, num_tokens):
        down = MoeConfig(bm, 64, 64 if bm > 32 else 128, 1 if bm == 16 else 8)
        _, plan = best_of(bench, num_tokens, [MoePlan(c, down) for c in
                                              gemm_candidates(bm, wbytes, True)])
        result = best_of(bench, num_tokens, [MoePlan(plan.gate_up, c) for c in
                                             gemm_candidates(bm, wbytes, False)])
        best = result if best is None or result[0] < best[0] else best
    return best


def pick_invariant(bench: Bench, winners: dict[int, MoePlan], best_us: dict[int, float]
                   ) -> MoePlan:
    """The winner with the least geometric-mean slowdown at a few row counts."""
    probe = [n for n in (1, 16, 256, 4096) if n in winners] or list(winners)
    scores = {}
    for plan in set(winners.values()):
        ratios = [bench.time_us(n, plan) / best_us[n] for n in probe]
        scores[plan] = statistics.geometric_mean(ratios)
    return min(scores, key=scores.get)


def sweep(benches_spec: list[tuple[str, str]], rows: list[int], args) -> dict:
    jobs = []
    for name, dtype_name in benches_spec:
        plans = all_candidates(_shape_stub(name, dtype_name), rows)
        jobs += [(name, dtype_name, plans[i::args.jobs]) for i in range(args.jobs)]
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
        pool.map(_compile, jobs)
    print(f"compiled {sum(len(j[2]) for j in jobs)} plans in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    table = {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
             "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "shapes": {},
             "results": []}
    for name, dtype_name in benches_spec:
        bench = Bench(name, dtype_name, args.calls, args.replays)
        winners, best_us = {}, {}
        for n in rows:
            best_us[n], winners[n] = sweep_rows(bench, n)
            default_us = bench.time_us(n, bench.default(n))
            mb = touched_mb(bench.layer, bench.shape, bench.rows_inputs(n)[1])
            print(f"{name} {dtype_name} rows={n}: best {best_us[n]:.1f} us "
                  f"({mb / best_us[n]:.2f} TB/s of {mb:.0f} MB), default {default_us:.1f} us "
                  f"-> {winners[n]}", flush=True)
            table["results"].append({"shape": name, "dtype": dtype_name, "rows": n,
                                     "best_us": best_us[n], "default_us": default_us,
                                     "mb": mb, "plan": winners[n].to_json()})
        entry = {str(n): plan.to_json() for n, plan in winners.items()}
        entry[INVARIANT] = pick_invariant(bench, winners, best_us).to_json()
        table["shapes"][bench.key()] = entry
        print(f"{name} {dtype_name} invariant -> {entry[INVARIANT]}", flush=True)
        del bench
        torch.cuda.empty_cache()
    return table


def _shape_stub(name: str, dtype_name: str) -> Bench:
    """A Bench without its layer (candidates need only the shape and weight bytes)."""
    stub = Bench.__new__(Bench)
    stub.shape, stub.dtype = SHAPES[name], DTYPES[dtype_name]
    stub.layer = {"w13": torch.empty(0, dtype=stub.dtype)}
    return stub


def check(benches_spec: list[tuple[str, str]], rows: list[int]) -> None:
    """Triton against fused_moe_ref on the GPU: max abs and relative error, and a row alone
    against the same row in the batch under batch invariance."""
    for name, dtype_name in benches_spec:
        bench = Bench(name, dtype_name, calls=1, replays=1)
        lay = bench.layer
        for n in rows:
            x, routes = bench.rows_inputs(n)
            weights, ids = routes[0]
            args = (lay["w13"], lay["w2"], weights, ids, lay.get("w13_scale"), lay.get("w2_scale"))
            out = fused_moe_triton(x, *args)
            ref = fused_moe_ref(x, *args)
            err = (out.float() - ref.float()).abs().max().item()
            rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
            batch = fused_moe_triton(x, *args, batch_invariant=True)
            alone = fused_moe_triton(x[:1].clone(), lay["w13"], lay["w2"], weights[:1],
                                     ids[:1], *args[4:], batch_invariant=True)
            invariant = bool(torch.equal(alone[0], batch[0]))
            print(f"check {name} {dtype_name} rows={n}: max abs err {err:.3e}, rel {rel:.2e}, "
                  f"ref max {ref.float().abs().max().item():.3f}, invariant {invariant}"
                  f"{'' if rel < 1e-2 and invariant else '  FAILED'}", flush=True)
        del bench
        torch.cuda.empty_cache()


def time_table(benches_spec: list[tuple[str, str]], rows: list[int], args) -> None:
    """The plans the product runs (kernels/moe_configs.json, or the default) at each count."""
    for name, dtype_name in benches_spec:
        bench = Bench(name, dtype_name, args.calls, args.replays)
        num_experts, top_k, hidden, inter = bench.shape
        print(f"{name} {dtype_name}: {config_source(num_experts, inter, hidden, bench.dtype)}",
              flush=True)
        for n in rows:
            plan = plan_for(num_experts, top_k, inter, hidden, bench.dtype, n)
            us = bench.time_us(n, plan)
            mb = touched_mb(bench.layer, bench.shape, bench.rows_inputs(n)[1])
            print(f"  rows={n}: {us:.1f} us ({mb / us:.2f} TB/s of {mb:.0f} MB) {plan}",
                  flush=True)
        del bench
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--rows", default=",".join(map(str, BUCKETS)))
    parser.add_argument("--calls", type=int, default=12)
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--out", default="", help="--sweep: where to write the table (JSON)")
    parser.add_argument("--jobs", type=int, default=14, help="--sweep: compiling processes")
    args = parser.parse_args()
    spec = [(s, d) for s in args.shapes.split(",") for d in args.dtypes.split(",")]
    rows = [int(n) for n in args.rows.split(",")]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}", flush=True)
    if args.check:
        check(spec, [n for n in rows if n <= 512])
    elif args.sweep:
        table = sweep(spec, rows, args)
        text = json.dumps(table, indent=1)
        if args.out:
            with open(args.out, "w") as f:
                f.write(text + "\n")
            print(f"wrote {args.out}", flush=True)
        else:
            print(text, flush=True)
    else:
        time_table(spec, rows, args)


if __name__ == "__main__":
    main()
