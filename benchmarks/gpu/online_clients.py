"""online_serve's loads, its other client, its server-side digest and its table (issue 27).

- Loads: each server takes one or several (``--loads``) in turn, each a client run.

- vLLM's own client (``vllm bench serve`` from the vLLM kit), the way a vLLM user measures a
  server: one SSE chunk is one ITL sample, however many tokens it carries, so streams that
  arrive in bursts show as a high ITL mean against the TPOT mean. Its result JSON is mapped
  onto flotilla bench's summary fields, so one table shows both clients.
- A digest of a server's Prometheus /metrics after the load: where a stream's gaps came
  from (flotilla: tokens per chunk, delivery lag behind the scheduler, step times,
  preemptions; vLLM: its preemptions and step figures), read from the bucket counts.
"""

from __future__ import annotations

import argparse
import json
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
    "flotilla_image_preprocess_seconds", "flotilla_encoder_images",
    "flotilla_encoder_cache_hits", "flotilla_encoder_seconds", "flotilla_worker_busy_seconds",
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


def metrics_digest(text: str, before: str = "") -> dict[str, dict]:
    """For each DIGESTED family in a /metrics text, less what ``before`` (an earlier
    scrape of the same server) counted: a counter's total, or a histogram's count, mean
    and p50/p90/p99 (the upper bound of the bucket holding that share)."""
    earlier = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(before) for s in family.samples}
    digest: dict[str, dict] = {}
    for family in text_string_to_metric_families(text):
        if family.name not in DIGESTED:
            continue
        samples = [s._replace(value=s.value - earlier.get((s.name, tuple(sorted(
            s.labels.items()))), 0.0)) for s in family.samples]
        if family.type == "counter":
            total = sum(s.value for s in samples if s.name.endswith("_total"))
            digest[family.name] = {"total": total}
        elif family.type == "histogram":
            digest[family.name] = _histogram_digest(samples)
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


def loads_of(args: argparse.Namespace) -> list[argparse.Namespace]:
    """The loads each server takes in turn: ``--loads`` (a JSON list of objects, each the
    flags that differ from the command line's, by their names here: name, client,
    dataset_name, dataset_path, num_prompts, request_rate, bench_args, max_duration), or
    the command line's one load."""
    if not args.loads:
        return [argparse.Namespace(**vars(args), load_name="")]
    try:
        given = json.loads(args.loads)
    except json.JSONDecodeError as exc:
        raise SystemExit(f"--loads is not JSON: {exc}") from None
    if not isinstance(given, list) or not all(isinstance(load, dict) for load in given):
        raise SystemExit("--loads must be a JSON list of objects")
    loads = []
    for index, overrides in enumerate(given):
        unknown = set(overrides) - set(LOAD_FIELDS)
        if unknown:
            raise SystemExit(f"--loads: unknown fields {sorted(unknown)}; use {LOAD_FIELDS}")
        fields = {**vars(args), **overrides, "load_name": overrides.get("name", str(index))}
        fields.pop("name", None)
        loads.append(argparse.Namespace(**fields))
    return loads


LOAD_FIELDS = ("name", "client", "dataset_name", "dataset_path", "num_prompts", "request_rate",
               "bench_args", "max_duration")


def summaries_of(data: dict, args: argparse.Namespace) -> dict:
    """A client's result JSON as the table reads it: the summary, and each rate's of a
    --request-rate sweep."""
    if args.client == "vllm":
        return {"summary": summary_from_vllm_client(data, args.num_prompts)}
    summaries = {"summary": data["runs"][0]["summary"]}
    if len(data["runs"]) > 1:
        summaries["sweep"] = [{"request_rate": run.get("request_rate"),
                               "summary": run["summary"]} for run in data["runs"]]
    return summaries


def table(results: list[dict]) -> str:
    head = (f"{'engine':<20}{'status':>12}{'done/fail/out':>15}{'req/s':>8}{'out tok/s':>11}"
            f"{'total tok/s':>12}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT mean':>10}"
            f"{'ITL mean':>9}{'ITL p50':>9}{'ITL p99':>9}{'goodput':>9}")
    lines = [" Online serving (ms for latencies) ".center(len(head), "="), head]
    rows = []
    for r in results:  # a sweep: a row per rate
        rows += [(f"{r['engine']}@{run['request_rate']:g}", r["status"], run["summary"])
                 for run in r["sweep"]] if r.get("sweep") else \
            [(r["engine"], r["status"], r.get("summary"))]
    for engine, status, s in rows:
        if s is None:
            lines.append(f"{engine:<20}{status[:60]:>12}")
            continue
        counts = f"{s['completed']}/{s['failed']}/{s['outstanding']}"
        lines.append(f"{engine:<20}{status[:12]:>12}{counts:>15}"
                     f"{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}"
                     f"{s['total_token_throughput']:>12.1f}{_ms(s['ttft_ms']['median']):>10}"
                     f"{_ms(s['ttft_ms']['p99']):>10}{_ms(s['tpot_ms']['mean']):>10}"
                     f"{_ms(s['itl_ms']['mean']):>9}{_ms(s['itl_ms']['median']):>9}"
                     f"{_ms(s['itl_ms']['p99']):>9}{_ms(s.get('goodput')):>9}")
    by_load: dict[str, list[dict]] = {}
    for r in results:
        if r.get("summary"):
            by_load.setdefault(r.get("load", ""), []).append(r)
    for load, measured in by_load.items():
        if len(measured) == 2 and measured[1]["summary"]["total_token_throughput"]:
            ratio = (measured[0]["summary"]["total_token_throughput"]
                     / measured[1]["summary"]["total_token_throughput"])
            lines.append(f"{measured[0]['engine']} over {measured[1]['engine']} total tok/s: "
                         f"{ratio:.2f}")
    return "\n".join(lines)


def _ms(value: float | None) -> str:
    return "-" if value is None or value != value else f"{value:.1f}"
