"""Issue 50: GPU time of the LoRA kernels (kernels/lora.py: shrink + expand, one projection)
at Llama-3.1-8B's projections, rank 16 over 8 adapters, against the base projection's GEMM
(F.linear, bf16) and the torch path's segment ops, per row count; each timed as a CUDA
graph of ``--calls`` launches (common.graph_us), median of the replays.

    python -m benchmarks.gpu.lora_kernels [--rank 16] [--rows 1,4,16,64,256,1024,4096]

Rows are every adapter's in turn (a decode batch spread round-robin, the kernels' worst
grouping); the torch path gets the same rows sorted into 8 segments (its best case: one
segment an adapter). What the kernels add to a step is their time per projection here,
times the layers.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks.gpu.common import device_name, graph_us, save
from kernels.lora import lora_expand, lora_rows_of, lora_shrink

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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--calls", type=int, default=20, help="launches a graph holds")
    parser.add_argument("--replays", type=int, default=20)
    args = parser.parse_args()
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
