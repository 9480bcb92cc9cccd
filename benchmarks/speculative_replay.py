"""Issue 28's ceiling: what the verify machinery gives when every draft is kept. The engine
(the real scheduler and ModelRunner, in process) first decodes greedily without speculation,
then again with replayed drafts, each request's own saved output (its plug-in:
benchmarks/speculation_plugins.py), so the proposer costs nothing and every draft is right:
the speed-up is the most any proposer can reach at that draft length, on this machine.

    python -m benchmarks.speculative_replay                                  # SmolLM2, CPU fp32
    python -m benchmarks.speculative_replay --model DIR --device cuda --dtype bfloat16

Reported, off against replay: batch 1 (one prompt at a time) ms per output token after the
first, and ``--batch`` prompts at once output tokens per second; the texts must be the same.
``--synthetic-acceptance-length L`` keeps a set share of the replayed drafts instead
(``rejection_sample_method: "synthetic"``, L tokens a verify step; its plug-in replaces the
worker's acceptance rule): on random weights, whose greedy tokens are near-ties that a
verify pass's other kernel shapes flip, no replayed draft survives verification, and this
is how engines are compared there (vLLM's same mode); the texts then differ by design.
Results: $OUT/speculative_replay.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

from benchmarks.speculation_plugins import install, split_speculative_config
from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.messages import SamplingParams
from shared.models import resolve_model

OUT = Path(os.environ.get("OUT", "/tmp/out"))


def engine(args, spec: str) -> Engine:
    """The engine under ``spec``: vLLM's JSON, with the benchmark modes it names installed."""
    config, modes = split_speculative_config(spec)
    return install(Engine(SchedulerConfig(speculative_config=config,
                                          max_num_seqs=max(args.batch, 8)),
                          WorkerConfig(device=args.device, dtype=args.dtype, max_model_len=2048,
                                       kv_cache_memory=args.kv_cache_memory,
                                       max_num_seqs=max(args.batch, 8)),
                          resolve_model(args.model)), modes)


def timed(run: Engine, prompts: list[list[int]], num_tokens: int, one_at_a_time: bool
          ) -> tuple[list[list[int]], float, float]:
    """(outputs, ms per token after each request's first, output tokens per second)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    groups = [[prompt] for prompt in prompts] if one_at_a_time else [prompts]
    outputs, decode_s, decode_tokens, elapsed_s = [], 0.0, 0, 0.0
    for group in groups:
        completions, stats = run.generate(group, [greedy] * len(group))
        outputs += [c.output_token_ids for c in completions]
        decode_s += sum(c.finish_time - c.first_token_time for c in completions)
        decode_tokens += sum(len(c.output_token_ids) - 1 for c in completions)
        elapsed_s += stats.elapsed_s
    return outputs, 1e3 * decode_s / decode_tokens, sum(map(len, outputs)) / elapsed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", default="1GiB")
    parser.add_argument("--prompts", type=int, default=4, help="run one at a time (batch 1)")
    parser.add_argument("--batch", type=int, default=16, help="prompts run at once")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--synthetic-acceptance-length", type=float, default=0.0,
                        help="keep drafts at this mean tokens a verify step (0: verify them)")
    args = parser.parse_args()
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40_000) for _ in range(rng.randint(16, 64))]
               for _ in range(max(args.prompts, args.batch))]
    plain = engine(args, "")
    timed(plain, prompts[:2], 8, True)  # warm-up
    off_one = timed(plain, prompts[:args.prompts], args.tokens, True)
    off_batch = timed(plain, prompts[:args.batch], args.tokens, False)
    del plain
    replay_path = Path(tempfile.mkdtemp()) / "replay.json"
    saved = {**{tuple(p): o for p, o in zip(prompts[:args.batch], off_batch[0])},
             **{tuple(p): o for p, o in zip(prompts[:args.prompts], off_one[0])}}
    replay_path.write_text(json.dumps({"prompts": [list(p) for p in saved],
                                       "outputs": list(saved.values())}))
    synthetic = ({"rejection_sample_method": "synthetic",
                  "synthetic_acceptance_length": args.synthetic_acceptance_length}
                 if args.synthetic_acceptance_length else {})
    spec = json.dumps({"method": "replay", "replay_path": str(replay_path),
                       "num_speculative_tokens": args.num_speculative_tokens,
                       "disable_by_batch_size": 0, **synthetic})
    replay = engine(args, spec)
    timed(replay, prompts[:2], 8, True)
    on_one = timed(replay, prompts[:args.prompts], args.tokens, True)
    on_batch = timed(replay, prompts[:args.batch], args.tokens, False)
    books = replay.scheduler.draft_books
    result = {"benchmark": "speculative_replay", "model": args.model, "device": args.device,
              "dtype": args.dtype, "num_speculative_tokens": args.num_speculative_tokens,
              "tokens": args.tokens, "batch": args.batch,
              "identical": on_one[0] == off_one[0] and on_batch[0] == off_batch[0],
              "drafts_kept": f"{books.num_accepted_drafts}/{books.num_draft_tokens}",
              "synthetic_acceptance_length": args.synthetic_acceptance_length,
              "tokens_per_verify_step": 1 + books.num_accepted_drafts
              / max(1, books.num_drafted_steps),
              "batch1_ms_per_token_off": off_one[1], "batch1_ms_per_token_replay": on_one[1],
              "batch1_speedup": off_one[1] / on_one[1],
              "batch_tok_s_off": off_batch[2], "batch_tok_s_replay": on_batch[2],
              "batch_speedup": on_batch[2] / off_batch[2]}
    print(json.dumps(result, indent=1))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "speculative_replay.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
