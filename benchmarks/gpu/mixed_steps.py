"""Steps that carry a prompt chunk beside decodes, run as the worker runs them: piecewise
graphs where a token bucket holds the step, eagerly past them. Host launch and GPU time per
shape, beside the same step eagerly and the decode graph of the same decodes (what the step
would cost without the chunk). One engine for every shape:

    python -m benchmarks.gpu.mixed_steps --model dummy:llama-3.1-8b --shapes 8x60,40x60,40x1000

A shape BxP is B - 1 decodes over ``--context`` tokens each and one P-token prompt chunk (the
decode graph: B decodes). Medians of 20 (``step_profile.timed``); JSON via ``common.save``.
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.gpu.common import build_engine, device_name, save
from benchmarks.gpu.step_profile import timed
from services.worker.runner import SequenceChunk, build_step_inputs


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'8x60,40x1000' -> [(8, 60), (40, 1000)]: (batch, prompt chunk tokens)."""
    return [tuple(int(n) for n in shape.split("x")) for shape in text.split(",")]


def profile_shape(runner, batch: int, prompt_len: int, context: int) -> dict:
    """decode_graph_ms and mixed_ms: (host launch, until the GPU is done), medians."""
    device = torch.device("cuda")
    blocks_per_seq = -(-(context + prompt_len + 1) // runner.block_size)

    def table(i: int) -> list[int]:
        return list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))

    decodes = [SequenceChunk([7], context, table(i), True) for i in range(batch)]
    prompt = SequenceChunk(list(range(100, 100 + prompt_len)), 0, table(batch), True)
    decode_inputs = build_step_inputs(decodes, runner.block_size, device)
    mixed = build_step_inputs(decodes[:-1] + [prompt], runner.block_size, device)
    graphs = runner._mixed_graphs
    piecewise = graphs is not None and graphs.bucket_for(len(mixed[0])) is not None

    def run_mixed(eager: bool = False) -> None:
        mixed[-1].attention_plan = None  # as in serving: each step plans at its first layer
        if piecewise and not eager:
            graphs.run(*mixed)
        else:
            runner.model(*mixed)

    return {"batch": batch, "prompt": prompt_len, "context": context,
            "path": "piecewise" if piecewise else "eager",
            "decode_graph_ms": timed(lambda: runner._graphs.run(*decode_inputs)),
            "mixed_ms": timed(run_mixed), "mixed_eager_ms": timed(lambda: run_mixed(eager=True))}


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("8x60,40x60,40x1000"))
    parser.add_argument("--context", type=int, default=700)
    args = parser.parse_args()
    started = time.perf_counter()
    engine = build_engine(args.model, max_model_len=4096,
                          max_num_seqs=max(batch for batch, _ in args.shapes),
                          max_num_batched_tokens=2048)
    print(f"engine built in {time.perf_counter() - started:.1f} s")
    rows = [profile_shape(engine.runner, batch, prompt_len, args.context)
            for batch, prompt_len in args.shapes]
    for row in rows:
        print(row)
    save(f"mixed_steps_{args.model}", {"benchmark": "mixed_steps", "device": device_name(),
                                       "model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
