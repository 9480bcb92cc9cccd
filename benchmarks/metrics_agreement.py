"""vLLM's metric names against flotilla's own figures under `flotilla bench serve` load
(issue 54; docs/metrics.md, "Agreement under load").

    python -m benchmarks.metrics_agreement [--num-prompts 64] [--input-len 256]
        [--output-len 64] [--max-concurrency 16] [--max-num-seqs 8] [--result-json PATH]

A real stack on the CPU (the default model; the scheduler and worker at --max-num-seqs, below
the bench's concurrency, so requests wait at the scheduler and the waiting gauge is not 0
throughout), one streamed warm-up request sent by this script, a scrape of /metrics, then
`flotilla bench serve --num-warmups 0` with /metrics scraped every --scrape-every seconds
while it runs and once after. Checked, exit status 1 when any fails:

- at every scrape, `vllm:num_requests_waiting` equals `flotilla_num_requests_waiting` and
  `vllm:kv_cache_usage_perc` equals `flotilla_kv_cache_blocks_used / _total`, per replica
  (same scrape: they must be equal), and the waiting gauge and KV usage were above 0 at some
  scrape (else the check says nothing);
- at the scrapes before and after the bench, `_count`, `_sum` and every `_bucket` of
  `vllm:time_to_first_token_seconds`, `vllm:e2e_request_latency_seconds`,
  `vllm:inter_token_latency_seconds`, `vllm:request_queue_time_seconds` equal flotilla's;
- the TTFT and e2e counts are 1 before the bench (the warm-up, the only request sent before)
  and grow by the bench's requests over it, all of which completed;
- the server's mean TTFT and e2e over the bench's requests (the growth of _sum over that of
  _count) are at most the bench's client-side means: the server's interval (from the gateway
  submitting the request to its first / last token) lies inside the client's. Both and
  their ratio are printed: the gap is the client's HTTP, templating and tokenizing.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from cli.stack import Stack, StackOptions, free_port

# vLLM's name -> flotilla's figure it copies (docs/metrics.md)
WAITING = ("vllm:num_requests_waiting", "flotilla_num_requests_waiting")
KV_USAGE = "vllm:kv_cache_usage_perc"
BLOCKS_USED, BLOCKS_TOTAL = "flotilla_kv_cache_blocks_used", "flotilla_kv_cache_blocks_total"
HISTOGRAMS = {
    "ttft": ("vllm:time_to_first_token_seconds", "flotilla_time_to_first_token_seconds"),
    "e2e": ("vllm:e2e_request_latency_seconds", "flotilla_e2e_request_latency_seconds"),
    "itl": ("vllm:inter_token_latency_seconds", "flotilla_inter_token_latency_seconds"),
    "queue": ("vllm:request_queue_time_seconds", "flotilla_queue_time_seconds"),
}
# the schedulers' stats reach the gateway every 0.5 s: the last scrape waits this long
STATS_SETTLE_S = 1.2
TOLERANCE = 1e-9  # both sides are the same float: any gap is a real difference
WARMUP_BODY = {"prompt": "Tell me about the sea.", "max_tokens": 8, "temperature": 0,
               "ignore_eos": True, "stream": True}

Series = dict[frozenset, float]  # label set (model_name dropped) -> value


def samples(text: str) -> dict[str, Series]:
    """Sample name (with its _count/_sum/_bucket suffix) -> label set -> value, with vLLM's
    extra label ``model_name`` dropped so both names' label sets line up."""
    out: dict[str, Series] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")
            out.setdefault(sample.name, {})[labels] = sample.value
    return out


def series_gap(vllm: Series, flotilla: Series) -> float:
    """The largest |difference| over label sets; inf when either is missing or their label
    sets differ (a series on one name only is a disagreement too)."""
    if not vllm or set(vllm) != set(flotilla):
        return math.inf
    return max(abs(vllm[key] - flotilla[key]) for key in vllm)


def kv_usage(found: dict[str, Series]) -> Series:
    """flotilla's KV usage per replica: blocks used over blocks (0 where there are none)."""
    totals = found.get(BLOCKS_TOTAL, {})
    return {key: used / totals[key] if totals.get(key) else 0.0
            for key, used in found.get(BLOCKS_USED, {}).items() if key in totals}


def gauge_figures(text: str) -> dict:
    """One scrape's gauges: the gaps between the names and flotilla's own values."""
    found = samples(text)
    waiting, usage = found.get(WAITING[1], {}), kv_usage(found)
    return {"waiting": sum(waiting.values()), "waiting_gap": series_gap(found.get(WAITING[0], {}),
                                                                         waiting),
            "kv_usage": max(usage.values(), default=0.0),
            "kv_gap": series_gap(found.get(KV_USAGE, {}), usage)}


def histogram_figures(text: str) -> dict[str, dict]:
    """One scrape's latency histograms: flotilla's count and sum (over label sets) and the
    largest gap between the names over _count, _sum and every _bucket."""
    found = samples(text)
    figures = {}
    for key, (vllm, flotilla) in HISTOGRAMS.items():
        gap = max(series_gap(found.get(vllm + suffix, {}), found.get(flotilla + suffix, {}))
                  for suffix in ("_count", "_sum", "_bucket"))
        figures[key] = {"count": sum(found.get(flotilla + "_count", {}).values()),
                        "sum": sum(found.get(flotilla + "_sum", {}).values()), "gap": gap}
    return figures


def server_mean(before: dict, after: dict) -> float | None:
    """Mean of the observations between two scrapes of one histogram (histogram_figures)."""
    count = after["count"] - before["count"]
    return (after["sum"] - before["sum"]) / count if count > 0 else None


def failures(gauges: list[dict], before: dict, after: dict, bench: dict,
             num_warmups: int) -> list[str]:
    """What disagrees: the gauge gaps at any scrape, a vacuous gauge check, a histogram gap,
    the TTFT/e2e counts against the requests sent, a server mean above the client's."""
    found = []
    if not gauges:
        found.append("no scrape during the bench")
    for name in ("waiting_gap", "kv_gap"):
        worst = max((g[name] for g in gauges), default=0.0)
        if worst > TOLERANCE:
            found.append(f"{name} {worst} at some scrape")
    for name in ("waiting", "kv_usage"):
        if gauges and max(g[name] for g in gauges) <= 0:
            found.append(f"{name} was 0 at every scrape: the gauge check says nothing")
    for when, figures in (("before", before), ("after", after)):
        found += [f"{key} histogram gap {f['gap']} {when} the bench"
                  for key, f in figures.items() if f["gap"] > TOLERANCE]
    if bench["failed"] or bench["completed"] != bench["num_prompts"]:
        found.append(f"bench: {bench['completed']} of {bench['num_prompts']} completed")
    for key in ("ttft", "e2e"):
        grown = after[key]["count"] - before[key]["count"]
        if before[key]["count"] != num_warmups or grown != bench["num_prompts"]:
            found.append(f"{key} count {before[key]['count']} before (warm-ups: {num_warmups}), "
                         f"+{grown} over the bench ({bench['num_prompts']} requests)")
        mean, client = server_mean(before[key], after[key]), bench[f"{key}_mean_s"]
        if mean is None or mean > client:
            found.append(f"server mean {key} {mean} s above the client's {client} s")
    return found


def bench_figures(path: Path, num_prompts: int) -> dict:
    """The bench's run from its --result-json: completed, failed, client-side means (s)."""
    run = json.loads(path.read_text())["runs"][0]
    summary = run["summary"]
    return {"num_prompts": num_prompts, "completed": summary["completed"],
            "failed": summary["failed"], "ttft_mean_s": summary["ttft_ms"]["mean"] / 1000,
            "e2e_mean_s": summary["e2e_ms"]["mean"] / 1000,
            "itl_mean_s": summary["itl_ms"]["mean"] / 1000,
            "output_tokens": summary["total_output_tokens"],
            "total_token_throughput": summary["total_token_throughput"],
            "duration_s": summary["duration_s"]}


def bench_command(args: argparse.Namespace, base_url: str, result_json: Path) -> list[str]:
    return [sys.executable, "-m", "cli.main", "bench", "serve", "--base-url", base_url,
            "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
            "--output-len", str(args.output_len), "--ignore-eos",
            "--max-concurrency", str(args.max_concurrency), "--seed", "0",
            "--num-warmups", "0", "--disable-tqdm", "--result-json", str(result_json)]


def scrape(base_url: str) -> str:
    reply = httpx.get(base_url + "/metrics", timeout=30)
    reply.raise_for_status()
    return reply.text


def warm_up(base_url: str) -> None:
    """One streamed completion before the bench, so first-request costs are not in its
    figures: the only request the scrape before the bench counts."""
    model = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    with httpx.stream("POST", base_url + "/v1/completions", json={**WARMUP_BODY, "model": model},
                      timeout=120) as reply:
        reply.raise_for_status()
        assert "data: [DONE]" in "".join(reply.iter_text()), "the warm-up did not finish"


BENCH_DEADLINE_S = 1800.0  # a bench still running then is killed and reported


def watch(base_url: str, bench: subprocess.Popen, every_s: float) -> list[dict]:
    """The gauges of a scrape every ``every_s`` while the bench runs (killed at the deadline:
    its non-zero exit is then the reported failure)."""
    gauges, deadline = [], time.monotonic() + BENCH_DEADLINE_S
    while bench.poll() is None:
        if time.monotonic() > deadline:
            bench.kill()
            bench.wait(timeout=30)
            break
        started = time.monotonic()
        gauges.append(gauge_figures(scrape(base_url)))
        time.sleep(max(0.0, every_s - (time.monotonic() - started)))
    return gauges


def measure(args: argparse.Namespace, work: Path) -> dict:
    """Start the stack, warm up, bench while scraping; every figure."""
    seqs = ["--max-num-seqs", str(args.max_num_seqs)]
    stack = Stack(StackOptions(model=args.model, host="127.0.0.1", port=free_port(),
                               log_dir=work / "logs", service_args={
                                   "scheduler": seqs, "worker": [*seqs, "--device", "cpu"]}))
    stack.start(timeout_s=300)
    try:
        warm_up(stack.base_url)
        time.sleep(STATS_SETTLE_S)
        first = scrape(stack.base_url)
        result_json = work / "bench.json"
        with open(work / "bench.log", "w") as log:
            bench = subprocess.Popen(bench_command(args, stack.base_url, result_json),
                                     stdout=log, stderr=subprocess.STDOUT)
            gauges = watch(stack.base_url, bench, args.scrape_every)
        if bench.returncode != 0:
            raise RuntimeError(f"the bench exited {bench.returncode}: "
                               + (work / "bench.log").read_text()[-2000:])
        time.sleep(STATS_SETTLE_S)
        last = scrape(stack.base_url)
        gauges.append(gauge_figures(last))
    finally:
        stack.stop()
    return {"gauges": gauges, "before": histogram_figures(first),
            "after": histogram_figures(last),
            "bench": bench_figures(result_json, args.num_prompts)}


def report(figures: dict) -> list[str]:
    gauges, before, after, bench = (figures[k] for k in ("gauges", "before", "after", "bench"))
    lines = [f"scrapes: {len(gauges)} (every ~0.5 s during the bench, one after)",
             f"vllm:num_requests_waiting - flotilla_num_requests_waiting: max |gap| "
             f"{max(g['waiting_gap'] for g in gauges)}; waiting up to "
             f"{max(g['waiting'] for g in gauges):g}, above 0 at "
             f"{sum(g['waiting'] > 0 for g in gauges)} scrapes",
             f"vllm:kv_cache_usage_perc - flotilla blocks used/total: max |gap| "
             f"{max(g['kv_gap'] for g in gauges)}; usage up to "
             f"{max(g['kv_usage'] for g in gauges):.4f}"]
    for key, (vllm, _) in HISTOGRAMS.items():
        lines.append(f"{vllm}: count {before[key]['count']:g} -> {after[key]['count']:g}, "
                     f"sum {before[key]['sum']:.4f} -> {after[key]['sum']:.4f}, max |gap| "
                     f"(count, sum, buckets; before and after) "
                     f"{max(before[key]['gap'], after[key]['gap'])}")
    lines.append(f"bench: {bench['completed']} of {bench['num_prompts']} completed, "
                 f"{bench['total_token_throughput']:.1f} tok/s over {bench['duration_s']:.1f} s; "
                 f"inter-token count +{after['itl']['count'] - before['itl']['count']:g} (one per "
                 f"streamed chunk after the first: output tokens less one per request, "
                 f"{bench['output_tokens'] - bench['completed']}, when each chunk is one token)")
    for key in ("ttft", "e2e", "itl"):
        mean, client = server_mean(before[key], after[key]), bench[key + "_mean_s"]
        if mean is None or not client:
            lines.append(f"mean {key}: server {mean}, client {client}")
            continue
        lines.append(f"mean {key}: server {1e3 * mean:.1f} ms, client {1e3 * client:.1f} ms, "
                     f"server / client {mean / client:.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=8,
                        help="the scheduler's batch: below --max-concurrency, so requests wait")
    parser.add_argument("--scrape-every", type=float, default=0.5, metavar="SECONDS")
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="flotilla-metrics-agreement-") as work:
        figures = measure(args, Path(work))
    print("\n".join(report(figures)))
    if args.result_json:
        args.result_json.write_text(json.dumps(figures, indent=1) + "\n")
    found = failures(figures["gauges"], figures["before"], figures["after"], figures["bench"],
                     num_warmups=1)
    for line in found:
        print("DISAGREES:", line)
    print("agreement: " + ("no" if found else "every check holds"))
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
