"""``flotilla bench serve``: online load over HTTP against any OpenAI-compatible server."""

from __future__ import annotations

import argparse
import asyncio
import time

from cli.bench import multi_turn, options, report, server_metrics, target, workload
from cli.bench.client import RequestSettings
from cli.bench.datasets import BenchRequest
from cli.bench.deadline import (
    DEFAULT_MAX_DURATION_S, EXIT_DEADLINE, RUN_STARTED, exit_status, time_left,
)
from cli.bench.load import LoadSettings, http_client, run_load, warm_up


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "serve", help="online load (streaming) against an OpenAI-compatible server",
        description="Send the dataset's prompts to a running server at --request-rate "
        "(Poisson) and/or with at most --max-concurrency in flight, streaming, and report "
        "throughput, TTFT, TPOT, ITL and end-to-end latency.")
    options.add_target_flags(parser, base_url_default="http://127.0.0.1:8000")
    options.add_dataset_flags(parser, num_prompts_default=100, multi_turn=True)
    group = parser.add_argument_group("load")
    group.add_argument("--request-rate", type=options.parse_rate_list, default=[float("inf")],
                       metavar="R[,R...]", help="requests per second, Poisson arrivals; inf "
                       "(default) sends all at once; a list runs a sweep (e.g. 5,10,20,40)")
    group.add_argument("--burstiness", type=float, default=1.0,
                       help="gamma shape of the arrival gaps: 1 is Poisson, <1 burstier")
    group.add_argument("--max-concurrency", type=options.parse_int_list, default=None,
                       metavar="N[,N...]", help="most requests in flight; a list runs a sweep")
    group.add_argument("--lora-modules", type=parse_lora_names, default=[],
                       metavar="NAME[,NAME...]", help="LoRA adapters the server serves "
                       "(vLLM's name=path entries are taken, the path ignored): the requests "
                       "name them in 'model', spread by --lora-assignment")
    group.add_argument("--lora-assignment", choices=("random", "round-robin"), default="random",
                       help="how requests are spread over --lora-modules: uniformly at "
                       "random with --seed (default), or in turn")
    group.add_argument("--num-warmups", type=int, default=1,
                       help="requests sent (one by one, not measured) before the run")
    group.add_argument("--max-duration", type=options.parse_seconds,
                       default=DEFAULT_MAX_DURATION_S, metavar="SECONDS",
                       help="deadline for the warm-up and all runs together (default 1800): "
                       "then what is in flight is cancelled, the partial results are reported "
                       f"and the exit status is {EXIT_DEADLINE}")
    options.add_output_flags(parser)
    parser.set_defaults(handler=run)


def parse_lora_names(text: str) -> list[str]:
    """"a,b" or vLLM's "a=/path,b=/path" -> ["a", "b"]."""
    names = [entry.partition("=")[0].strip() for entry in text.split(",") if entry.strip()]
    if not all(names):
        raise argparse.ArgumentTypeError("each entry needs a name")
    return names


def load_points(args: argparse.Namespace) -> list[tuple[float, int | None]]:
    """(request rate, max concurrency) of each run: a sweep over one of them, the other
    fixed."""
    rates, concurrencies = args.request_rate, args.max_concurrency or [None]
    if len(rates) > 1 and len(concurrencies) > 1:
        raise SystemExit("flotilla bench serve: sweep --request-rate or --max-concurrency, "
                         "not both (give one of them a single value)")
    return [(rate, concurrency) for rate in rates for concurrency in concurrencies]


def run_label(rate: float, max_concurrency: int | None, rate_sweep: bool) -> str:
    if rate_sweep:
        return f"rate {rate:g}/s"
    return f"concurrency {max_concurrency}" if max_concurrency else "requests"


async def sweep(args: argparse.Namespace, base_url: str, workloads: list[list[BenchRequest]],
                warmups: list[BenchRequest], settings: RequestSettings) -> list[dict]:
    """One run per --request-rate or --max-concurrency value (load_points), each on its
    own prompts, all within --max-duration: a run still going at the deadline is cut
    short, and the runs after it are not started."""
    from tqdm import tqdm

    deadline = time.monotonic() + args.max_duration
    runs = []
    async with http_client(base_url, args.api_key, args.request_timeout) as client:
        await warm_up(client, warmups, settings, args.num_warmups, args.max_duration,
                      warn=report.notice)
        points = load_points(args)
        rate_sweep = len(args.request_rate) > 1
        for (rate, max_concurrency), requests in zip(points, workloads):
            label = run_label(rate, max_concurrency, rate_sweep)
            remaining_s = time_left(deadline, args.max_duration, label)
            if remaining_s is None:
                break
            load = LoadSettings(rate, args.burstiness, max_concurrency, args.seed)
            report.notice(f"{RUN_STARTED} {len(requests)} requests ({label}, deadline in "
                          f"{remaining_s:.0f} s)")
            before = await server_metrics.read_counters(base_url, args.api_key)
            with tqdm(total=len(requests), desc=label, disable=args.disable_tqdm) as bar:
                result = await run_load(client, requests, settings, load,
                                        on_done=lambda record: bar.update(1),
                                        max_duration_s=remaining_s)
            if result.deadline_reached:
                report.notice(f"--max-duration {args.max_duration:g} s passed: "
                              f"{len(result.records)} of {len(requests)} requests finished, "
                              f"{len(result.in_flight)} were cancelled in flight and "
                              f"{result.num_not_sent} never sent")
            runs.append({"max_concurrency": max_concurrency, "request_rate": rate,
                         "label": label, "summary": result.summary(args.slo),
                         **await server_figures(base_url, args, before),
                         "dataset": workload.dataset_settings(args, requests),
                         "requests": [report.record_dict(r) for r in result.records],
                         "unfinished_requests": [report.record_dict(r) for r in result.in_flight]})
    return runs


async def server_figures(base_url: str, args: argparse.Namespace,
                         before: server_metrics.Counters | None) -> dict:
    """Speculative decoding over a run and a MoE model's expert load balance from the
    server's /metrics (server_metrics.py), read once the schedulers' stats have caught up;
    each None without drafts, without experts or without flotilla's /metrics."""
    figures = {"server_speculative": None, "server_expert_load": None}
    if before is None:
        return figures
    await asyncio.sleep(server_metrics.STATS_SETTLE_S)
    text = await server_metrics.read_metrics(base_url, args.api_key)
    if text is None:
        return figures
    deltas = server_metrics.counter_deltas(before, server_metrics.parse_counters(text))
    return {"server_speculative": server_metrics.speculative_decoding(deltas),
            "server_expert_load": server_metrics.expert_load(text, deltas)}


def run(args: argparse.Namespace) -> int:
    if args.dataset_name == "multi-turn":  # conversations, not independent requests
        return multi_turn.run(args)
    spec = target.model_spec(args)
    tokenizer = target.load_tokenizer(args.tokenizer, spec)
    # run i of a sweep draws its prompts with seed + i: no run finds another's in a prefix cache
    workloads = [workload.assign_adapters(workload.build_requests(args, tokenizer, args.seed + i),
                                          args.lora_modules, args.lora_assignment, args.seed + i)
                 for i in range(len(load_points(args)))]
    warmups = workload.warmup_requests(tokenizer, args.num_warmups, args.seed)
    settings = workload.request_settings(args, target.request_model_name(spec))
    runs = asyncio.run(sweep(args, args.base_url.rstrip("/"), workloads, warmups, settings))
    for run_ in runs:
        title = "Serving Benchmark Result"
        if run_["label"] != "requests":
            title += f" ({run_['label']})"
        print(report.serve_table(run_["summary"], title))
        if run_["server_speculative"]:
            print(report.speculative_line(run_["server_speculative"]))
        if run_["server_expert_load"]:
            print(report.expert_load_line(run_["server_expert_load"]))
    if len(runs) > 1:
        print(report.sweep_table(runs))
    if args.result_json:
        report.write_json(args.result_json, {
            "benchmark": "serve",
            "settings": report.settings_of(args, model=settings.model, base_url=args.base_url),
            "runs": runs})
    if args.plot:
        from cli.bench.plot import plot_runs

        plot_runs(runs, args.plot, title=f"flotilla bench serve: {settings.model}")
    return exit_status(runs, len(workloads))
