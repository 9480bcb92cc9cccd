"""The engine flags (worker, scheduler, tokenizer) that ``flotilla serve`` and the stacks
``flotilla bench`` starts share, and the per-service arguments they become."""

from __future__ import annotations

import argparse
import os

from cli.stack import flags
from services.worker.config import Dtype, KvCacheDtype, Quantization
from shared import limits

# On a GPU the batch limits default to vLLM's (the worker sizes its KV cache after the CUDA
# graphs and these steps' activations, so they fit); on CPU, the services' own (shared/limits.py).
GPU_MAX_NUM_SEQS = 1024
GPU_MAX_NUM_BATCHED_TOKENS = 16384


def add_engine_flags(parser) -> None:
    """Add the flags to a parser or an argument group (defaults: the services' own)."""
    parser.add_argument("--kv-cache-memory", default=None, help="worker KV cache size, e.g. 2GiB")
    parser.add_argument("--max-num-seqs", default=None,
                        help=f"most requests running at once (default {GPU_MAX_NUM_SEQS} on a "
                             f"GPU, {limits.MAX_NUM_SEQS} on CPU)")
    parser.add_argument("--max-num-batched-tokens", default=None,
                        help=f"most tokens per step (default {GPU_MAX_NUM_BATCHED_TOKENS} on a "
                             f"GPU, {limits.MAX_NUM_BATCHED_TOKENS} on CPU)")
    parser.add_argument("--max-queued-requests", default=None,
                        help="most requests waiting per replica; more get 429 (default 4096)")
    parser.add_argument("--device", default=None, help="worker device: auto, cpu, cuda")
    parser.add_argument("--dtype", default=None, choices=list(Dtype),
                        help="worker dtype (default auto: bfloat16 on a GPU, float32 on CPU)")
    parser.add_argument("--quantization", default=None, choices=list(Quantization),
                        help="fp8: projection weights in FP8, quantized while loading (CUDA, "
                        "compute capability 8.9+; docs/quantization.md). Default none")
    parser.add_argument("--kv-cache-dtype", default=None, choices=list(KvCacheDtype),
                        help="fp8: keys and values in FP8, twice the KV blocks of bf16 (CUDA, "
                        "compute capability 8.9+; docs/quantization.md). Default auto: the "
                        "model's dtype")
    parser.add_argument("--gpu-memory-utilization", default=None,
                        help="share of GPU memory the worker uses (default 0.9)")
    parser.add_argument("--max-model-len", default=None,
                        help="context length limit (default: the model's own)")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="compute each request as if it ran alone, so greedy output never "
                        "changes with batching or speculative decoding (CUDA, one GPU a "
                        "worker; slower: docs/speculative-decoding.md)")
    parser.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                        help="spread each worker's model over N GPUs (one process each; a "
                        "stack of R replicas uses N*R GPUs). Default 1; docs/tensor-parallel.md")


def engine_service_args(args: argparse.Namespace) -> dict[str, list[str]]:
    """{"worker": [...], "scheduler": [...], "tokenizer": [...]}. The worker gets the batch
    limits too (it sizes its memory profile and CUDA graphs by them), and the tokenizer the
    context length too (the gateway holds prompts to what it says)."""
    on_gpu = worker_uses_gpu(args.device)
    batch_limits = flags(
        max_num_seqs=args.max_num_seqs or (GPU_MAX_NUM_SEQS if on_gpu else None),
        max_num_batched_tokens=args.max_num_batched_tokens
        or (GPU_MAX_NUM_BATCHED_TOKENS if on_gpu else None))
    worker = batch_limits + flags(
        kv_cache_memory=args.kv_cache_memory, device=args.device, dtype=args.dtype,
        quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=args.max_model_len)
    worker += ["--enforce-eager"] if args.enforce_eager else []
    worker += ["--batch-invariant"] if getattr(args, "batch_invariant", False) else []
    return {"worker": worker,
            "scheduler": batch_limits + flags(max_queued_requests=args.max_queued_requests),
            "tokenizer": flags(max_model_len=args.max_model_len)}


def engine_flag_error(args: argparse.Namespace) -> str | None:
    """What the worker would refuse at start, said before anything starts (else the stack would
    restart a worker that cannot start until it gives up): None when the flags can run."""
    if args.quantization == "fp8" and not worker_uses_gpu(args.device):
        return ("--quantization fp8 needs a CUDA GPU with FP8 tensor cores (compute "
                "capability 8.9+); the worker would run on the CPU")
    if args.kv_cache_dtype == "fp8" and not worker_uses_gpu(args.device):
        return ("--kv-cache-dtype fp8 needs a CUDA GPU with FP8 support (compute capability "
                "8.9+); the worker would run on the CPU")
    tensor_parallel_size = tensor_parallel_size_of(args)
    if getattr(args, "batch_invariant", False) and (
            not worker_uses_gpu(args.device) or tensor_parallel_size > 1):
        return ("--batch-invariant needs a worker on one CUDA GPU (not the CPU, no "
                "--tensor-parallel-size)")
    if tensor_parallel_size < 1:
        return f"--tensor-parallel-size must be at least 1, not {args.tensor_parallel_size}"
    if worker_uses_gpu(args.device):
        return gpu_count_error(tensor_parallel_size, getattr(args, "replicas", 1), args.device)
    return None


def gpu_count_error(tensor_parallel_size: int, replicas: int, device: str | None) -> str | None:
    """Why the visible GPUs are too few, or None: each replica's worker gets its own
    ``tensor_parallel_size`` of them (gpus_per_replica), unless --device names one for all."""
    import torch

    needed = tensor_parallel_size * (replicas if pins_replica_gpus(device) else 1)
    visible = torch.cuda.device_count()  # CUDA_VISIBLE_DEVICES applied
    if needed <= visible:
        return None
    return (f"--tensor-parallel-size {tensor_parallel_size} with --replicas {replicas} needs "
            f"{needed} GPUs, but {visible} {'is' if visible == 1 else 'are'} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")


def gpus_per_replica(args: argparse.Namespace) -> int | None:
    """GPUs the stack gives each replica's worker (StackOptions.worker_gpus), or None: the
    workers run on the CPU, or --device cuda:K names the GPU they share."""
    if not pins_replica_gpus(args.device):
        return None
    return tensor_parallel_size_of(args)


def tensor_parallel_size_of(args: argparse.Namespace) -> int:
    """--tensor-parallel-size, or the worker's default (1) when not given."""
    return 1 if args.tensor_parallel_size is None else args.tensor_parallel_size


def pins_replica_gpus(device: str | None) -> bool:
    """Whether the stack chooses each worker's GPUs: on CUDA without a GPU index in --device."""
    return worker_uses_gpu(device) and ":" not in (device or "")


def worker_uses_gpu(device: str | None) -> bool:
    """Whether a worker started with ``--device device`` (None: its default, auto) runs on CUDA."""
    if device is not None and device != "auto":
        return device.startswith("cuda")
    import torch  # only here: most CLI commands need no torch

    return torch.cuda.is_available()
