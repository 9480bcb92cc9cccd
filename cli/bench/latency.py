"""``flotilla bench latency``: a fixed batch with fixed input and output lengths, timed
over several iterations.

It drives the server over HTTP: one iteration sends ``--batch-size`` streaming requests
at once (random prompts of the same lengths, new ones each iteration so a prefix cache
cannot skip the prefill; EOS ignored) and waits for all of them. The batch's wall time
is the iteration's latency; since the requests decode together, the gap between two
tokens of a request (ITL) is the time of one decode step.
"""

from __future__ import annotations

import argparse
import asyncio

from cli.bench import options, report, target, workload
from cli.bench.datasets import BenchRequest, DatasetError, random_requests
from cli.bench.load import LoadSettings, http_client, run_load, warm_up
from cli.bench.metrics import RequestRecord, num_output_tokens, percentile, summarize

ITERATION_PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "latency", help="fixed batch and lengths: time per step and per request",
        description=__doc__.split("\n\n")[1].replace("\n", " "))
    parser.add_argument("--batch-size", type=int, default=8, help="requests sent together")
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens")
    parser.add_argument("--num-iters", type=int, default=10, help="measured iterations")
    parser.add_argument("--num-iters-warmup", type=int, default=2, help="unmeasured iterations")
    parser.add_argument("--seed", type=int, default=0)
    options.add_target_flags(parser, base_url_default=None)
    options.add_stack_flags(parser)
    parser.add_argument("--result-json", default=None, metavar="PATH")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run, ignore_eos=True)


def iteration_summary(iteration_s: list[float], batch_size: int, output_len: int) -> dict:
    mean_s = sum(iteration_s) / len(iteration_s)
    return {"num_iters": len(iteration_s), "mean_s": mean_s,
            **{f"p{q}_s": percentile(iteration_s, q) for q in ITERATION_PERCENTILES},
            "output_tokens_per_s": batch_size * output_len / mean_s}


def iteration_requests(args: argparse.Namespace, tokenizer) -> list[list[BenchRequest]]:
    """Fresh prompts of the same lengths for every iteration (warm-up ones first), so a
    prefix cache never turns an iteration's prefill into a lookup."""
    num_iters = args.num_iters_warmup + args.num_iters
    return [random_requests(tokenizer, args.batch_size, args.input_len, args.output_len,
                            seed=args.seed + i) for i in range(num_iters)]


async def _iterations(args: argparse.Namespace, base_url: str,
                      batches: list[list[BenchRequest]], warmups: list[BenchRequest],
                      model_name: str) -> tuple[list[float], list[RequestRecord]]:
    from tqdm import tqdm

    settings = workload.request_settings(args, model_name, ignore_eos=True)
    iteration_s, records = [], []
    async with http_client(base_url, args.api_key, args.request_timeout) as client:
        await warm_up(client, warmups, settings, num_warmups=1, warn=report.notice)
        for batch in batches[:args.num_iters_warmup]:
            await run_load(client, batch, settings, LoadSettings())
        for batch in tqdm(batches[args.num_iters_warmup:], desc="iterations",
                          disable=args.disable_tqdm):
            result = await run_load(client, batch, settings, LoadSettings())
            iteration_s.append(result.duration_s)
            records += result.records
    return iteration_s, records


def latency_table(iterations: dict, summary: dict, num_short: int) -> str:
    lines = [" Latency Benchmark Result ".center(52, "="),
             f"{'batch latency (s), ' + str(iterations['num_iters']) + ' iterations:':<38}"
             f"{iterations['mean_s']:>14.3f}"]
    lines += [f"{'  p' + str(q) + ':':<38}{iterations[f'p{q}_s']:>14.3f}"
              for q in ITERATION_PERCENTILES]
    lines += [f"{'output tok/s (batch x output / mean):':<38}"
              f"{iterations['output_tokens_per_s']:>14.1f}",
              f"{'decode step (ITL median, ms):':<38}{summary['itl_ms']['median']:>14.2f}",
              " per request ".center(52, "-"), *report.latency_table(summary)]
    if summary["failed"] or num_short:
        lines.append(f"failed: {summary['failed']}, short outputs: {num_short} "
                     f"{summary['failure_reasons'] or ''}")
    lines.append("=" * 52)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    spec = target.model_spec(args)
    tokenizer = target.load_tokenizer(args.tokenizer, spec)
    if min(args.batch_size, args.num_iters, args.input_len, args.output_len) < 1:
        raise DatasetError("--batch-size, --num-iters, --input-len and --output-len must be >= 1")
    batches = iteration_requests(args, tokenizer)
    warmups = workload.warmup_requests(tokenizer, 1, args.seed)
    with target.server(args, spec) as base_url:
        iteration_s, records = asyncio.run(
            _iterations(args, base_url, batches, warmups, target.request_model_name(spec)))
    iterations = iteration_summary(iteration_s, args.batch_size, args.output_len)
    summary = summarize(records, sum(iteration_s))
    # A server that ignores ignore_eos would make the lengths, and so the figures, wrong.
    num_short = sum(r.success and num_output_tokens(r) != args.output_len for r in records)
    print(latency_table(iterations, summary, num_short))
    if args.result_json:
        report.write_json(args.result_json, {
            "benchmark": "latency", "settings": report.settings_of(args, model=spec),
            "iterations": {**iterations, "iteration_s": iteration_s},
            "summary": summary, "num_short_outputs": num_short,
            "requests": [report.record_dict(r) for r in records]})
    return 0 if summary["completed"] else 1
