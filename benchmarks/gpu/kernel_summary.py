"""Where a window of steps spends its GPU time, from a PyTorch profiler trace: kernel time by
kind (GEMM, attention, communication, norms, sampling, other) and the longest kernels, per
step. Reads flotilla's traces (offline_throughput ``--profile-at``) and vLLM's (its
``profiler_config`` torch traces) alike, so one window of each engine compares kind by kind.

    python -m benchmarks.gpu.kernel_summary TRACE.json[.gz] --steps 3 [--top 25]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import defaultdict
from pathlib import Path

# first match wins: communication before GEMM (NCCL kernel names hold no "gemm", but the
# fused TP tail's does not either), attention before norms
KINDS = (
    ("communication", re.compile(r"nccl|all_reduce|allreduce|one_shot|cross_device|all_gather",
                                 re.I)),
    ("attention", re.compile(r"attention|flash|fmha|paged|combine_segments|attn", re.I)),
    ("gemm", re.compile(r"gemm|cutlass|nvjet|cublas|matmul|sm90_xmma|splitk|skinny", re.I)),
    ("norm", re.compile(r"rms|norm", re.I)),
    ("rotary+kv write", re.compile(r"rotary|rope|reshape_and_cache|kv_cache|write_kv", re.I)),
    ("activation", re.compile(r"silu|act_and_mul|gelu", re.I)),
    ("sampling", re.compile(r"argmax|softmax|sample|topk|top_k|gather|cat_|scatter", re.I)),
)

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def load_events(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as trace:
        data = json.load(trace)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [event for event in events
            if event.get("ph") == "X" and event.get("cat") in GPU_CATEGORIES]


def summarize(events: list[dict], num_steps: int, top: int = 25) -> dict:
    """Per-step milliseconds by kind and by kernel name; the GPU's busy span over the window."""
    by_name: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for event in events:
        by_name[event["name"]] += event["dur"]  # microseconds
        counts[event["name"]] += 1
    by_kind: dict[str, float] = defaultdict(float)
    for name, micros in by_name.items():
        by_kind[kind_of(name)] += micros
    span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
            if events else 0.0)
    per_step = max(num_steps, 1) * 1e3
    return {
        "steps": num_steps, "busy_ms_per_step": sum(by_name.values()) / per_step,
        "span_ms_per_step": span / per_step,
        "kinds_ms_per_step": {kind: round(micros / per_step, 3) for kind, micros in
                              sorted(by_kind.items(), key=lambda item: -item[1])},
        "kernels": [{"name": name[:120], "kind": kind_of(name), "calls": counts[name],
                     "ms_per_step": round(micros / per_step, 3)}
                    for name, micros in sorted(by_name.items(), key=lambda item: -item[1])[:top]]}


def print_summary(summary: dict, title: str) -> None:
    print(f"{title}: {summary['steps']} steps, GPU busy {summary['busy_ms_per_step']:.2f} "
          f"ms/step over a span of {summary['span_ms_per_step']:.2f}")
    for kind, ms in summary["kinds_ms_per_step"].items():
        print(f"  {kind:18s} {ms:9.3f} ms/step")
    for kernel in summary["kernels"]:
        print(f"  {kernel['ms_per_step']:9.3f} ms {kernel['calls']:6d}x  [{kernel['kind']}] "
              f"{kernel['name']}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, required=True, help="steps the trace holds")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--json", type=Path, default=None, help="also write the summaries here")
    args = parser.parse_args()
    summaries = {}
    for path in args.traces:
        summaries[str(path)] = summarize(load_events(path), args.steps, args.top)
        print_summary(summaries[str(path)], path.name)
    if args.json is not None:
        args.json.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
