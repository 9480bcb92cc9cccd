"""Worker configuration: the sections it reads (shared/sections/), composed once."""

from __future__ import annotations

import os

from shared.config import compose
from shared.sections.engine import (  # noqa: F401 (the worker's modules import them from here)
    BatchLimits, Compute, ContextLimit, Dtype, KvCache, KvCacheDtype, Lora, OverlapSteps, Parallel,
    Quantization, Weights)
from shared.sections.kvstore import KvClient, KvLoads
from shared.sections.media import EncoderCache
from shared.sections.runtime import COMMON, Drain, Replica
from shared.sections.speculative import Speculation


def _check_across(config) -> None:
    if config.tensor_parallel_size > 1 and config.kv_node_id:
        raise ValueError("a tensor-parallel worker (tensor_parallel_size > 1) cannot use the "
                         "kvstore yet: leave kv_node_id empty")
    if config.batch_invariant and config.tensor_parallel_size > 1:
        raise ValueError("batch_invariant runs on one GPU: a tensor-parallel worker's sums "
                         "take other paths at other sizes")
    if not 0 <= config.num_speculative_tokens <= 16:
        raise ValueError(f"num_speculative_tokens must be between 0 and 16, not "
                         f"{config.num_speculative_tokens}")


WorkerConfig = compose(
    "WorkerConfig", "flotilla worker: owns the model weights and the paged KV cache; runs steps.",
    (*COMMON, Replica, Weights, ContextLimit, BatchLimits, KvCache, Compute, Parallel,
     Lora, Speculation, KvClient, KvLoads, EncoderCache, Drain),
    module=__name__, checks=(_check_across,))


def host_error(config: WorkerConfig, num_replicas: int = 1) -> str | None:
    """Why this host cannot run the worker ``config`` describes (a CPU for a CUDA-only knob,
    too few GPUs for the replicas' groups), or None. flotilla serve asks before it starts any
    process; the worker itself would refuse at load."""
    if config.on_cuda:
        return _gpu_count_error(config, num_replicas)
    if config.quantization == "int4":
        return "--quantization int4 needs a CUDA GPU; the worker would run on the CPU"
    for flag, value in (("--quantization", config.quantization),
                        ("--kv-cache-dtype", config.kv_cache_dtype)):
        if value == "fp8":
            return (f"{flag} fp8 needs a CUDA GPU with FP8 support (compute capability "
                    f"8.9+); the worker would run on the CPU")
    if config.batch_invariant:
        return ("--batch-invariant needs a worker on one CUDA GPU (not the CPU, no "
                "--tensor-parallel-size)")
    return None


def _gpu_count_error(config: WorkerConfig, num_replicas: int) -> str | None:
    import torch  # only here: checking a CPU worker's flags loads no torch

    # each replica's worker gets its own GPUs unless --device names the one they share
    shared_gpu = ":" in config.device
    needed = config.tensor_parallel_size * (1 if shared_gpu else num_replicas)
    visible = torch.cuda.device_count()  # CUDA_VISIBLE_DEVICES applied
    if needed <= visible:
        return None
    return (f"--tensor-parallel-size {config.tensor_parallel_size} with --replicas "
            f"{num_replicas} needs {needed} GPUs, but {visible} "
            f"{'is' if visible == 1 else 'are'} visible "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})")
