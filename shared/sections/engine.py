"""The engine's knobs: what the worker computes with, how much it holds at once, how it
spreads over GPUs; the batch limits and context length it shares with the scheduler and the
tokenizer."""

from __future__ import annotations

import json
from enum import StrEnum
from typing import Annotated

from shared import limits
from shared.config import Section, check_choice, knob


class Dtype(StrEnum):
    """The weights' and KV cache's dtype."""

    AUTO = "auto"  # bfloat16 on CUDA, float32 on CPU
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Quantization(StrEnum):
    """How the projections' weights are stored and multiplied (docs/quantization.md)."""

    NONE = "none"  # in --dtype
    FP8 = "fp8"  # e4m3, a scale per output channel, quantized while loading; CUDA (sm 8.9+) only
    INT4 = "int4"  # 4 bits, groups of 128 with zero points, rounded while loading; CUDA only


class KvCacheDtype(StrEnum):
    """What the KV cache stores (docs/quantization.md)."""

    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # e4m3, a scale per layer for keys and one for values; CUDA (sm 8.9+) only


class OverlapSteps(StrEnum):
    """Whether step N+1 is queued before step N is read back."""

    AUTO = "auto"  # on CUDA
    ON = "on"
    OFF = "off"


class BatchLimits(Section, frozen=True, kw_only=True):
    """The scheduler plans within them; the worker sizes its memory profile and its CUDA
    graphs by them. Per-device defaults: shared/limits.py."""

    max_num_seqs: Annotated[int, knob(
        f"most requests running at once: the scheduler's batch, the worker's largest CUDA "
        f"graph (default {limits.GPU_MAX_NUM_SEQS} when the worker runs on a GPU under "
        f"flotilla serve)")] = limits.MAX_NUM_SEQS
    max_num_batched_tokens: Annotated[int, knob(
        f"most tokens computed in one step, decodes and prompt chunks (the worker's memory "
        f"profile is sized by it; default {limits.GPU_MAX_NUM_BATCHED_TOKENS} when the worker "
        f"runs on a GPU under flotilla serve)")] = limits.MAX_NUM_BATCHED_TOKENS

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


class ContextLimit(Section, frozen=True, kw_only=True):
    """The worker and the tokenizer (so the gateway) hold requests to one context length."""

    max_model_len: Annotated[int, knob(
        "context length limit (0: the model's own)")] = limits.MAX_MODEL_LEN

    def __post_init__(self) -> None:
        if self.max_model_len < 0:
            raise ValueError(f"max_model_len must be 0 (the model's own) or positive, "
                             f"not {self.max_model_len}")


class Weights(Section, frozen=True, kw_only=True):
    dtype: Annotated[Dtype, knob(
        "the weights' and activations' dtype: auto (bfloat16 on a GPU, float32 on CPU), "
        "float32, bfloat16 or float16")] = Dtype.AUTO
    quantization: Annotated[Quantization, knob(
        "none, or fp8: the projections' weights in FP8 (e4m3, a scale per output channel, "
        "quantized while loading), activations quantized per token; half the weight memory, "
        "so more KV blocks. CUDA with FP8 tensor cores (compute capability 8.9+: Ada, "
        "Hopper) only; or int4: 4-bit weights (groups of 128 with zero points, rounded to "
        "nearest while loading, a dummy model's as drawn) kept packed on a CUDA GPU, "
        "multiplied by the W4A16 kernels; quality unmeasured, meant for benchmarks. An "
        "integer checkpoint (AWQ, GPTQ, compressed-tensors) stays packed on one GPU without "
        "it (docs/quantization.md)")] = Quantization.NONE
    seed: Annotated[int, knob("seed of dummy models' random weights")] = 0

    def __post_init__(self) -> None:
        check_choice(self.dtype, Dtype, "dtype")
        check_choice(self.quantization, Quantization, "quantization")


class KvCache(Section, frozen=True, kw_only=True):
    kv_cache_memory: Annotated[str, knob(
        "memory for the KV cache, bytes or e.g. 512MiB, 2GiB (auto: 1GiB on CPU; on a GPU "
        "what --gpu-memory-utilization leaves after profiling)")] = "auto"
    kv_cache_dtype: Annotated[KvCacheDtype, knob(
        "auto (the model's dtype) or fp8: keys and values in FP8 (e4m3, a scale per layer "
        "from the checkpoint or a calibration prefill at start): twice the blocks of bf16 in "
        "the same memory. CUDA, compute capability 8.9+ (docs/quantization.md)")] = \
        KvCacheDtype.AUTO
    gpu_memory_utilization: Annotated[float, knob(
        "share of the GPU's memory the worker uses, 0-1 (weights, KV cache, the rest)")] = 0.9
    block_size: Annotated[int, knob("tokens per KV cache block")] = 16

    def __post_init__(self) -> None:
        check_choice(self.kv_cache_dtype, KvCacheDtype, "kv_cache_dtype")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not "
                             f"{self.gpu_memory_utilization}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, not {self.block_size}")


class Compute(Section, frozen=True, kw_only=True):
    device: Annotated[str, knob("where the worker runs: auto (CUDA when there is a GPU), cpu, "
                                "cuda or cuda:N")] = "auto"
    enforce_eager: Annotated[bool, knob("run every step eagerly: no CUDA graphs")] = False
    max_graph_tokens: Annotated[int, knob(
        "steps with prompt chunks of up to this many tokens run as piecewise CUDA graphs "
        "between their attentions (0: eagerly); the default covers the default step budget, "
        "since an eager step's host launch (~30 ms, 8B) holds the step in flight before it")] \
        = limits.MAX_NUM_BATCHED_TOKENS
    overlap_steps: Annotated[OverlapSteps, knob(
        "queue each step before the one before it is read back, so host work hides behind "
        "the GPU's: auto (on CUDA), on or off")] = OverlapSteps.AUTO
    batch_invariant: Annotated[bool, knob(
        "CUDA, one GPU a worker: compute each request's numbers as if it ran alone (every "
        "projection on the batch-invariant skinny GEMM, attention without split-KV), so "
        "greedy output never changes with batching or speculative decoding; slower "
        "(docs/speculative-decoding.md)")] = False
    num_threads: Annotated[int, knob("torch CPU threads (0: torch's default)")] = 0

    def __post_init__(self) -> None:
        check_choice(self.overlap_steps, OverlapSteps, "overlap_steps")
        if self.max_graph_tokens < 0:
            raise ValueError(f"max_graph_tokens must be >= 0, not {self.max_graph_tokens}")

    @property
    def on_cuda(self) -> bool:
        """Whether the worker runs on CUDA (auto: when torch sees a GPU)."""
        if self.device != "auto":
            return self.device.startswith("cuda")
        import torch  # only here: the CLI checks a worker's flags without loading torch else

        return torch.cuda.is_available()


class Parallel(Section, frozen=True, kw_only=True):
    tensor_parallel_size: Annotated[int, knob(
        "spread each worker's model over this many GPUs of its host (one process each, NCCL; "
        "on CPU, processes over gloo): attention heads, MLP and vocabulary split between "
        "them; a stack of R replicas uses N*R GPUs (docs/tensor-parallel.md)")] = 1
    tensor_parallel_step_timeout: Annotated[float, knob(
        "seconds a step may take on a tensor-parallel group before the group is taken for "
        "hung and exits (its supervisor restarts it; requests migrate)")] = 30.0
    enable_expert_parallel: Annotated[bool, knob(
        "split a Mixture-of-Experts model's experts whole between the tensor-parallel ranks "
        "(each rank computes the tokens routed to its experts) instead of slicing every "
        "expert; refused for a dense model (docs/moe.md)")] = False
    disable_custom_all_reduce: Annotated[bool, knob(
        "sum every tensor-parallel all-reduce with NCCL; by default decode-sized ones are one "
        "kernel over GPU peer memory (docs/tensor-parallel.md)")] = False

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, not "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_step_timeout <= 0:
            raise ValueError(f"tensor_parallel_step_timeout must be positive, not "
                             f"{self.tensor_parallel_step_timeout}")


class Lora(Section, frozen=True, kw_only=True):
    """LoRA adapters on the base model (docs/lora.md): registered at start, kept in host
    memory, copied into device slots as requests need them."""

    enable_lora: Annotated[bool, knob(
        "serve LoRA adapters (PEFT format) on top of the base model; base requests run as "
        "without it (docs/lora.md)")] = False
    lora_modules: Annotated[str, knob(
        "the adapters, name=path,name2=path2 (each path a PEFT directory: adapter_config.json "
        "and adapter_model.safetensors); needs --enable-lora")] = ""
    max_loras: Annotated[int, knob(
        "device slots: the most adapters one step computes with")] = 4
    max_lora_rank: Annotated[int, knob(
        "the largest adapter rank; each slot holds this rank (smaller ranks zero-padded)")] = 16
    max_cpu_loras: Annotated[int, knob(
        "adapters kept loaded in host memory (0: every registered one); the rest are read "
        "from disk again when a request needs them")] = 0

    def __post_init__(self) -> None:
        modules = self.lora_module_list  # (parsed: a bad entry names itself)
        if modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora")
        for name, value, minimum in (("max_loras", self.max_loras, 1),
                                     ("max_lora_rank", self.max_lora_rank, 1),
                                     ("max_cpu_loras", self.max_cpu_loras, 0)):
            if value < minimum:
                raise ValueError(f"{name} must be at least {minimum}, not {value}")
        if 0 < self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras {self.max_cpu_loras} is below max_loras "
                             f"{self.max_loras}: every device slot's adapter is in host memory")

    @property
    def lora_module_list(self) -> list[tuple[str, str]]:
        """``lora_modules`` as (name, path) pairs, in order; a ValueError names a bad entry."""
        return parse_lora_modules(self.lora_modules)


def parse_lora_modules(text: str) -> list[tuple[str, str]]:
    """"name=path,name2=path2", or vLLM's JSON form (an object or a list of objects with
    "name", "path" and optionally "base_model_name") -> [(name, path), ...]: names unique
    and non-empty."""
    text = text.strip()
    if text.startswith(("{", "[")):
        entries = _json_lora_modules(text)
    else:
        entries = []
        for entry in filter(None, (part.strip() for part in text.split(","))):
            name, sep, path = (part.strip() for part in entry.partition("="))
            if not sep:
                raise ValueError(f"lora_modules entry {entry!r} is not name=path")
            entries.append((name, path))
    pairs: list[tuple[str, str]] = []
    for name, path in entries:
        if not name or not path:
            raise ValueError(f"lora_modules entry {name}={path} is not name=path")
        if name in (seen for seen, _ in pairs):
            raise ValueError(f"lora_modules names {name!r} twice")
        pairs.append((name, path))
    return pairs


def _json_lora_modules(text: str) -> list[tuple[str, str]]:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"lora_modules is not valid JSON: {exc}") from None
    entries = [value] if isinstance(value, dict) else value
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError("lora_modules JSON must be an object or a list of objects")
    for entry in entries:
        unknown = set(entry) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(entry.get("name"), str) \
                or not isinstance(entry.get("path"), str):
            raise ValueError(f"lora_modules entry {json.dumps(entry)} needs string \"name\" "
                             "and \"path\" (and at most \"base_model_name\")")
    return [(entry["name"].strip(), entry["path"].strip()) for entry in entries]
