"""Terminal tables and the result JSON."""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
from dataclasses import asdict
from pathlib import Path

from cli.bench.metrics import RequestRecord, inter_token_latencies

LATENCY_ROWS = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))
_WIDTH = 52


def _line(label: str, value) -> str:
    text = f"{value:,.2f}" if isinstance(value, float) else str(value)
    return f"{label:<38}{text:>14}"


def _title(text: str, fill: str = "=") -> str:
    return f" {text} ".center(_WIDTH, fill)


def latency_table(summary: dict) -> list[str]:
    lines = [f"{'(ms)':<8}{'mean':>11}{'median':>11}{'p90':>11}{'p99':>11}"]
    for label, key in LATENCY_ROWS:
        s = summary[key]
        lines.append(f"{label:<8}{s['mean']:>11.2f}{s['median']:>11.2f}{s['p90']:>11.2f}"
                     f"{s['p99']:>11.2f}")
    return lines


def chunk_table(summary: dict) -> list[str]:
    """How the streams arrived: gaps between chunks, each request's longest, and tokens
    per chunk when the server said."""
    rows = [("Gap", summary["chunk_gap_ms"]), ("Stall", summary["longest_chunk_gap_ms"])]
    lines = [f"{label:<8}{s['mean']:>11.2f}{s['median']:>11.2f}{s['p90']:>11.2f}"
             f"{s['p99']:>11.2f}" for label, s in rows]
    per_chunk = summary["tokens_per_chunk"]
    if per_chunk["count"]:
        lines.append(f"{'Tok/chk':<8}{per_chunk['mean']:>11.2f}{per_chunk['median']:>11.2f}"
                     f"{per_chunk['p90']:>11.2f}{per_chunk['p99']:>11.2f}")
    return lines + ["(Gap: between chunks, ms; Stall: a request's longest gap, ms"
                    + ("; Tok/chk: tokens per chunk)" if per_chunk["count"] else ")")]


def serve_table(summary: dict, title: str = "Serving Benchmark Result") -> str:
    lines = [_title(title),
             _line("Successful requests:", summary["completed"]),
             _line("Failed requests:", summary["failed"]),
             _line("Outstanding requests (deadline):", summary["outstanding"])]
    if summary["deadline_reached"]:
        lines += [_line("  cancelled in flight:", summary["outstanding_in_flight"]),
                  _line("  never sent:", summary["outstanding_not_sent"])]
    if summary["completed_without_text"]:
        lines.append(_line("Completed with no text (usage only):",
                           summary["completed_without_text"]))
    lines += [_line("Benchmark duration (s):", summary["duration_s"]),
              _line("Total input tokens:", summary["total_input_tokens"]),
              _line("Total generated tokens:", summary["total_output_tokens"]),
              _line("Request throughput (req/s):", summary["request_throughput"]),
              _line("Input token throughput (tok/s):", summary["input_throughput"]),
              _line("Output token throughput (tok/s):", summary["output_throughput"]),
              _line("Total token throughput (tok/s):", summary["total_token_throughput"])]
    if math.isfinite(summary.get("prefix_cache_hit_rate", math.nan)):
        lines.append(_line("Prefix cache hit rate (usage):",
                           _percent(summary["prefix_cache_hit_rate"])))
    if "goodput" in summary:
        slo = " ".join(f"{k}<={v:g}ms" for k, v in summary["slo_ms"].items())
        lines += [f"{'SLO:':<14}{slo:>38}",
                  _line("Requests within the SLO:", summary["good_requests"]),
                  _line("Goodput (req/s):", summary["goodput"])]
        lines += [slo_miss_line(miss) for miss in summary.get("slo_misses", [])]
    if "client_max_loop_lag_ms" in summary:
        lines.append(client_pause_line(summary))
    lines += [_title("Latency", "-"), *latency_table(summary), *chunk_table(summary)]
    if summary["failure_reasons"]:
        lines.append(_title("Failures", "-"))
        lines += [f"{count:>5} x {reason}" for reason, count in summary["failure_reasons"].items()]
    if summary["deadline_reached"]:
        lines.append(_title("CUT SHORT at the --max-duration deadline", "!"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def client_pause_line(summary: dict) -> str:
    """How long the client itself stopped reading (a stall every stream saw at once may be
    its own)."""
    return (f"  client: longest event-loop lag {summary['client_max_loop_lag_ms']:.0f} ms "
            f"(ended at {summary['client_max_loop_lag_at_s']:.2f} s); "
            f"{summary['client_gc_collections']} GC collections, longest "
            f"{summary['client_gc_max_ms']:.0f} ms")


def slo_miss_line(miss: dict) -> str:
    """One request outside the SLO: when it was sent, its TTFT and longest gap, and whether
    the requests streaming with it were stalled in that gap too."""
    line = (f"  outside: sent at {miss['start_s']:.2f} s, TTFT {miss['ttft_ms']:.0f} ms, "
            f"longest gap {miss['longest_gap_ms']:.0f} ms")
    if "gap_ended_s" in miss:
        at_utc = f" = {miss['gap_ended_utc']} UTC" if "gap_ended_utc" in miss else ""
        line += (f" (after chunk {miss['gap_after_chunk']}, ended at {miss['gap_ended_s']:.2f} s"
                 f"{at_utc};"
                 f" {miss['others_stalled']} of {miss['others_streaming']} others stalled too)")
    return line


def sweep_table(runs: list[dict]) -> str:
    """One line per run of a sweep (over request rate or concurrency): throughput, TTFT,
    the longest chunk gaps (p99 over requests) and the goodput when SLOs were given."""
    rate_sweep = len({run.get("request_rate") for run in runs}) > 1
    has_goodput = "goodput" in runs[0]["summary"]
    lines = [_title("Request-rate sweep" if rate_sweep else "Concurrency sweep", "="),
             f"{'rate' if rate_sweep else 'conc.':>6}{'req/s':>8}{'out tok/s':>10}"
             f"{'TTFT p50':>9}{'p99':>8}{'TPOT p50':>9}{'stall p99':>10}"
             + (f"{'goodput':>9}" if has_goodput else "") + f"{'failed':>7}"]
    for run in runs:
        s = run["summary"]
        point = f"{run['request_rate']:g}" if rate_sweep else str(run["max_concurrency"])
        lines.append(f"{point:>6}{s['request_throughput']:>8.2f}{s['output_throughput']:>10.1f}"
                     f"{s['ttft_ms']['median']:>9.0f}{s['ttft_ms']['p99']:>8.0f}"
                     f"{s['tpot_ms']['median']:>9.1f}{s['longest_chunk_gap_ms']['p99']:>10.0f}"
                     + (f"{s['goodput']:>9.2f}" if has_goodput else "")
                     + f"{s['failed'] + s['outstanding']:>7}")
    lines.append("(stall: a request's longest gap between two chunks, ms; failed includes "
                 "outstanding)")
    return "\n".join(lines)


def turn_table(turns: list[dict]) -> str:
    """A multi-turn run, turn by turn: TTFT percentiles and the prefix-cache hit rate."""
    lines = [_title("Per turn"),
             f"{'turn':>4}{'done':>6}{'failed':>7}{'TTFT p50':>10}{'p90':>9}{'p99':>9}"
             f"{'hit rate':>10}"]
    for turn in turns:
        ttft = turn["ttft_ms"]
        lines.append(f"{turn['turn']:>4}{turn['completed']:>6}{turn['failed']:>7}"
                     f"{ttft['median']:>10.0f}{ttft['p90']:>9.0f}{ttft['p99']:>9.0f}"
                     f"{_percent(turn['prefix_cache_hit_rate']):>10}")
    return "\n".join(lines)


def prefix_cache_table(summary: dict, server: dict | None) -> str:
    """The prefix-cache hit rate the responses' usage reported, and the schedulers' own
    counters from the server's /metrics over the run (flotilla only)."""
    lines = [_title("Prefix cache"),
             _line("Cached / prompt tokens (usage):",
                   f"{summary['total_cached_tokens']:,} / {summary['total_input_tokens']:,}"),
             _line("Hit rate (usage):", _percent(summary["prefix_cache_hit_rate"]))]
    if server is None:
        lines.append("(no flotilla /metrics: scheduler counters not read)")
    else:
        lines += [_line("Scheduler hit rate (cache + tiers):", _percent(server["hit_rate"])),
                  _line("  worker cache hits / queries:",
                        f"{server['hits']:,.0f} / {server['queries']:,.0f}"),
                  _line("  loaded from kvstore tiers:", f"{server['tier_hits']:,.0f}")]
        for replica, figures in server["by_replica"].items():
            lines.append(_line(f"  {replica}: hit rate, queries",
                               f"{_percent(figures['hit_rate'])}, {figures['queries']:,.0f}"))
    return "\n".join(lines)


def speculative_line(figures: dict) -> str:
    """The server's speculative decoding over a run (server_metrics.speculative_decoding)."""
    by_position = " ".join(_percent(rate) for rate in figures["acceptance_by_position"])
    return (f"Speculative decoding (server): {figures['accepted_tokens']:,.0f} of "
            f"{figures['draft_tokens']:,.0f} drafts kept ({_percent(figures['acceptance_rate'])}),"
            f" {figures['mean_accepted_length']:.2f} a verify pass; kept by position: "
            f"{by_position}")


def expert_load_line(figures: dict) -> str:
    """A MoE server's expert load balance (server_metrics.expert_load): shares of an even
    split over every (layer, expert) cell, as counted since its workers attached."""
    return (f"MoE expert load (server, since its workers attached): hottest expert "
            f"{figures['max_share']:.2f}x an even split; of {figures['num_cells']:,.0f} "
            f"(layer, expert) cells {_percent(figures['share_above_2x'])} above 2x, "
            f"{_percent(figures['share_at_most_half'])} at most 0.5x")


def _percent(rate: float) -> str:
    return "n/a" if rate is None or not math.isfinite(rate) else f"{rate:.1%}"


def record_dict(record: RequestRecord) -> dict:
    """One request for the JSON: raw timings plus the derived ITLs."""
    return {**asdict(record),
            "itl_s": inter_token_latencies(record.chunk_times_s, record.chunk_num_tokens)}


def settings_of(args: argparse.Namespace, **extra) -> dict:
    """The exact settings: every flag, the command line, when and where it ran."""
    flags = {k: v for k, v in vars(args).items() if not callable(v)}
    if flags.get("api_key"):
        flags["api_key"] = "<set>"  # never write the secret into a result file
    return {"command": _redacted([Path(sys.argv[0]).name, *sys.argv[1:]]), "flags": flags,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "python": platform.python_version(),
                        "cpu_count": os.cpu_count()},
            **extra}


def _redacted(argv: list[str]) -> list[str]:
    """The command line with the value of --api-key hidden."""
    out = []
    for i, arg in enumerate(argv):
        hide = i > 0 and argv[i - 1] == "--api-key"
        out.append("<set>" if hide else "--api-key=<set>" if arg.startswith("--api-key=") else arg)
    return out


def _finite(value):
    """JSON has no NaN or infinity: write null (and the string "inf" for a rate)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "inf" if value == math.inf else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def notice(message: str) -> None:
    """A line on stderr, beside the progress bar (warnings, the run's milestones)."""
    print(f"flotilla bench: {message}", file=sys.stderr, flush=True)


def write_json(path: str, payload: dict) -> None:
    Path(path).write_text(json.dumps(_finite(payload), indent=2, allow_nan=False) + "\n")
    print(f"flotilla bench: wrote {path}", file=sys.stderr)
