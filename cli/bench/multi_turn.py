"""``flotilla bench serve --dataset-name multi-turn``: tenants × conversations × turns
(conversations.py), at most --max-concurrency conversations in flight
(conversation_load.py); TTFT overall and per turn, throughput, and the prefix-cache hit
rate from the responses' usage and from the server's /metrics (server_metrics.py)."""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from dataclasses import asdict

from cli.bench import options, report, server_metrics, target, workload
from cli.bench.client import RequestSettings
from cli.bench.conversation_load import Render, run_conversations
from cli.bench.conversations import Conversation, MultiTurnShape, multi_turn_conversations
from cli.bench.datasets import BenchRequest, DatasetError
from cli.bench.deadline import RUN_STARTED, exit_status, time_left
from cli.bench.load import RunResult, http_client, warm_up
from cli.bench.metrics import turn_summaries


def shape_of(args: argparse.Namespace) -> MultiTurnShape:
    return MultiTurnShape(num_tenants=args.num_tenants,
                          conversations_per_tenant=args.conversations_per_tenant,
                          num_turns=args.num_turns, system_prompt_len=args.system_prompt_len,
                          user_message_len=args.user_message_len,
                          output_len=args.output_len or workload.DEFAULT_OUTPUT_LEN)


def chat_renderer(tokenizer) -> Render:
    """Messages -> the templated prompt (generation prompt added) and its token ids, with
    the benchmark's tokenizer: the completions endpoint's text, and every turn's length."""
    if not getattr(tokenizer, "chat_template", None):
        raise DatasetError("multi-turn needs a tokenizer with a chat template (--tokenizer DIR)")

    def render(messages: list[dict]) -> tuple[str, list[int]]:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return text, tokenizer.encode(text, add_special_tokens=False)  # the template has any BOS
    return render


def dataset_settings(args: argparse.Namespace, shape: MultiTurnShape, result: RunResult) -> dict:
    sent = [r.prompt_len for r in (*result.records, *result.in_flight) if r.prompt_len]
    return {"dataset_name": "multi-turn", **asdict(shape), "num_requests": shape.num_requests,
            "session_ids": args.session_ids, "endpoint": options.endpoint(args),
            "prompt_len_min": min(sent, default=0), "prompt_len_max": max(sent, default=0)}


async def run_one(args: argparse.Namespace, client, base_url: str,
                  conversations: list[Conversation], settings: RequestSettings, render: Render,
                  max_concurrency: int | None, remaining_s: float, bar) -> dict:
    """One run: the server's counters, the conversations, the counters again."""
    before = await server_metrics.read_counters(base_url, args.api_key)
    result = await run_conversations(client, conversations, settings, render, max_concurrency,
                                     args.session_ids, on_done=lambda record: bar.update(1),
                                     max_duration_s=remaining_s)
    if before is not None:
        await asyncio.sleep(server_metrics.STATS_SETTLE_S)
    text = await server_metrics.read_metrics(base_url, args.api_key)
    after = None if text is None else server_metrics.parse_counters(text)
    deltas = server_metrics.counter_deltas(before, after) if before and after else None
    if result.deadline_reached:
        report.notice(f"--max-duration {args.max_duration:g} s passed: {len(result.records)} "
                      f"turns finished, {len(result.in_flight)} were cancelled in flight and "
                      f"{result.num_not_sent} never sent")
    return {"max_concurrency": max_concurrency, "summary": result.summary(args.slo),
            "turns": turn_summaries(result.records, result.duration_s),
            "server_prefix_cache": (server_metrics.scheduler_prefix_cache(deltas)
                                    if deltas and server_metrics.QUERIES in deltas else None),
            "server_counters": deltas,
            "server_expert_load": server_metrics.expert_load(text, deltas) if text else None,
            "dataset": dataset_settings(args, shape_of(args), result),
            "requests": [report.record_dict(r) for r in result.records],
            "unfinished_requests": [report.record_dict(r) for r in result.in_flight]}


async def sweep(args: argparse.Namespace, base_url: str, workloads: list[list[Conversation]],
                warmups: list[BenchRequest], settings: RequestSettings,
                render: Render) -> list[dict]:
    """One run per --max-concurrency value (all conversations at once if none), each on
    its own conversations, all within --max-duration."""
    from tqdm import tqdm

    deadline = time.monotonic() + args.max_duration
    runs = []
    async with http_client(base_url, args.api_key, args.request_timeout) as client:
        await warm_up(client, warmups, settings, args.num_warmups, args.max_duration,
                      warn=report.notice)
        for max_concurrency, conversations in zip(args.max_concurrency or [None], workloads):
            remaining_s = time_left(deadline, args.max_duration,
                                    f"concurrency {max_concurrency}")
            if remaining_s is None:
                break
            num_turns = sum(c.num_turns for c in conversations)
            report.notice(f"{RUN_STARTED} {len(conversations)} conversations, {num_turns} "
                          f"turns (at most {max_concurrency or len(conversations)} "
                          f"conversations at once, deadline in {remaining_s:.0f} s)")
            with tqdm(total=num_turns, desc="turns", disable=args.disable_tqdm) as bar:
                runs.append(await run_one(args, client, base_url, conversations, settings,
                                          render, max_concurrency, remaining_s, bar))
    return runs


def run(args: argparse.Namespace) -> int:
    if any(not math.isinf(rate) for rate in args.request_rate):
        raise DatasetError("--request-rate does not apply to multi-turn: a conversation "
                           "starts when one of the --max-concurrency slots is free")
    shape = shape_of(args)
    shape.check()
    spec = target.model_spec(args)
    tokenizer = target.load_tokenizer(args.tokenizer, spec)
    render = chat_renderer(tokenizer)
    # run i of a sweep has seed + i: its own texts and conversation ids, nothing cached
    workloads = [multi_turn_conversations(tokenizer, shape, args.seed + i)
                 for i in range(len(args.max_concurrency or [None]))]
    warmups = workload.warmup_requests(tokenizer, args.num_warmups, args.seed)
    settings = workload.request_settings(args, target.request_model_name(spec))
    base_url = args.base_url.rstrip("/")
    runs = asyncio.run(sweep(args, base_url, workloads, warmups, settings, render))
    for run_ in runs:
        title = "Multi-turn Benchmark Result"
        if run_["max_concurrency"]:
            title += f" ({run_['max_concurrency']} conversations)"
        print(report.serve_table(run_["summary"], title))
        print(report.turn_table(run_["turns"]))
        print(report.prefix_cache_table(run_["summary"], run_["server_prefix_cache"]))
        if run_["server_expert_load"]:
            print(report.expert_load_line(run_["server_expert_load"]))
    if args.result_json:
        report.write_json(args.result_json, {
            "benchmark": "serve",
            "settings": report.settings_of(args, model=settings.model, base_url=args.base_url),
            "runs": runs})
    if args.plot:
        from cli.bench.plot import plot_runs

        plot_runs(runs, args.plot, title=f"flotilla bench serve (multi-turn): {settings.model}")
    return exit_status(runs, len(workloads))
