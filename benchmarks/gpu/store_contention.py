"""What KV stores running beside the forward cost the forward (issue 14, offload at 0% hits).

A stand-in step: bf16 GEMMs of a decode-sized batch through Llama-3.1-8B's shapes (about
the time of a 256-sequence decode step), then the sampled tokens' small device -> host copy
and a wait for it, as the worker reads a step back. Timed per step (host wall) for:

- ``alone``: no copies beside it;
- ``stores``: ``KvTiers.store`` of ``--store-blocks`` blocks queued before every step (each
  the gather into staging and the device -> host copies, on the copy stream), as the
  worker queues a step's stores after its forward;
- ``d2h_only``: the same bytes as one device -> host copy per step, no gather (is it the
  link's queue or the gather's SMs?);
- ``gather_only``: the gather alone, no host copy.

Also the small copy's own latency (its event after the forward's) in each case: a token
readback queued behind a store's copies would wait for them.

    python3 -m benchmarks.gpu.store_contention --store-blocks 64 --steps 100
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from services.worker.kv_tiers import KvTiers
from shared.kv_arena import KvArena

LAYOUT = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128)  # dummy 8B
SHAPES = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]  # qkv, o, gate_up, down


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256, help="the batch's tokens")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--store-blocks", default="16,64,256", help="blocks stored per step")
    parser.add_argument("--num-cache-blocks", type=int, default=4096)
    parser.add_argument("--num-slots", type=int, default=4096)
    parser.add_argument("--arena-dir", default="/dev/shm")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    device, dtype = torch.device("cuda"), torch.bfloat16
    layers, block_size, heads, head_dim = (LAYOUT[k] for k in
                                           ("num_layers", "block_size", "num_kv_heads", "head_dim"))
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], as the worker's cache
    kv_cache = torch.randn(layers, 2, args.num_cache_blocks, block_size, heads, head_dim,
                           dtype=dtype, device=device)
    slot_nbytes = layers * 2 * block_size * heads * head_dim * kv_cache.element_size()
    path = Path(tempfile.mkdtemp(dir=args.arena_dir)) / "arena"
    arena = KvArena.create(path, args.num_slots, slot_nbytes, "contention")
    arena.slots()[:] = 1
    tiers = KvTiers(kv_cache, KvArena.attach(path))
    weights = [torch.randn(n, k, dtype=dtype, device=device) * 0.01 for n, k in SHAPES]
    x = torch.randn(args.rows, 4096, dtype=dtype, device=device)
    tokens = torch.zeros(args.rows, dtype=torch.int64, device=device)
    host_tokens = torch.empty(args.rows, dtype=torch.int64, pin_memory=True)
    rng = random.Random(0)

    def forward() -> None:  # [rows, 4096] through every layer's GEMMs
        for _ in range(args.layers):
            h = x @ weights[0].T
            h = x @ weights[1].T
            g = x @ weights[2].T  # [rows, 28672]
            h = g[:, :14336] @ weights[3].T
        tokens.copy_(h[:, 0].to(torch.int64))

    def run(case: str, num_blocks: int) -> dict:
        step_ms, readback_ms = [], []
        staging = torch.empty(num_blocks, *tiers.slot_shape, dtype=dtype, device=device)
        host = torch.empty(staging.shape, dtype=dtype, pin_memory=True)
        copy_stream = torch.cuda.Stream()
        for step in range(args.steps + 5):
            block_ids = rng.sample(range(args.num_cache_blocks), num_blocks)
            slot_ids = rng.sample(range(args.num_slots), num_blocks)
            started = time.perf_counter()
            forward_done = torch.cuda.Event(enable_timing=True)
            copied = torch.cuda.Event(enable_timing=True)
            forward()
            forward_done.record()
            host_tokens.copy_(tokens, non_blocking=True)
            copied.record()
            if case == "stores":  # queued after the forward, as the worker's
                tiers.store(block_ids, slot_ids)
            elif case in ("d2h_only", "gather_only"):
                copy_stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(copy_stream):
                    if case == "gather_only":
                        torch.index_select(tiers.blocks, 0,
                                           torch.tensor(block_ids, device=device), out=staging)
                    else:
                        host.copy_(staging, non_blocking=True)
            copied.synchronize()
            if step >= 5:
                step_ms.append((time.perf_counter() - started) * 1e3)
                readback_ms.append(forward_done.elapsed_time(copied))
            tiers.completed()
        torch.cuda.synchronize()
        tiers.completed()
        return {"step_ms_median": round(statistics.median(step_ms), 3),
                "step_ms_mean": round(statistics.fmean(step_ms), 3),
                "readback_ms_median": round(statistics.median(readback_ms), 3),
                "readback_ms_p90": round(sorted(readback_ms)[int(0.9 * len(readback_ms))], 3)}

    results: dict = {"rows": args.rows, "slot_nbytes": slot_nbytes, "pinned": tiers.pinned,
                     "alone": run("alone", 1)}
    for num_blocks in (int(n) for n in args.store_blocks.split(",")):
        for case in ("stores", "d2h_only", "gather_only"):
            results[f"{case}_{num_blocks}"] = run(case, num_blocks)
        results[f"alone_after_{num_blocks}"] = run("alone", 1)
    tiers.close()
    arena.close()
    arena.unlink()
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
