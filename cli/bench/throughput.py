"""``flotilla bench throughput``: offline, every prompt at once; output and total tok/s.

Backends: ``flotilla`` (a stack started here, or --base-url), ``openai`` (any server at
--base-url) and ``hf`` (transformers ``generate()`` in this process). Give several
(``flotilla,hf``) to get both figures and their ratio from one run on one machine; they
run one after another, so they never share the CPU or GPU.
"""

from __future__ import annotations

import argparse
import asyncio
import math

from cli.bench import options, report, target, workload
from cli.bench.datasets import BenchRequest, DatasetError
from cli.bench.load import LoadSettings, http_client, run_load, warm_up
from cli.bench.metrics import summarize

BACKENDS = ("flotilla", "openai", "hf")


def parse_backends(text: str) -> list[str]:
    backends = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [b for b in backends if b not in BACKENDS]
    if not backends or unknown:
        raise argparse.ArgumentTypeError(f"backends are {', '.join(BACKENDS)}; got {text!r}")
    return backends


def add_parser(commands) -> None:
    parser = commands.add_parser(
        "throughput", help="offline throughput: all prompts at once; flotilla vs. HF generate",
        description="Send every prompt at once and report output and total tokens per "
        "second. Outputs always run to their full length (EOS is ignored).")
    parser.add_argument("--backend", type=parse_backends, default=["flotilla"],
                        metavar="B[,B...]", help="flotilla, openai (needs --base-url), hf; "
                        "several give their ratio")
    parser.add_argument("--hf-batch-size", type=int, default=16, help="hf: static batch size")
    parser.add_argument("--hf-device", default="auto", help="hf: cpu, cuda (default: cuda if any)")
    parser.add_argument("--hf-dtype", default="auto",
                        help="hf: float32, bfloat16 (default: float32 on CPU, bfloat16 on GPU)")
    options.add_target_flags(parser, base_url_default=None)
    options.add_stack_flags(parser)
    options.add_dataset_flags(parser, num_prompts_default=32)
    parser.add_argument("--result-json", default=None, metavar="PATH")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    parser.set_defaults(handler=run, ignore_eos=True)


async def _measure(args: argparse.Namespace, base_url: str, requests: list[BenchRequest],
                   warmups: list[BenchRequest], model_name: str) -> dict:
    from tqdm import tqdm

    settings = workload.request_settings(args, model_name, ignore_eos=True)
    async with http_client(base_url, args.api_key, args.request_timeout) as client:
        await warm_up(client, warmups, settings, num_warmups=1, warn=report.notice)
        with tqdm(total=len(requests), desc="requests", disable=args.disable_tqdm) as bar:
            result = await run_load(client, requests, settings, LoadSettings(),
                                    on_done=lambda record: bar.update(1))
    return summarize(result.records, result.duration_s)


def run_backend(args: argparse.Namespace, backend: str, spec: str,
                requests: list[BenchRequest], warmups: list[BenchRequest]) -> dict:
    if backend == "hf":
        files = target.local_model(spec)
        if files is None:
            raise RuntimeError(f"--backend hf needs a local model; {spec!r} is not one "
                               "(give --model smollm2, a .gguf or a Hugging Face directory)")
        from cli.bench.hf import run_hf

        summary = run_hf(files.path, requests, args.hf_batch_size, True, args.hf_device,
                         args.hf_dtype)
        return {"backend": backend, "label": f"HF generate (batch {args.hf_batch_size})",
                "summary": summary}
    if backend == "openai" and not args.base_url:
        raise RuntimeError("--backend openai needs --base-url")
    with target.server(args, spec) as base_url:
        summary = asyncio.run(_measure(args, base_url, requests, warmups,
                                       target.request_model_name(spec)))
    return {"backend": backend, "label": f"{backend} ({base_url})", "summary": summary}


def throughput_table(results: list[dict]) -> str:
    lines = [" Offline Throughput ".center(86, "="),
             f"{'backend':<36}{'done':>6}{'failed':>7}{'seconds':>9}{'req/s':>8}"
             f"{'out tok/s':>10}{'total tok/s':>12}"]
    for result in results:
        s = result["summary"]
        lines.append(f"{result['label'][:35]:<36}{s['completed']:>6}{s['failed']:>7}"
                     f"{s['duration_s']:>9.2f}{s['request_throughput']:>8.2f}"
                     f"{s['output_throughput']:>10.1f}{s['total_token_throughput']:>12.1f}")
    for name, ratio in output_ratios(results).items():
        lines.append(f"ratio {name} (output tok/s): {ratio:.2f}")
    return "\n".join(lines)


def output_ratios(results: list[dict]) -> dict[str, float]:
    """The first backend's output tok/s over each other's."""
    first = results[0]
    return {f"{first['backend']}/{other['backend']}":
            first["summary"]["output_throughput"] / other["summary"]["output_throughput"]
            if other["summary"]["output_throughput"] else math.nan for other in results[1:]}


def run(args: argparse.Namespace) -> int:
    if args.images_per_request:
        raise DatasetError("--images-per-request: the offline backends take no images yet "
                           "(flotilla bench serve sends them)")
    spec = target.model_spec(args)
    tokenizer = target.load_tokenizer(args.tokenizer, spec)
    requests = workload.build_requests(args, tokenizer, args.seed)
    warmups = workload.warmup_requests(tokenizer, 1, args.seed)
    results = [run_backend(args, backend, spec, requests, warmups) for backend in args.backend]
    print(throughput_table(results))
    if args.result_json:
        report.write_json(args.result_json, {
            "benchmark": "throughput",
            "settings": report.settings_of(args, model=spec,
                                           dataset=workload.dataset_settings(args, requests)),
            "results": results, "output_throughput_ratios": output_ratios(results)})
    return 0 if all(r["summary"]["completed"] for r in results) else 1
