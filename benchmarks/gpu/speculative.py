"""Issue 28 on the GPU: n-gram speculative decoding through the in-process engine (the real
scheduler and ModelRunner, CUDA graphs and overlapped steps on), dummy Llama-3.1-8B bf16,
with drafts against the same engine without them.

    python -m benchmarks.gpu.speculative --model DIR --run off   # then --run on, then neither
    (--batch-invariant on all three: both engines with the worker's --batch-invariant)

- ``identity``: 200 prompts (vLLM #41758's ``"serving" * 48`` among them: token ids repeated,
  random-token prompts, prompts that repeat a random phrase), all 200 in batches of 64 and the
  first 16, 32, 64 in batches of 1, 4, 16, 24 greedy tokens each: how many come out identical
  with drafts and without.
- ``batch1``: one repetitive prompt at a time (a phrase of 16 random ids, 32 times), 256
  tokens: ms per token after the first, drafts kept per draft, on against off.
- ``batch32``: 32 such prompts at once: output tokens per second, on against off.
Random weights write no text, but a random model's greedy output falls into loops that n-gram
lookup finds, so acceptance is the model's own. Results: $OUT/speculative_gpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path

from benchmarks.gpu.common import device_name, save
from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import resolve_model
from shared.sections.speculative import parse_speculative_config

# drafts at every batch size (the default turns them off above 16 running requests)
OUT = Path(os.environ.get("OUT", "/tmp/out"))
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 0}'
# (batch size, prompts run at it): every one of the 200 at 64, the first ones at the others
IDENTITY_BATCHES = ((1, 16), (4, 32), (16, 64), (64, 200))


def build(model: str, spec: str, max_num_seqs: int, batch_invariant: bool = False) -> Engine:
    return Engine(SchedulerConfig(speculative_config=parse_speculative_config(spec),
                                  max_num_seqs=max_num_seqs, max_num_batched_tokens=8192),
                  WorkerConfig(device="cuda", dtype="bfloat16", max_model_len=4096,
                               max_num_seqs=max_num_seqs, max_num_batched_tokens=8192,
                               gpu_memory_utilization=0.9, batch_invariant=batch_invariant),
                  resolve_model(model))


def identity_prompts(count: int) -> list[list[int]]:
    rng = random.Random(3)
    prompts = [[12000 + rng.randrange(3)] * 48]  # "serving" * 48: one id, many times
    while len(prompts) < count:
        phrase = [rng.randrange(100, 40_000) for _ in range(rng.randint(3, 12))]
        prompts.append(phrase * rng.randint(2, 8) if rng.random() < 0.6
                       else [rng.randrange(100, 40_000) for _ in range(rng.randint(4, 200))])
    return prompts


def repetitive(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 40_000) for _ in range(16)] * 32 for _ in range(count)]


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int):
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
              for _ in prompts]
    books = engine.scheduler.draft_books  # (zero without speculation)
    drafts_before, kept_before = books.num_draft_tokens, books.num_accepted_drafts
    completions, stats = engine.generate(prompts, params)
    return completions, stats, (books.num_draft_tokens - drafts_before,
                                books.num_accepted_drafts - kept_before)


def measure(engine: Engine) -> dict:
    """The three parts on one engine: identity outputs, batch-1 ms/token, batch-32 tok/s."""
    generate(engine, repetitive(4, 99), 32)  # warm-up
    outputs = []
    for batch_size, num_prompts in IDENTITY_BATCHES:
        prompts = identity_prompts(200)[:num_prompts]
        for start in range(0, num_prompts, batch_size):
            chunk = prompts[start:start + batch_size]
            outputs += [c.output_token_ids for c in generate(engine, chunk, 24)[0]]
    ms, drafts, kept = [], 0, 0
    for prompt in repetitive(4, 1):
        (completion,), _, (num_drafts, num_kept) = generate(engine, [prompt], 256)
        ms.append((completion.finish_time - completion.first_token_time) / 255 * 1e3)
        drafts, kept = drafts + num_drafts, kept + num_kept
    completions, stats, _ = generate(engine, repetitive(32, 2), 256)
    return {"identity_outputs": outputs, "batch1_ms_per_token": sorted(ms)[len(ms) // 2],
            "batch1_runs_ms": ms, "batch1_drafts": drafts, "batch1_kept": kept,
            "batch32_output_tok_s": 32 * 256 / stats.elapsed_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--spec", default=NGRAM)
    parser.add_argument("--run", choices=("off", "on"), default=None,
                        help="measure one engine and keep its outputs in $OUT (each in its own "
                        "process, so each has the whole GPU); without it, compare the two files")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="both engines with --batch-invariant (the worker's flag)")
    args = parser.parse_args()
    if args.run:
        engine = build(args.model, args.spec if args.run == "on" else "", 64,
                       args.batch_invariant)
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / f"speculative_gpu_{args.run}.json").write_text(json.dumps(measure(engine)))
        return
    off, on = (json.loads((OUT / f"speculative_gpu_{run}.json").read_text())
               for run in ("off", "on"))
    same = sum(a == b for a, b in zip(off["identity_outputs"], on["identity_outputs"], strict=True))
    result = {"benchmark": "speculative_gpu", "device": device_name(), "model": args.model,
              "spec": args.spec, "batch_invariant": args.batch_invariant, "identity": f"{same}/{len(off['identity_outputs'])}",
              "batch1_ms_per_token": {"off": off["batch1_ms_per_token"],
                                      "on": on["batch1_ms_per_token"]},
              "batch1_speedup": off["batch1_ms_per_token"] / on["batch1_ms_per_token"],
              "batch1_acceptance": on["batch1_kept"] / max(on["batch1_drafts"], 1),
              "batch32_output_tok_s": {"off": off["batch32_output_tok_s"],
                                       "on": on["batch32_output_tok_s"]},
              "batch32_speedup": on["batch32_output_tok_s"] / off["batch32_output_tok_s"]}
    save("speculative_gpu" + ("_batch_invariant" if args.batch_invariant else ""), result)


if __name__ == "__main__":
    main()
