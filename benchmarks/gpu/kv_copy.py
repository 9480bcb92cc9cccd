"""Host tier <-> GPU copy speed, alone (issue 14): what a load or a store of KV blocks
costs without the stack around it.

Times, with CUDA events and host wall time, on a real arena in /dev/shm mapped and
registered the way the worker does it (services/worker/kv_tiers.py):

- ``raw``: one big host->device copy from the registered arena, and the same from
  cudaHostAlloc'd memory (the link's ceiling), and one 2 MiB copy per block;
- ``load``/``store``: ``KvTiers.load`` / ``KvTiers.store`` of N blocks, random slots into
  random blocks (the worst case: no runs), for each staging size given.

    python3 benchmarks/gpu/kv_copy.py --num-blocks 1024 --staging-mib 32,128
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from services.worker.kv_tiers import KvTiers
from shared.kv_arena import KvArena

# dummy Llama-3.1-8B: 32 layers, K and V, 16-token blocks, 8 KV heads of 128, bf16
LAYOUT = dict(num_layers=32, block_size=16, num_kv_heads=8, head_dim=128)


def _timed(fn, repeats: int) -> dict:
    """Median of ``repeats`` runs: device ms (events on the current stream) and host ms."""
    device_ms, host_ms = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        started = time.perf_counter()
        start.record()
        fn()
        end.record()
        host_ms.append((time.perf_counter() - started) * 1e3)
        torch.cuda.synchronize()
        device_ms.append(start.elapsed_time(end))
    return {"device_ms": sorted(device_ms)[len(device_ms) // 2],
            "host_ms": sorted(host_ms)[len(host_ms) // 2]}


def _gbps(num_bytes: int, ms: float) -> float:
    return round(num_bytes / ms / 1e6, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=1024, help="blocks per copy")
    parser.add_argument("--num-slots", type=int, default=3072)
    parser.add_argument("--num-cache-blocks", type=int, default=4096)
    parser.add_argument("--staging-mib", default="32,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--arena-dir", default="/dev/shm")
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    device = torch.device("cuda")
    dtype = torch.bfloat16
    layers, block_size, heads, head_dim = (LAYOUT[k] for k in
                                           ("num_layers", "block_size", "num_kv_heads", "head_dim"))
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], as the worker's cache
    kv_cache = torch.randn(layers, 2, args.num_cache_blocks, block_size, heads, head_dim,
                           dtype=dtype, device=device)
    slot_nbytes = layers * 2 * block_size * heads * head_dim * kv_cache.element_size()
    path = Path(tempfile.mkdtemp(dir=args.arena_dir)) / "arena"
    arena = KvArena.create(path, args.num_slots, slot_nbytes, "kvcopybench")
    arena.slots()[:] = 1  # touch every page (tmpfs is sparse)
    results: dict = {"slot_nbytes": slot_nbytes, "num_blocks": args.num_blocks}
    n = args.num_blocks
    num_bytes = n * slot_nbytes
    rng = random.Random(0)
    slot_ids = rng.sample(range(args.num_slots), n)
    # loads and stores use the first half of the cache; the round trip loads into the second
    half = args.num_cache_blocks // 2
    block_ids = rng.sample(range(half), n)
    other_blocks = rng.sample(range(half, args.num_cache_blocks), n)
    blocks = kv_cache.permute(2, 0, 1, 3, 4, 5)  # [num_blocks, layers, 2, block_size, ...]

    for staging_mib in [int(x) for x in args.staging_mib.split(",")]:
        tiers = KvTiers(kv_cache, KvArena.attach(path), max_staging_bytes=staging_mib << 20)
        results["pinned"] = tiers.pinned
        # correctness first: blocks stored, then loaded into other blocks, are equal
        kv_cache.normal_()
        tiers.store(block_ids, slot_ids)
        tiers.synchronize()
        tiers.completed()
        tiers.load(slot_ids, other_blocks)
        torch.cuda.synchronize()
        results[f"round_trip_equal_{staging_mib}MiB"] = bool(torch.equal(blocks[block_ids],
                                                                          blocks[other_blocks]))
        if staging_mib == int(args.staging_mib.split(",")[0]):
            # the link alone: one copy of n slots, from the arena and from cudaHostAlloc
            dest = torch.empty(n * slot_nbytes, dtype=torch.uint8, device=device)
            arena_bytes = tiers.slots[:n].view(-1).view(torch.uint8)
            t = _timed(lambda: dest.copy_(arena_bytes, non_blocking=True), args.repeats)
            results["raw_arena_one_copy"] = {**t, "GB/s": _gbps(num_bytes, t["device_ms"])}
            host = torch.empty(n * slot_nbytes, dtype=torch.uint8, pin_memory=True)
            t = _timed(lambda: dest.copy_(host, non_blocking=True), args.repeats)
            results["raw_hostalloc_one_copy"] = {**t, "GB/s": _gbps(num_bytes, t["device_ms"])}
            t = _timed(lambda: host.copy_(dest, non_blocking=True), args.repeats)
            results["raw_hostalloc_d2h"] = {**t, "GB/s": _gbps(num_bytes, t["device_ms"])}
            per_block = dest.view(n, slot_nbytes)
            slots_u8 = tiers.slots.view(args.num_slots, -1).view(torch.uint8)

            def per_block_copies() -> None:
                for index, slot_id in enumerate(slot_ids):
                    per_block[index].copy_(slots_u8[slot_id], non_blocking=True)
            t = _timed(per_block_copies, args.repeats)
            results["raw_arena_per_block"] = {**t, "GB/s": _gbps(num_bytes, t["device_ms"])}
            del dest, host
        timings = []  # the load's own events: it runs on the load stream, not the current one
        t = _timed(lambda: timings.append(tiers.load(slot_ids, block_ids)), args.repeats)
        torch.cuda.synchronize()
        load_ms = sorted(timing.start.elapsed_time(timing.end) for timing in timings)
        t["device_ms"] = load_ms[len(load_ms) // 2]
        results[f"load_staging_{staging_mib}MiB"] = {**t, "GB/s": _gbps(num_bytes, t["device_ms"])}

        def store() -> None:
            tiers.store(block_ids, slot_ids)
            tiers.synchronize()
            tiers.completed()
        t = _timed(store, args.repeats)
        results[f"store_staging_{staging_mib}MiB"] = {**t, "GB/s": _gbps(num_bytes, t["host_ms"])}
        tiers.close()
    arena.close()
    arena.unlink()
    print(json.dumps(results, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
