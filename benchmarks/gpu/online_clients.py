"""online_serve's other client and its server-side digest (issue 27).

- vLLM's own client (``vllm bench serve`` from the vLLM kit), the way a vLLM user measures a
  server: one SSE chunk is one ITL sample, however many tokens it carries, so streams that
  arrive in bursts show as a high ITL mean against the TPOT mean. Its result JSON is mapped
  onto flotilla bench's summary fields, so one table shows both clients.
- A digest of a server's Prometheus /metrics after the load: where a stream's gaps came
  from (flotilla: tokens per chunk, delivery lag behind the scheduler, step times,
  preemptions; vLLM: its preemptions and step figures), read from the bucket counts.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

# histograms and counters worth a line in the summary, flotilla's and vLLM's
DIGESTED = (
    "flotilla_stream_tokens_per_chunk", "flotilla_output_delivery_seconds",
    "flotilla_inter_token_latency_seconds", "flotilla_step_time_seconds",
    "flotilla_scheduled_tokens_per_step", "flotilla_queue_time_seconds",
    "flotilla_preemptions", "flotilla_time_to_first_token_seconds",
    "vllm:num_preemptions", "vllm:inter_token_latency_seconds",
    "vllm:iteration_tokens_total", "vllm:request_queue_time_seconds",
)


def vllm_client_command(args, base_url: str, name: str, tokenizer: str, out: Path,
                        engine: str) -> list[str]:
    """``vllm bench serve`` against ``base_url``, run with only the kit on PYTHONPATH;
    its result JSON goes to ``out/vllm_client_ENGINE.json``. ``--bench-args`` adds flags
    (e.g. ``--random-input-len 1024 --random-output-len 256``)."""
    bench = ["vllm", "bench", "serve", "--backend", "openai", "--base-url", base_url,
             "--model", name, "--tokenizer", tokenizer, "--dataset-name", args.dataset_name,
             "--num-prompts", str(args.num_prompts), "--ignore-eos",
             "--request-rate", args.request_rate, "--seed", str(args.seed),
             "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
             "--save-result", "--result-dir", str(out),
             "--result-filename", vllm_client_result(engine), "--disable-tqdm"]
    if args.dataset_path:
        bench += ["--dataset-path", args.dataset_path]
    bench += shlex.split(args.bench_args)
    return ["bash", "-c", 'unset PYTHONPATH; source "$0" && exec "$@"', args.vllm_env, *bench]


def vllm_client_result(engine: str) -> str:
    return f"vllm_client_{engine}.json"


def summary_from_vllm_client(data: dict, num_prompts: int) -> dict:
    """vLLM's result JSON in flotilla bench's summary fields (latencies in ms)."""
    def figures(metric: str) -> dict:
        return {"mean": data.get(f"mean_{metric}_ms", math.nan),
                "median": data.get(f"median_{metric}_ms", math.nan),
                "p90": data.get(f"p90_{metric}_ms", math.nan),
                "p99": data.get(f"p99_{metric}_ms", math.nan)}

    completed = int(data.get("completed", 0))
    return {"client": "vllm bench serve", "completed": completed,
            "failed": int(data.get("failed", num_prompts - completed)), "outstanding": 0,
            "duration_s": data.get("duration", math.nan),
            "request_throughput": data.get("request_throughput", math.nan),
            "output_throughput": data.get("output_throughput", math.nan),
            "total_token_throughput": data.get("total_token_throughput", math.nan),
            "ttft_ms": figures("ttft"), "tpot_ms": figures("tpot"), "itl_ms": figures("itl"),
            "e2e_ms": figures("e2el")}


def metrics_digest(text: str) -> dict[str, dict]:
    """For each DIGESTED family in a /metrics text: a counter's total, or a histogram's
    count, mean and p50/p90/p99 (the upper bound of the bucket holding that share)."""
    digest: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in DIGESTED:
            continue
        if family.type == "counter":
            total = sum(s.value for s in family.samples if s.name.endswith("_total"))
            digest[family.name] = {"total": total}
        elif family.type == "histogram":
            digest[family.name] = _histogram_digest(family.samples)
    return digest


def _histogram_digest(samples) -> dict:
    """Sum the series of every label set; quantiles from the cumulative buckets."""
    buckets: dict[float, float] = {}
    count = total = 0.0
    for sample in samples:
        if sample.name.endswith("_bucket"):
            bound = float(sample.labels["le"])
            buckets[bound] = buckets.get(bound, 0.0) + sample.value
        elif sample.name.endswith("_count"):
            count += sample.value
        elif sample.name.endswith("_sum"):
            total += sample.value
    ordered = sorted(buckets.items())

    def quantile(share: float) -> float:
        for bound, cumulative in ordered:
            if count and cumulative >= share * count:
                return bound
        return math.nan

    return {"count": count, "mean": total / count if count else math.nan,
            "p50": quantile(0.5), "p90": quantile(0.9), "p99": quantile(0.99)}


def digest_lines(digest: dict[str, dict]) -> list[str]:
    """One line a metric, for the console."""
    lines = []
    for name, figures in sorted(digest.items()):
        shown = ", ".join(f"{key} {value:.4g}" for key, value in figures.items())
        lines.append(f"  {name}: {shown}")
    return lines
