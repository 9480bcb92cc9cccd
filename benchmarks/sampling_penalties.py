"""Issue 6: throughput of sampling with every penalty on against plain sampling, batch 32.

    .venv/bin/python -m benchmarks.sampling_penalties                 # CPU, the default model
    python -m benchmarks.sampling_penalties --device cuda --model dummy:llama-3.2-1b
    python -m benchmarks.sampling_penalties --device cuda --sampler-only --vocab-size 128256

The in-process engine (cli/engine.py: the scheduler's policy and the worker's ModelRunner,
no bus) generates --batch requests at once, EOS ignored, --output-len tokens each, with
temperature 1.0 and top-p 0.95; the "penalties" runs add presence, frequency and repetition
penalties (plus a min_p, a logit_bias and min_tokens, so every adjustment is exercised).
Runs alternate plain/penalties --repeats times; the median decode throughput of each is
reported. Output token throughput counts only steps after every prompt is in (decode steps).

``--sampler-only`` times the worker's Sampler alone on random logits (no model), per
setting: plain, penalties only, and every adjustment, in ms per call of --batch rows.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch


from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.sampler import Sampler
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import resolve_model


def sampling(penalties: bool, index: int, output_len: int) -> SamplingParams:
    plain = dict(max_tokens=output_len, temperature=1.0, top_p=0.95, seed=index, ignore_eos=True)
    if not penalties:
        return SamplingParams(**plain)
    return SamplingParams(**plain, presence_penalty=0.5, frequency_penalty=0.5,
                          repetition_penalty=1.2, min_p=0.05, logit_bias={100 + index: -5.0},
                          min_tokens=output_len // 2)


def sampler_only(args: argparse.Namespace) -> dict:
    device = torch.device(args.device)
    logits = torch.randn(args.batch, args.vocab_size, device=device) * 3
    ids = [f"r{i}" for i in range(args.batch)]
    settings = {
        "plain": [sampling(False, i, args.output_len) for i in range(args.batch)],
        "penalties_only": [SamplingParams(
            max_tokens=args.output_len, temperature=1.0, top_p=0.95, seed=i, presence_penalty=0.5,
            frequency_penalty=0.5, repetition_penalty=1.2) for i in range(args.batch)],
        "all_adjustments": [sampling(True, i, args.output_len) for i in range(args.batch)]}
    result = {}
    for name, params in settings.items():
        sampler = Sampler(args.vocab_size, [2], device)
        for request_id, p in zip(ids, params):
            sampler.add(request_id, p, list(range(100, 100 + args.input_len)), args.input_len)
        times = []
        for step in range(60):
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            sampler.sample(logits, ids, params, [step] * args.batch, [None] * args.batch)
            times.append(time.perf_counter() - start)
        result[f"{name}_ms"] = round(statistics.median(times[10:]) * 1e3, 3)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the result JSON here")
    parser.add_argument("--sampler-only", action="store_true")
    parser.add_argument("--vocab-size", type=int, default=49152, help="with --sampler-only")
    args = parser.parse_args()
    if args.sampler_only:
        print(json.dumps(sampler_only(args), indent=2))
        return

    worker = WorkerConfig(device=args.device, max_num_seqs=max(args.batch, 8),
                          max_num_batched_tokens=max(2048, args.batch * args.input_len))
    scheduler = SchedulerConfig(max_num_seqs=max(args.batch, 8),
                                max_num_batched_tokens=worker.max_num_batched_tokens,
                                prefix_caching=False)
    engine = Engine(scheduler, worker, resolve_model(args.model))
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(args.input_len)]
               for _ in range(args.batch)]
    engine.generate(prompts[:2], [sampling(True, i, 8) for i in range(2)])  # warm up

    throughput: dict[str, list[float]] = {"plain": [], "penalties": []}
    for _ in range(args.repeats):
        for name in throughput:
            params = [sampling(name == "penalties", i, args.output_len) for i in range(args.batch)]
            completions, stats = engine.generate(prompts, params)
            assert all(len(c.output_token_ids) == args.output_len for c in completions)
            decode = stats.decode_steps
            throughput[name].append(args.batch * len(decode) / sum(decode))
    plain, penalties = (statistics.median(throughput[k]) for k in ("plain", "penalties"))
    result = {"model": args.model, "device": engine.runner.device, "batch": args.batch,
              "input_len": args.input_len, "output_len": args.output_len,
              "runs_tok_s": throughput, "plain_tok_s": round(plain, 1),
              "penalties_tok_s": round(penalties, 1),
              "penalties_vs_plain": round(penalties / plain, 3)}
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
