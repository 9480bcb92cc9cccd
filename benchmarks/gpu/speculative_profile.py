"""Issue 28: where a batch-1 verify step's time goes. One request of 64 tokens through the
in-process engine (benchmarks/speculative_replay.py's), without speculation and then with
replayed drafts kept at a synthetic acceptance length of 3.0 (K = 4), each under the torch
profiler: the share of the wall time the GPU was busy (kernel time ranges merged) and the
kernels that took it.

    python3 -m benchmarks.gpu.speculative_profile [--model .devmodels/dummy-llama-3.1-8b]

Measured once on one H200 (2026-11-27, dummy Llama-3.1-8B bf16): busy 94% without drafts
(4.41 ms/token under the profiler), 72% with them (2.14 ms/token): the host gap between
verify steps, which are not overlapped, is about 1.8 ms of each 6.4 ms step.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.speculative_replay import engine, timed


def busy_ms(prof: torch.profiler.profile) -> float:
    """Milliseconds in which at least one GPU kernel or copy ran (overlaps merged)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    total, current = 0.0, None
    for start, end in spans:
        if current is None or start > current[1]:
            total += 0.0 if current is None else current[1] - current[0]
            current = [start, end]
        else:
            current[1] = max(current[1], end)
    total += 0.0 if current is None else current[1] - current[0]
    return total / 1e3


def profile_run(run, prompts: list[list[int]], name: str) -> None:
    """Warm up on prompts[0], profile prompts[1]."""
    timed(run, prompts[:1], 8, True)
    prompt = prompts[1]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        _, ms_per_token, _ = timed(run, [prompt], 64, True)
        torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - started) * 1e3
    busy = busy_ms(prof)
    print(f"{name}: {ms_per_token:.2f} ms/token, wall {wall_ms:.0f} ms, GPU busy {busy:.0f} ms "
          f"({busy / wall_ms:.0%})", flush=True)
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=14))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=".devmodels/dummy-llama-3.1-8b")
    parser.add_argument("--draft-model", default="",
                        help="also profile this draft model at the same synthetic acceptance")
    parser.add_argument("--skip-off", action="store_true", help="no run without drafts")
    cli = parser.parse_args()
    args = argparse.Namespace(model=cli.model, device="cuda", dtype="bfloat16",
                              kv_cache_memory="4GiB", batch=1)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(rng.randint(16, 64))]
               for _ in range(2)]
    plain = engine(args, "")
    if not cli.skip_off:
        profile_run(plain, prompts, "off")
    saved = {tuple(p): timed(plain, [p], 80, True)[0][0] for p in prompts}
    del plain
    path = Path(tempfile.mkdtemp()) / "replay.json"
    path.write_text(json.dumps({"prompts": [list(p) for p in saved],
                                "outputs": list(saved.values())}))
    spec = json.dumps({"method": "replay", "replay_path": str(path), "num_speculative_tokens": 4,
                       "disable_by_batch_size": 0, "rejection_sample_method": "synthetic",
                       "synthetic_acceptance_length": 3.0})
    profile_run(engine(args, spec), prompts, "synthetic")
    if cli.draft_model:
        spec = json.dumps({**json.loads(spec), "method": "draft_model", "model": cli.draft_model,
                           "replay_path": ""})
        profile_run(engine(args, spec), prompts, "draft model")


if __name__ == "__main__":
    main()
