"""Pieces the GPU benchmarks share: ceilings measured on the machine, the engine under test,
and the Hugging Face peer on random weights of the same architecture."""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks.speculation_plugins import install, split_speculative_config
from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.models import ModelFiles, resolve_model
from shared.runtime import freeze_startup_objects


def copy_bandwidth(device: str = "cuda", num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy, bytes read plus written per second (median of 20)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * num_bytes / sorted(times[3:])[len(times[3:]) // 2]


def build_engine(model: str, *, max_model_len: int, max_num_seqs: int,
                 max_num_batched_tokens: int, gpu_memory_utilization: float = 0.9,
                 enforce_eager: bool = False, prefix_caching: bool = False,
                 overlap_steps: str = "auto", quantization: str = "none",
                 tensor_parallel_size: int = 1, kv_cache_dtype: str = "auto",
                 speculative_config: str = "", disable_custom_all_reduce: bool = False,
                 batch_invariant: bool = False, lora: dict | None = None) -> Engine:
    """``tensor_parallel_size`` > 1: ranks 1.. spawned on cuda:1.. (``engine.close()`` stops
    them). ``speculative_config``: vLLM's JSON, with the benchmark-only modes it may name
    (replay, synthetic acceptance) installed in process (benchmarks/speculation_plugins.py).
    ``lora``: the worker's LoRA knobs (enable_lora, lora_modules, max_loras, ...; None: off)."""
    speculation, modes = split_speculative_config(speculative_config)
    worker = WorkerConfig(device="cuda", dtype="bfloat16", quantization=quantization,
                          kv_cache_dtype=kv_cache_dtype,
                          tensor_parallel_size=tensor_parallel_size,
                          max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                          gpu_memory_utilization=gpu_memory_utilization,
                          enforce_eager=enforce_eager, overlap_steps=overlap_steps,
                          disable_custom_all_reduce=disable_custom_all_reduce,
                          batch_invariant=batch_invariant, **(lora or {}))
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                prefix_caching=prefix_caching,
                                speculative_config=speculation)
    engine = install(Engine(scheduler, worker, resolve_model(model)), modes)
    freeze_startup_objects()  # as the worker service: full collections skip the model
    return engine


def add_lora_flags(parser) -> None:
    """The worker's LoRA flags, as flotilla serve takes them (docs/lora.md)."""
    parser.add_argument("--enable-lora", action="store_true",
                        help="LoRA on (alone: no request names an adapter)")
    parser.add_argument("--lora-modules", default="",
                        help="name=path,...: adapters registered at start (implies --enable-lora)")
    parser.add_argument("--max-loras", type=int, default=8, help="device slots")
    parser.add_argument("--max-lora-rank", type=int, default=16)


def lora_knobs(args) -> dict | None:
    """build_engine's ``lora`` from add_lora_flags' flags (None: LoRA off)."""
    if not (args.enable_lora or args.lora_modules):
        return None
    return {"enable_lora": True, "lora_modules": args.lora_modules,
            "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank}


def hf_random_model(model_files: ModelFiles, dtype: torch.dtype = torch.bfloat16,
                    device: str = "cuda"):
    """transformers' own implementation of the same architecture, random weights on the GPU."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_files.path))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


@torch.inference_mode()
def hf_static_batches(hf_model, prompts: list[list[int]], output_lens: list[int],
                      batch_size: int, pad_id: int = 0) -> dict:
    """generate() over static batches (left-padded, greedy, EOS ignored): the tokens each
    request asked for count, not the padding or the batch's longest tail."""
    def run(batch_prompts, max_new):
        width = max(len(p) for p in batch_prompts)
        ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in batch_prompts], device="cuda")
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch_prompts],
                            device="cuda")
        hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new,
                          min_new_tokens=max_new, do_sample=False, pad_token_id=pad_id)

    run(prompts[:batch_size], 2)  # warm-up
    torch.cuda.synchronize()
    started = time.perf_counter()
    for first in range(0, len(prompts), batch_size):
        run(prompts[first:first + batch_size], max(output_lens[first:first + batch_size]))
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    num_in, num_out = sum(map(len, prompts)), sum(output_lens)
    return {"batch_size": batch_size, "num_prompts": len(prompts), "elapsed_s": elapsed,
            "output_tok_s": num_out / elapsed, "total_tok_s": (num_in + num_out) / elapsed}


def graph_us(fn, calls: int, replays: int, warm_calls: int = 1) -> float:
    """Median over replays of one CUDA graph of ``fn(i)`` for i in range(calls), per call, in
    µs; ``fn(i)`` for i < warm_calls first, outside the capture (Triton compiles, or loads
    from its disk cache)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(warm_calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def add_moe_configs_flag(parser) -> None:
    parser.add_argument("--moe-configs", choices=("tuned", "default"), default="tuned",
                        help="an MoE model's fused-GEMM plans: kernels/moe_configs.json's, or "
                             "the untuned default for every shape (to measure the tuning)")


def apply_moe_configs(choice: str, model_files: ModelFiles) -> str | None:
    """Set the MoE plans as --moe-configs says (before the engine is built); where an MoE
    model's plans come from (None: a dense model)."""
    from kernels import moe_configs
    from services.worker.model_config import ModelConfig

    if choice == "default":
        moe_configs.load_table = lambda path=None: {"device": None, "triton": None, "shapes": {}}
    config = ModelConfig.from_path(model_files.path)
    if config.moe is None:
        return None
    dtype = torch.bfloat16  # (the table's fp8 entries: the same lookup by weight dtype)
    return moe_configs.config_source(config.moe.num_experts, config.moe.intermediate_size,
                                     config.hidden_size, dtype)


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def save(name: str, result: dict) -> None:
    """Print the result as JSON and keep a copy under $OUT when the device tool set it."""
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    out = os.environ.get("OUT")
    if out:
        safe_name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name).strip("._")
        Path(out, f"{safe_name}.json").write_text(text)


def done_percentiles(done_s: list[float]) -> dict[str, float]:
    """When requests finished, seconds from the start: first, 10/50/90th percentile, last
    (the same for the in-process engine and the stack, to see where a run loses time)."""
    ordered = sorted(done_s)
    at = {"first": 0.0, "p10": 0.1, "p50": 0.5, "p90": 0.9, "last": 1.0}
    return {name: round(ordered[min(int(q * len(ordered)), len(ordered) - 1)], 2)
            for name, q in at.items()}
