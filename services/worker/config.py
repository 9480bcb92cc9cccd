"""Worker configuration."""

from __future__ import annotations

from enum import StrEnum

from shared import limits
from shared.config import ServiceConfig, check_choice


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


class KvCacheDtype(StrEnum):
    """What the KV cache stores (docs/quantization.md)."""

    AUTO = "auto"  # the model's dtype
    FP8 = "fp8"  # e4m3, a scale per layer for keys and one for values; CUDA (sm 8.9+) only


class OverlapSteps(StrEnum):
    """Whether step N+1 is queued before step N is read back."""

    AUTO = "auto"  # on CUDA
    ON = "on"
    OFF = "off"


class WorkerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla worker: owns the model weights and the paged KV cache; runs steps."""

    replica_id: str = "0"  # pairs this worker with the scheduler of the same replica
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1"
    dtype: Dtype = Dtype.AUTO
    quantization: Quantization = Quantization.NONE
    kv_cache_dtype: KvCacheDtype = KvCacheDtype.AUTO
    kv_cache_memory: str = "auto"  # bytes or e.g. 512MiB, 2GiB; auto: 1GiB on CPU, profiled on GPU
    gpu_memory_utilization: float = 0.9  # share of the GPU the worker may use (weights + KV + rest)
    # the scheduler's batch limits (shared/limits.py): the largest step it will be sent sizes
    # the memory profile; CUDA graphs are captured up to the largest batch
    max_num_batched_tokens: int = limits.MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = limits.MAX_NUM_SEQS
    enforce_eager: bool = False  # no CUDA graphs
    # steps with prompt chunks up to this many tokens run as piecewise CUDA graphs; 0: eager.
    # The default covers the default step budget: an eager step's ~30 ms host launch (8B)
    # would hold the step in flight before it
    max_graph_tokens: int = limits.MAX_NUM_BATCHED_TOKENS
    overlap_steps: OverlapSteps = OverlapSteps.AUTO
    seed: int = 0  # random weights of dummy models
    # GPUs (CPU: processes) one worker spreads the model over: rank 0 is this process and the
    # only one on NATS; ranks 1.. are its children (tensor_parallel.py, tp_group.py)
    tensor_parallel_size: int = 1
    # s a step may take on the group before a rank is taken for hung and the group exits
    tensor_parallel_step_timeout: float = 30.0
    # tensor parallelism's small sums all by NCCL (one_shot_reduce.py: peer memory otherwise)
    disable_custom_all_reduce: bool = False
    # speculative decoding's draft model (method draft_model; flotilla serve sets it from
    # --speculative-config): as --model takes it; "": none
    draft_model: str = ""
    # every step computed so that a row's numbers do not depend on the rest of its step
    # (ops.batch_invariant): greedy output the same at any batch size and with speculation
    batch_invariant: bool = False
    # speculative decoding's K (flotilla serve sets it from --speculative-config): verify
    # steps of K + 1 tokens a request run as CUDA graphs; 0: none are captured
    num_speculative_tokens: int = 0
    block_size: int = 16  # tokens per KV block
    max_model_len: int = limits.MAX_MODEL_LEN  # the tokenizer's too (shared/limits.py)
    num_threads: int = 0  # torch intra-op threads on CPU; 0: torch's default
    kv_node_id: str = ""  # the node's kvstore (docs/kvstore.md); "": none
    # CUDA: loads from the kvstore copy layer groups in turn; a forward's layer waits for its
    # own group only (kv_load_groups.py); at most one group a layer; 1: the whole load first.
    # 8 on an H200 (Llama-3.1-8B, prefix16k host hit): TTFT 57 ms vs 59 with 4, 76 with 1
    kv_load_layer_groups: int = 8
    shutdown_timeout: float = 30.0  # s; on SIGTERM: serve steps until none came for 1 s, at most this

    __help__ = {
        "kv_node_id": "node id of the kvstore to use (empty: no kvstore)",
        "kv_load_layer_groups": "CUDA: copy each load from the kvstore in this many layer "
                                "groups (at most one a layer), so a forward's first layers "
                                "run while later ones still load (1: the whole load first; "
                                "8, the default, gave a "
                                "16k-token host hit a 57 ms TTFT on an H200, 0.097 of "
                                "recompute, against 59 ms with 4 and 76 ms with 1)",
        "replica_id": "replica this worker serves (its scheduler uses the same id)",
        "device": "auto, cpu, cuda or cuda:N",
        "dtype": "auto, float32, bfloat16 or float16",
        "quantization": "none, or fp8: the projections' weights in FP8 (e4m3, a scale per "
                        "output channel, quantized while loading), activations quantized per "
                        "token; half the weight memory, so more KV blocks. CUDA with FP8 tensor "
                        "cores (compute capability 8.9+: Ada, Hopper) only",
        "kv_cache_dtype": "auto (the model's dtype) or fp8: keys and values in FP8 (e4m3, a "
                          "scale per layer from the checkpoint or a calibration prefill at "
                          "start): twice the blocks of bf16 in the same memory. CUDA, compute "
                          "capability 8.9+ (docs/quantization.md)",
        "kv_cache_memory": "memory for the KV cache, bytes or e.g. 512MiB, 2GiB (auto: 1GiB on "
                           "CPU; on GPU what --gpu-memory-utilization leaves after profiling)",
        "gpu_memory_utilization": "share of GPU memory to use, 0-1",
        **limits.BATCH_LIMITS_HELP,
        "enforce_eager": "run every step eagerly: no CUDA graphs",
        "max_graph_tokens": "steps with prompt chunks of up to this many tokens run as CUDA "
                            "graphs between their attentions (0: eagerly)",
        "overlap_steps": "queue each step before the one before it is read back, so host work "
                         "hides behind the GPU's: auto (on CUDA), on or off",
        "seed": "seed of dummy models' random weights",
        "tensor_parallel_size": "spread the model over this many GPUs of this host (one process "
                                "each, NCCL; on CPU, processes over gloo): attention heads, MLP "
                                "and vocabulary split between them (docs/tensor-parallel.md)",
        "tensor_parallel_step_timeout": "seconds a step may take on a tensor-parallel group "
                                        "before the group is taken for hung and exits (its "
                                        "supervisor restarts it; requests migrate)",
        "disable_custom_all_reduce": "sum every tensor-parallel all-reduce with NCCL; by "
                                     "default decode-sized ones are one kernel over GPU peer "
                                     "memory (docs/tensor-parallel.md)",
        "batch_invariant": "CUDA: compute each request's numbers as if it ran alone (every "
                           "projection on the batch-invariant skinny GEMM, attention without "
                           "split-KV), so greedy output never changes with batching or "
                           "speculative decoding; slower (docs/speculative-decoding.md)",
        "draft_model": "the model that drafts tokens for speculative decoding's draft_model "
                       "method (a directory, .gguf, smollm2 or dummy:<preset>; the served "
                       "model's tokenizer); flotilla serve sets it from --speculative-config",
        "num_speculative_tokens": "speculative decoding's drafts a request a step: steps that "
                                  "verify that many for every request run as CUDA graphs "
                                  "(flotilla serve sets it from --speculative-config; 0: none)",
        "block_size": "tokens per KV cache block",
        **limits.CONTEXT_LIMIT_HELP,
        "num_threads": "torch CPU threads (0: torch default)",
        "shutdown_timeout": "on SIGTERM, keep serving steps until none came for a second "
                              "(its scheduler drained), at most this long; then exit",
    }

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not "
                             f"{self.gpu_memory_utilization}")
        check_choice(self.dtype, Dtype, "dtype")
        check_choice(self.quantization, Quantization, "quantization")
        check_choice(self.kv_cache_dtype, KvCacheDtype, "kv_cache_dtype")
        check_choice(self.overlap_steps, OverlapSteps, "overlap_steps")
        if self.max_graph_tokens < 0:
            raise ValueError(f"max_graph_tokens must be >= 0, not {self.max_graph_tokens}")
        if self.kv_load_layer_groups < 1:
            raise ValueError(f"kv_load_layer_groups must be at least 1, not "
                             f"{self.kv_load_layer_groups}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be at least 1, not "
                             f"{self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.kv_node_id:
            raise ValueError("a tensor-parallel worker (tensor_parallel_size > 1) cannot use "
                             "the kvstore yet: leave kv_node_id empty")
        if not 0 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be between 0 and 16, not "
                             f"{self.num_speculative_tokens}")
        if self.batch_invariant and self.tensor_parallel_size > 1:
            raise ValueError("batch_invariant runs on one GPU: a tensor-parallel worker's sums "
                             "take other paths at other sizes")
        if self.tensor_parallel_step_timeout <= 0:
            raise ValueError(f"tensor_parallel_step_timeout must be positive, not "
                             f"{self.tensor_parallel_step_timeout}")
        limits.check_batch_limits(self.max_num_seqs, self.max_num_batched_tokens)
        limits.check_context_limit(self.max_model_len)
