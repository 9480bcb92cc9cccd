"""Host tier <-> GPU copy speed, alone (issue 14): what a load or a store of KV blocks
costs without the stack around it.

Times, with CUDA events and host wall time, on a real arena in /dev/shm mapped and
registered the way the worker does it (services/worker/kv_tiers.py):

- ``raw``: one big host->device copy from the registered arena, and the same from
  cudaHostAlloc'd memory (the link's ceiling), and one 2 MiB copy per block;
- ``load``/``store``: ``KvTiers.load`` / ``KvTiers.store`` of N blocks, random slots into
  random blocks (the worst case: no runs), for each staging size given.
- ``--load-groups 1,2,4,8`` (instead of the above): a load of ``--group-blocks`` (1,023, a
  16k-token prefix) from consecutive and from random slots in G layer groups: load ms, GB/s,
  host ms to issue it, ms until group 0 has landed; and a stand-in forward (per layer a
  GEMM reading ~one Llama-3.1-8B layer of weights for 16 tokens, and a read of the layer's
  loaded K/V) whose layer l waits for its group only, as the worker's forward does: the end
  to end ms of load + forward, against load + forward alone (``hidden_ms``).

    python3 -m benchmarks.gpu.kv_copy --num-blocks 1024 --staging-mib 32,128
    python3 -m benchmarks.gpu.kv_copy --load-groups 1,2,4,8
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


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def stand_in_forward(kv_cache: torch.Tensor, device_block_ids: torch.Tensor,
                     weight: torch.Tensor, x: torch.Tensor, layer_waits) -> None:
    """Per layer: wait for its load group (``layer_waits``, None: no wait), read its K/V of
    the loaded blocks (as attention would) and a [16, hidden] x [hidden, N] GEMM."""
    for layer in range(kv_cache.shape[0]):
        if layer_waits is not None:
            for event in layer_waits[layer]:
                torch.cuda.current_stream().wait_event(event)
        kv = kv_cache[layer].index_select(1, device_block_ids)  # [2, n, block_size, ...]
        x = (x @ weight)[:, :x.shape[1]] + kv.view(-1)[:x.shape[1]]  # [16, hidden]


def measure_groups(args, kv_cache: torch.Tensor, path: Path, num_slots: int,
                   slot_nbytes: int) -> dict:
    """--load-groups: per G and slot order, the load alone and load + stand-in forward."""
    device = kv_cache.device
    n = args.group_blocks
    rng = random.Random(1)
    block_ids = rng.sample(range(kv_cache.shape[2]), n)
    device_block_ids = torch.tensor(block_ids, device=device)
    orders = {"consecutive": list(range(n)), "random": rng.sample(range(num_slots), n)}
    # ~one Llama-3.1-8B layer of weights (218M parameters), read by a 16-token GEMM
    weight = torch.randn(4096, args.stand_in_cols, dtype=kv_cache.dtype, device=device)
    x = torch.randn(16, 4096, dtype=kv_cache.dtype, device=device)
    blocks = kv_cache.permute(2, 0, 1, 3, 4, 5)  # [num_blocks, layers, 2, block_size, ...]
    # every (slot, layer) its own int32 value, so a byte from the wrong slot or layer shows
    arena = KvArena.attach(path)
    slots = torch.from_numpy(arena.slots()).view(kv_cache.dtype) \
        .view(num_slots, *blocks.shape[1:]).view(torch.int32)  # [num_slots, layers, 2, ...]
    num_layers = kv_cache.shape[0]
    pattern = torch.arange(num_slots, dtype=torch.int32)[:, None] * 64 \
        + torch.arange(num_layers, dtype=torch.int32)  # [num_slots, layers]
    slots.copy_(pattern.view(num_slots, num_layers, 1, 1, 1, 1).expand_as(slots))
    del slots
    arena.close()
    results: dict = {}
    forward_ms = []
    for _ in range(args.repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        stand_in_forward(kv_cache, device_block_ids, weight, x, None)
        end.record()
        torch.cuda.synchronize()
        forward_ms.append(start.elapsed_time(end))
    results["forward_alone_ms"] = round(_median(forward_ms), 3)
    for num_groups in [int(g) for g in args.load_groups.split(",")]:
        tiers = KvTiers(kv_cache, KvArena.attach(path), max_staging_bytes=args.group_staging_mib
                        << 20, num_load_groups=num_groups)
        for order, slot_ids in orders.items():
            kv_cache.zero_()
            tiers.load(slot_ids, block_ids)  # correctness (and warm-up)
            torch.cuda.synchronize()
            equal = bool(torch.equal(blocks[block_ids].cpu().view(torch.int16),
                                     tiers.slots[slot_ids].view(torch.int16)))
            rows = {"load_ms": [], "host_ms": [], "group0_ms": [], "end_to_end_ms": []}
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                started = time.perf_counter()
                timing = tiers.load(slot_ids, block_ids)
                rows["host_ms"].append((time.perf_counter() - started) * 1e3)
                layer_waits = tiers.wait_for_loads(block_ids, (), by_layer=True)
                stand_in_forward(kv_cache, device_block_ids, weight, x, layer_waits)
                done = torch.cuda.Event(enable_timing=True)
                done.record()
                torch.cuda.synchronize()
                rows["load_ms"].append(timing.start.elapsed_time(timing.end))
                rows["group0_ms"].append(timing.start.elapsed_time(
                    timing.group_ends[0] if timing.group_ends else timing.end))
                rows["end_to_end_ms"].append(timing.start.elapsed_time(done))
            row = {name: round(_median(values), 3) for name, values in rows.items()}
            row["GB/s"] = _gbps(n * slot_nbytes, row["load_ms"])
            row["hidden_ms"] = round(row["load_ms"] + results["forward_alone_ms"]
                                     - row["end_to_end_ms"], 3)
            row["round_trip_equal"] = equal
            results[f"groups_{len(tiers.load_groups)}_{order}"] = row
            print(f"G={len(tiers.load_groups)} {order}: {row}", flush=True)
        tiers.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-blocks", type=int, default=1024, help="blocks per copy")
    parser.add_argument("--num-slots", type=int, default=3072)
    parser.add_argument("--num-cache-blocks", type=int, default=4096)
    parser.add_argument("--staging-mib", default="32,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--arena-dir", default="/dev/shm")
    parser.add_argument("--out", default="")
    parser.add_argument("--load-groups", default="",
                        help="e.g. 1,2,4,8: measure loads in layer groups instead (above)")
    parser.add_argument("--group-blocks", type=int, default=1023,
                        help="--load-groups: blocks per load (a 16k-token prefix)")
    parser.add_argument("--group-staging-mib", type=int, default=32,
                        help="--load-groups: staging per buffer (the worker's: 32)")
    parser.add_argument("--stand-in-cols", type=int, default=53248,
                        help="--load-groups: the stand-in GEMM's width (4096 x 53248: ~one "
                        "Llama-3.1-8B layer of weights)")
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

    if args.load_groups:
        results |= measure_groups(args, kv_cache, path, args.num_slots, slot_nbytes)
    for staging_mib in [] if args.load_groups else [int(x) for x in args.staging_mib.split(",")]:
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
