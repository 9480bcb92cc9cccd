"""Where a step's time goes: decode-only (CUDA graph and eager) and mixed steps (piecewise
graphs and eager), host vs GPU.

    python -m benchmarks.gpu.step_profile --model dummy:llama-3.1-8b --batch 256 --context 512

Builds a runner, fills its cache (contents do not matter for timing), and times steps built
with build_step_inputs directly: wall time of input building, of the forward call returning
(host launch cost) and of the forward completing (GPU), median of 20. Also a prefix hit's
step (``--hit-tokens`` new tokens after ``--hit-context`` cached ones, alone), and the GPU
kernels of a batch-1 decode graph at ``--context`` (benchmark b), by total time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.gpu.common import build_engine, device_name, save
from services.worker.runner import SequenceChunk, build_step_inputs


def timed(fn, repeats: int = 20) -> tuple[float, float]:
    """(ms until fn returns, ms until the GPU is done), medians."""
    launch, total = [], []
    for _ in range(repeats):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        launch.append(time.perf_counter() - started)
        torch.cuda.synchronize()
        total.append(time.perf_counter() - started)
    return 1e3 * statistics.median(launch), 1e3 * statistics.median(total)


@torch.inference_mode()
def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--prompt", type=int, default=100, help="mixed step: one prompt chunk")
    parser.add_argument("--hit-context", type=int, default=16384)
    parser.add_argument("--hit-tokens", type=int, default=16)
    args = parser.parse_args()
    engine = build_engine(args.model, max_model_len=max(4096, args.hit_context + args.hit_tokens),
                          max_num_seqs=args.batch, max_num_batched_tokens=8192)
    runner = engine.runner
    blocks_per_seq = -(-(args.context + args.prompt + 1) // runner.block_size)
    def table(i):
        return list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq))
    decodes = [SequenceChunk([7], args.context, table(i), True) for i in range(args.batch)]
    prompt = SequenceChunk(list(range(100, 100 + args.prompt)), 0, table(args.batch), True)
    device = torch.device("cuda")
    result = {"benchmark": "step_profile", "device": device_name(), "model": args.model,
              "batch": args.batch, "context": args.context, "prompt": args.prompt}
    result["build_inputs_ms"] = timed(lambda: build_step_inputs(decodes, runner.block_size,
                                                                device))[1]
    decode_inputs = build_step_inputs(decodes, runner.block_size, device)
    result["decode_graph_ms"] = timed(lambda: runner._graphs.run(*decode_inputs))
    result["decode_eager_ms"] = timed(lambda: runner.model(*decode_inputs))
    mixed = build_step_inputs(decodes[:-1] + [prompt], runner.block_size, device)
    result["mixed_eager_ms"] = timed(lambda: runner.model(*mixed))
    mixed_graphs = runner._mixed_graphs
    if mixed_graphs is not None and mixed_graphs.bucket_for(len(mixed[0])) is not None:
        result["mixed_graph_ms"] = timed(lambda: mixed_graphs.run(*mixed))
    hit_blocks = list(range(-(-(args.hit_context + args.hit_tokens) // runner.block_size)))
    hit = build_step_inputs([SequenceChunk(list(range(100, 100 + args.hit_tokens)),
                                           args.hit_context, hit_blocks, True)],
                            runner.block_size, device)
    result["hit_eager_ms"] = timed(lambda: runner.model(*hit))
    if mixed_graphs is not None:
        result["hit_graph_ms"] = timed(lambda: mixed_graphs.run(*hit))
        for name, inputs in (("mixed", mixed), ("hit", hit)):  # graphs vs eager numerics
            eager, graph = runner.model(*inputs), mixed_graphs.run(*inputs).clone()
            result[f"{name}_graph_vs_eager"] = {
                "max_abs_logit_diff": float((graph - eager).abs().max()),
                "max_abs_logit": float(eager.abs().max()),
                "argmax_agree": float((graph.argmax(-1) == eager.argmax(-1)).float().mean())}
        # the noise of another GEMM shape alone: the hit's row eager beside one decode
        beside = build_step_inputs([decodes[-1], SequenceChunk(
            list(range(100, 100 + args.hit_tokens)), args.hit_context, hit_blocks, True)],
            runner.block_size, device)
        result["hit_eager_beside_a_decode_max_abs_logit_diff"] = float(
            (runner.model(*beside)[1] - runner.model(*hit)[0]).abs().max())
    one = build_step_inputs([SequenceChunk([7], args.context, table(0), True)],
                            runner.block_size, device)
    result["decode1_graph_ms"] = timed(lambda: runner._graphs.run(*one))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(10):
            runner._graphs.run(*one)
        torch.cuda.synchronize()
    print("batch-1 decode graph, 10 steps:")
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                       max_name_column_width=70))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(10):
            runner._graphs.run(*decode_inputs)
        torch.cuda.synchronize()
    print(f"batch-{args.batch} decode graph, 10 steps:")
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                       max_name_column_width=70))
    logits = runner.model(*decode_inputs)
    result["sample_greedy_ms"] = timed(lambda: logits.argmax(-1).tolist())[1]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(3):
            runner.model(*mixed)
        torch.cuda.synchronize()
    print(profile.key_averages().table(sort_by="self_cpu_time_total", row_limit=15,
                                       max_name_column_width=50))
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=10,
                                       max_name_column_width=50))
    save(f"step_profile_{args.model}", result)
    print({k: v for k, v in result.items() if k.endswith("_ms")})


if __name__ == "__main__":
    main()
