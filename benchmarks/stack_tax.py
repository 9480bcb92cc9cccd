"""Batch-1 decode through ``flotilla serve`` against the in-process engine on the same token
ids (issue 52's "no stack tax" line): what the service split costs a lone stream.

    python -m benchmarks.stack_tax [--pairs 3] [--num-prompts 8] [--input-len 64] [--output-len 128]

One stack (``cli/stack.py``: the real services over a real nats-server, the kvstore off) and
one in-process engine (``cli/engine.py``: the scheduler's policy driving a ModelRunner, no
bus) live side by side, each idle while the other runs. A pair: the in-process engine runs
``--num-prompts`` random prompts one at a time, then ``flotilla bench serve
--max-concurrency 1`` sends the stack the same token ids (the bench's random dataset with
the pair's seed; EOS ignored). A stream's ms/token is its time from the first token to the
last over the tokens after the first: the engine's own clock in process, the client's
through the stack (TPOT: the HTTP/SSE path and detokenization included). The ratio reported
is the median of the pairs' ratios (the shared 2-core machine drifts by ±15% between runs).

Results: $OUT/stack_tax.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OUT = Path(os.environ.get("OUT", "/tmp/out"))
BENCH_TIMEOUT_S = 900


def prompt_ids(model_dir: Path, args: argparse.Namespace, seed: int) -> list[list[int]]:
    """The token ids ``flotilla bench serve``'s random dataset sends for ``seed``."""
    from cli.bench.datasets import random_requests
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    requests = random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len,
                               seed=seed)
    return [request.prompt_ids for request in requests]


def in_process_ms(engine, prompts: list[list[int]], output_len: int) -> float:
    """Mean ms/token after the first, each prompt alone."""
    from shared.messages import SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    per_stream = []
    for prompt in prompts:
        (completion,), _ = engine.generate([prompt], [greedy])
        num_after_first = len(completion.output_token_ids) - 1
        per_stream.append(1e3 * (completion.finish_time - completion.first_token_time)
                          / num_after_first)
    return statistics.fmean(per_stream)


def stack_ms(base_url: str, args: argparse.Namespace, seed: int, out_dir: Path) -> float:
    """Mean TPOT of ``flotilla bench serve --max-concurrency 1`` against the stack."""
    result_json = out_dir / f"bench_seed{seed}.json"
    subprocess.run([sys.executable, "-m", "cli.main", "bench", "serve", "--base-url", base_url,
                    "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len),
                    "--output-len", str(args.output_len), "--ignore-eos",
                    "--max-concurrency", "1", "--seed", str(seed), "--disable-tqdm",
                    "--result-json", str(result_json)],
                   check=True, timeout=BENCH_TIMEOUT_S, stdout=subprocess.DEVNULL)
    summary = json.loads(result_json.read_text())["runs"][0]["summary"]
    if summary["completed"] != args.num_prompts:
        raise RuntimeError(f"the stack completed {summary['completed']} of "
                           f"{args.num_prompts} requests: {summary['failure_reasons']}")
    return summary["tpot_ms"]["mean"]


def build_engine(model_dir: Path):
    """The in-process engine on ``flotilla serve --device cpu``'s defaults."""
    from cli.engine import Engine
    from services.scheduler.config import SchedulerConfig
    from services.worker.config import WorkerConfig
    from shared.models import resolve_model

    return Engine(SchedulerConfig(), WorkerConfig(device="cpu"), resolve_model(str(model_dir)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--pairs", type=int, default=3, help="in-process / stack pairs")
    parser.add_argument("--num-prompts", type=int, default=8, help="streams a half, one at a time")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()

    from cli.stack import Stack, StackOptions, free_port
    from shared.models import resolve_model

    model_dir = resolve_model(args.model).path
    out_dir = Path(tempfile.mkdtemp(prefix="flotilla-stack-tax-"))
    stack = Stack(StackOptions(model=args.model, port=free_port(), kvstore=False,
                               log_dir=out_dir))
    stack.start(timeout_s=300)
    pairs = []
    try:
        engine = build_engine(model_dir)
        warm_up = prompt_ids(model_dir, argparse.Namespace(**{**vars(args), "num_prompts": 1}), 99)
        in_process_ms(engine, warm_up, 8)
        for index in range(args.pairs):
            seed = index + 1
            inside = in_process_ms(engine, prompt_ids(model_dir, args, seed), args.output_len)
            through = stack_ms(stack.base_url, args, seed, out_dir)
            pairs.append({"seed": seed, "in_process_ms": inside, "stack_ms": through,
                          "ratio": through / inside})
            print(f"pair {index + 1}: in process {inside:.2f} ms/token, through flotilla serve "
                  f"{through:.2f} ({through / inside:.3f}x)", flush=True)
    finally:
        stack.stop()
    result = {"settings": vars(args), "pairs": pairs,
              "ratio": statistics.median(p["ratio"] for p in pairs)}
    print(f"median ratio, flotilla serve over in process: {result['ratio']:.3f}x")
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "stack_tax.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
