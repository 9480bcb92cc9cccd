"""A LoRA projection at decode sizes on the skinny GEMM, three ways, one H200 (issue 50): the
base GEMM alone, the GEMM then the shrink and expand launches (the two launches), and the
shrink as programs beside the GEMM's in its launch, then the expand (kernels/lora_delta.py
``LoraDelta.beside``). o_proj and down_proj run as the decoder runs them, with the residual
add and RMSNorm in the split reduce (the two launches before the GEMM, into the residual).
Time per call: a CUDA graph of ``--calls`` back-to-back calls (PDL on, as in a decode step).

    python3 -m benchmarks.gpu.lora_beside [--rows 1,4,16] [--write]

``--write`` marks ``beside`` in kernels/lora_configs.json's plans where it beat the two
launches by at least ``--margin`` (run it after a ``lora_kernels --sweep``, which rewrites the
table without the marks)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from benchmarks.gpu.common import device_name, graph_us, save
from benchmarks.gpu.lora_kernels import NUM_ADAPTERS, SHAPES
from kernels import skinny_gemm
from kernels.lora import lora_rows_of
from kernels.lora_delta import LoraDelta
from kernels.lora_configs import TABLE_PATH, LoraPlan, bucket, plan_for, shape_key

NORMED = ("o_proj", "down_proj")  # projections into the residual stream, norm after


def calls_of(name: str, num_rows: int, rank: int, caps: list[int | None]):
    """[base, two launches, beside under each register cap of ``caps``] callables of one
    projection at num_rows (bf16, rows over NUM_ADAPTERS adapters), or None where the skinny
    GEMM does not serve it."""
    in_features, parts, out_features = SHAPES[name]
    width, dtype = parts * rank, torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(num_rows)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    x, weight = randn(num_rows, in_features), randn(out_features, in_features, scale=1 / 64)
    if not skinny_gemm.serves(num_rows, weight):
        return None
    lora_rows = lora_rows_of(torch.arange(num_rows, dtype=torch.int32, device="cuda")
                             % NUM_ADAPTERS)
    plan = plan_for(in_features, width, out_features, num_rows, dtype)
    args = (randn(NUM_ADAPTERS, width, in_features, scale=1 / 64),
            randn(NUM_ADAPTERS, out_features, width, scale=1 / 8), lora_rows)
    deltas = [None, LoraDelta(*args, LoraPlan(plan.shrink, plan.expand))] + [
        LoraDelta(*args, LoraPlan(plan.shrink, plan.expand, True, cap)) for cap in caps]
    if name not in NORMED:
        return [lambda _, d=d: skinny_gemm.skinny_gemm(x, weight, lora=d) for d in deltas]
    residual, norm_weight = randn(num_rows, out_features), torch.ones(out_features, device="cuda",
                                                                      dtype=dtype)
    return [lambda _, d=d: skinny_gemm.skinny_gemm_add_rms_norm(
        x, weight, None, residual, norm_weight, 1e-5, lora=d) for d in deltas]


def mark(results: list[dict], rank: int, margin: float, path: Path = TABLE_PATH) -> None:
    """``beside`` (with its best register cap) on the plans of the buckets where it won by
    ``margin``, off elsewhere."""
    table = json.loads(path.read_text())
    for r in results:
        in_features, parts, out_features = SHAPES[r["projection"]]
        key = shape_key(in_features, parts * rank, out_features, torch.bfloat16)
        entry = table["plans"].get(key, {}).get(str(bucket(r["rows"])))
        if entry is None:
            continue
        entry.pop("beside", None)
        entry.pop("beside_max_registers", None)
        if r["beside_us"] * (1 + margin) <= r["two_launches_us"]:
            entry["beside"] = True
            if r["beside_max_registers"] is not None:
                entry["beside_max_registers"] = r["beside_max_registers"]
    path.write_text(json.dumps(table, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="1,4,16")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--calls", type=int, default=200, help="calls a graph holds")
    parser.add_argument("--replays", type=int, default=5)
    parser.add_argument("--write", action="store_true")
    parser.add_argument("--margin", type=float, default=0.03)
    parser.add_argument("--max-registers", default="none,128",
                        help="register caps to time beside under ('none': no cap)")
    args = parser.parse_args()
    caps = [None if c == "none" else int(c) for c in args.max_registers.split(",")]
    results = []
    print(f"{'projection':<14}{'rows':>5}{'base us':>9}{'two launches':>14}"
          + "".join(f"{'beside/' + str(c):>14}" for c in caps))
    for name in SHAPES:
        for num_rows in map(int, args.rows.split(",")):
            calls = calls_of(name, num_rows, args.rank, caps)
            if calls is None:
                continue
            base, two, *besides = (graph_us(fn, args.calls, args.replays) for fn in calls)
            best = min(range(len(caps)), key=lambda i: besides[i])
            results.append({"projection": name, "rows": num_rows, "base_us": round(base, 2),
                            "two_launches_us": round(two, 2),
                            "beside_us": round(besides[best], 2),
                            "beside_max_registers": caps[best],
                            "beside_us_by_cap": {str(c): round(t, 2)
                                                 for c, t in zip(caps, besides)}})
            print(f"{name:<14}{num_rows:>5}{base:>9.2f}{two:>14.2f}"
                  + "".join(f"{t:>14.2f}" for t in besides), flush=True)
    save(f"lora_beside_r{args.rank}", {"benchmark": "lora_beside", "device": device_name(),
                                       "results": results})
    if args.write:
        mark(results, args.rank, args.margin)


if __name__ == "__main__":
    main()
