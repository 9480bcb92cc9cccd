"""Issue 4 benchmark b: batch-1 decode latency against the weights/bandwidth floor, and HF.

    python -m benchmarks.gpu.decode_latency --model dummy:llama-3.1-8b --context 1024 --hf
    # issue 50: the request with a LoRA adapter (a PEFT directory; dummy_loras.py writes one)
    python -m benchmarks.gpu.decode_latency --model dummy:llama-3.1-8b --lora /tmp/loras/lora0

Both are the path: ``--norm-in-reduce off`` measures without the residual add and RMSNorm after
o_proj and down in their split-K reduce (the two kernels instead), ``--pdl off`` without
programmatic dependent launch of the decode kernels (``kernels.pdl.PDL``, captured into the
graphs; on by default where the GPU has it), each set before the engine is built.

One request with a ``--context``-token prompt decodes ``--num-tokens`` tokens through the
in-process engine (scheduler policy + worker runner, CUDA graphs unless --enforce-eager); the
time per token is (last token - first token) / (n - 1). The floor is the bytes every decode step
must read (all weights but the embedding table, of an MoE layer's experts only the top_k, plus the
context's K/V) over the device copy
bandwidth measured in the same run. With --hf, transformers' generate() on random weights of the
same architecture is timed the same way (time for 1 + n tokens minus time for 1, over n).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.gpu.common import (add_moe_configs_flag, apply_moe_configs, build_engine,
                                   copy_bandwidth, device_name, hf_random_model, save)
from kernels import pdl, skinny_gemm
from services.worker import ops
from shared.messages import SamplingParams
from shared.models import resolve_model


def graph_replay_ms(engine, lora: bool = False) -> float:
    """GPU time of the batch-1 decode graph alone (the step minus every host-side cost), and
    where it goes, kernel by kernel; ``lora``: the graph with LoRA's deltas (over the last
    step's adapter row, still in its buffer)."""
    graphs = engine.runner._graphs
    graph = (graphs.lora_graphs if lora else graphs.graphs)[1]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    end.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
    return start.elapsed_time(end) / 50


def lora_knobs(path: str) -> dict | None:
    """The worker's LoRA knobs for one adapter (None: LoRA off): one slot of its own rank."""
    if not path:
        return None
    rank = json.loads((Path(path) / "adapter_config.json").read_text())["r"]
    return {"enable_lora": True, "lora_modules": f"bench={path}", "max_loras": 1,
            "max_lora_rank": rank}


def unread_expert_bytes(model) -> int:
    """The bytes of the experts one token's step does not read: an MoE layer reads its
    top_k of num_experts experts (0 for a dense model)."""
    spec = model.config.moe
    if spec is None:
        return 0
    expert_bytes = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                       if ".mlp.experts." in name)
    return expert_bytes * (spec.local_experts - spec.top_k) // spec.local_experts


def trace_steps(engine, prompt: list[int], num_tokens: int, lora_names: list[str] | None
                ) -> dict:
    """One request of ``num_tokens`` under the profiler (this process: rank 0 under tensor
    parallelism, whose all-reduce kernels then include any wait for the other ranks): the
    kernels by total time, and the GPU's busy time (prompt included) against the decode steps'
    wall time (busy well under wall: the GPU waits for the host). The chrome trace (kernel
    by kernel, with the host's calls) goes to $OUT."""
    params = [SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)]
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as profile:
        (completion,), _stats = engine.generate([prompt], params, lora_names)
    print(profile.key_averages().table(sort_by="cuda_time_total", row_limit=25,
                                       max_name_column_width=70))
    kernels = sorted((event.time_range.start, event.time_range.end)
                     for event in profile.events()
                     if event.device_type == torch.autograd.DeviceType.CUDA)
    wall_ms = (completion.finish_time - completion.first_token_time) * 1e3
    busy_us = sum(end - start for start, end in kernels)
    out = os.environ.get("OUT")
    if out:
        profile.export_chrome_trace(os.path.join(out, "decode_trace.json"))
    summary = {"num_tokens": num_tokens, "decode_wall_ms_per_token": wall_ms / (num_tokens - 1),
               "gpu_busy_ms_all_steps": busy_us / 1e3, "num_kernels": len(kernels)}
    print("trace:", summary)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="dummy:llama-3.1-8b")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--num-tokens", type=int, default=128)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--quantization", choices=("none", "fp8", "int4"), default="none",
                        help="fp8: the projections' weights in FP8; int4: 4-bit packed, "
                             "groups of 128 with zero points (the worker's flag)")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto",
                        help="fp8: keys and values in FP8 (the worker's flag)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="spread the model over this many GPUs (the worker's flag)")
    parser.add_argument("--disable-custom-all-reduce", action="store_true",
                        help="tensor parallel: every all-reduce by NCCL (the worker's flag)")
    parser.add_argument("--speculative-config", default="",
                        help="JSON as flotilla serve takes it, e.g. a draft_model at a "
                             "synthetic acceptance (issue 28's comparison with vLLM)")
    parser.add_argument("--hf", action="store_true", help="also time transformers generate()")
    parser.add_argument("--hf-tokens", type=int, default=32)
    parser.add_argument("--norm-in-reduce", choices=["on", "off"],
                        help="off: the two kernels instead of the norm in the split-K reduce "
                        "(default: on, the path)")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the worker's --batch-invariant (what the exact mode costs)")
    parser.add_argument("--trace", type=int, default=0, metavar="TOKENS",
                        help="also profile one request of this many tokens on rank 0: the "
                             "busiest kernels, GPU busy time a step, and a chrome trace "
                             "under $OUT")
    parser.add_argument("--pdl", choices=["on", "off"],
                        help="kernels.pdl.PDL, programmatic dependent launch (default: on "
                        "where the GPU has it)")
    parser.add_argument("--skinny", choices=["on", "off"], default="on",
                        help="off: every projection on cuBLAS (or the scaled FP8 GEMM), to "
                             "measure the skinny GEMM's table against it")
    add_moe_configs_flag(parser)
    parser.add_argument("--lora", default="", metavar="DIR",
                        help="the request runs with this PEFT LoRA adapter (LoRA on, 1 slot)")
    args = parser.parse_args()
    if args.skinny == "off":
        skinny_gemm.serves = skinny_gemm.serves_gated = lambda *_: False
    if args.norm_in_reduce == "off":
        ops.norm_in_reduce = lambda *_: False
    if args.pdl:
        pdl.PDL = args.pdl == "on"
    norm_in_reduce = args.norm_in_reduce != "off"

    moe_configs = apply_moe_configs(args.moe_configs, resolve_model(args.model))
    print("moe configs:", moe_configs)
    bandwidth = copy_bandwidth()
    engine = build_engine(args.model, max_model_len=args.context + args.num_tokens + 16,
                          max_num_seqs=8, max_num_batched_tokens=2048,
                          gpu_memory_utilization=0.45 if args.hf else 0.9,
                          enforce_eager=args.enforce_eager, quantization=args.quantization,
                          tensor_parallel_size=args.tensor_parallel_size,
                          kv_cache_dtype=args.kv_cache_dtype,
                          speculative_config=args.speculative_config,
                          disable_custom_all_reduce=args.disable_custom_all_reduce,
                          batch_invariant=args.batch_invariant,
                          lora=lora_knobs(args.lora))
    lora_names = ["bench"] if args.lora else None
    model = engine.runner.model
    config = model.config
    # (packed integer projections are buffers: int_qweight, int_scales, ...)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for name, b in model.named_buffers()
        if name.rpartition(".")[2].startswith("int_"))
    embed_bytes = model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    read_bytes = (weight_bytes - (0 if config.tie_word_embeddings else embed_bytes)
                  - unread_expert_bytes(model))
    # this rank's part of the weights and KV cache (tensor parallel: each rank reads its own)
    kv_bytes = (2 * config.num_layers * args.context * config.num_kv_heads * config.head_dim
                * engine.runner.kv_cache.element_size())
    floor_ms = (read_bytes + kv_bytes) / bandwidth * 1e3

    # the ids vLLM's latency run sends (benchmarks/peers/vllm/vllm_offline.py: the same token
    # ids in both engines; all below Mixtral's 32,000)
    prompt = [100 + (j * 7919) % 30_000 for j in range(args.context)]
    params = [SamplingParams(max_tokens=args.num_tokens, temperature=0.0, ignore_eos=True)]
    engine.generate([prompt], params, lora_names)  # warm-up (the adapter into its slot too)
    runs = []
    for _ in range(3):
        (completion,), _stats = engine.generate([prompt], params, lora_names)
        runs.append((completion.finish_time - completion.first_token_time)
                    / (args.num_tokens - 1) * 1e3)
    ms_per_token = sorted(runs)[1]
    # (a graph of collectives replays only with every rank: not under tensor parallelism)
    gpu_ms = graph_replay_ms(engine, bool(args.lora)) \
        if not args.enforce_eager and args.tensor_parallel_size == 1 else None
    result = {"benchmark": "decode_latency", "device": device_name(), "model": args.model,
              "moe_configs": moe_configs, "skinny": args.skinny,
              "context": args.context, "num_tokens": args.num_tokens,
              "cuda_graphs": not args.enforce_eager, "ms_per_token": ms_per_token,
              "runs_ms": runs, "floor_ms": floor_ms, "share_of_floor": floor_ms / ms_per_token,
              "copy_bandwidth_tb_s": bandwidth / 1e12, "weight_bytes": weight_bytes,
              "graph_replay_ms": gpu_ms, "norm_in_reduce": norm_in_reduce,
              "pdl": pdl.enabled(), "quantization": args.quantization,
              "tensor_parallel_size": args.tensor_parallel_size,
              "kv_cache_dtype": args.kv_cache_dtype,
              "speculative_config": args.speculative_config or None,
              "batch_invariant": args.batch_invariant, "lora": args.lora or None}
    books = engine.scheduler.draft_books
    if books.num_drafted_steps:
        result["tokens_per_verify_step"] = 1 + books.num_accepted_drafts / books.num_drafted_steps
    if args.hf:
        engine.close()
        del engine, model
        torch.cuda.empty_cache()
        hf_model = hf_random_model(resolve_model(args.model))
        ids = torch.tensor([prompt], device="cuda")

        def timed(num_new: int) -> float:
            torch.cuda.synchronize()
            started = time.perf_counter()
            with torch.inference_mode():
                hf_model.generate(input_ids=ids, max_new_tokens=num_new, min_new_tokens=num_new,
                                  do_sample=False, pad_token_id=0)
            torch.cuda.synchronize()
            return time.perf_counter() - started

        timed(2)
        hf_ms = (timed(1 + args.hf_tokens) - timed(1)) / args.hf_tokens * 1e3
        result |= {"hf_ms_per_token": hf_ms, "speedup_vs_hf": hf_ms / ms_per_token}
    suffix = f"_norm_in_reduce_{args.norm_in_reduce}" if args.norm_in_reduce else ""
    suffix += f"_pdl_{args.pdl}" if args.pdl else ""
    suffix += f"_{args.quantization}" if args.quantization != "none" else ""
    suffix += f"_tp{args.tensor_parallel_size}" if args.tensor_parallel_size > 1 else ""
    suffix += "_fp8kv" if args.kv_cache_dtype == "fp8" else ""
    suffix += "_spec" if args.speculative_config else ""
    suffix += "_batch_invariant" if args.batch_invariant else ""
    suffix += "_skinny_off" if args.skinny == "off" else ""
    suffix += "_lora" if args.lora else ""
    save(f"decode_latency_{args.model.replace(':', '_')}{suffix}", result)
    print(f"\nbatch-1 decode, ctx {args.context}, quantization {args.quantization}, "
          f"KV {args.kv_cache_dtype}, "
          f"TP {args.tensor_parallel_size}{', LoRA ' + args.lora if args.lora else ''}"
          f" (norm in reduce {'on' if norm_in_reduce else 'off'},"
          f" PDL {'on' if pdl.enabled() else 'off'})"
          f": {ms_per_token:.2f} ms/token; floor "
          f"{floor_ms:.2f} ms ({floor_ms / ms_per_token:.0%} of floor)"
          + (f"; graph replay {gpu_ms:.3f} ms" if gpu_ms is not None else "")
          + (f"; HF {result['hf_ms_per_token']:.1f} ms" if args.hf else "")
          + (f"; {result['tokens_per_verify_step']:.2f} tokens a verify step"
             if "tokens_per_verify_step" in result else ""))
    if args.trace and not args.hf:
        trace_steps(engine, prompt, args.trace, lora_names)
    if not args.hf:
        engine.close()


if __name__ == "__main__":
    main()
