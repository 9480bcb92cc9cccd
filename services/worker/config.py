"""Worker configuration."""

from __future__ import annotations

from shared.config import ServiceConfig


class WorkerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla worker: owns the model weights and the paged KV cache; runs steps."""

    replica_id: str = "0"  # pairs this worker with the scheduler of the same replica
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16", "float16"
    kv_cache_memory: str = "auto"  # bytes or e.g. 512MiB, 2GiB; auto: 1GiB on CPU, profiled on GPU
    gpu_memory_utilization: float = 0.9  # share of the GPU the worker may use (weights + KV + rest)
    max_num_batched_tokens: int = 2048  # the largest step it will be sent (memory profiling)
    max_num_seqs: int = 64  # the largest batch: CUDA graphs are captured up to it
    enforce_eager: bool = False  # no CUDA graphs
    # steps with prompt chunks up to this many tokens run as piecewise CUDA graphs; 0: eager
    max_graph_tokens: int = 512
    # queue step N+1 before reading step N back: "auto" (on CUDA), "on" or "off"
    overlap_steps: str = "auto"
    seed: int = 0  # random weights of dummy models
    block_size: int = 16  # tokens per KV block
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    num_threads: int = 0  # torch intra-op threads on CPU; 0: torch's default
    kv_node_id: str = ""  # the node's kvstore (docs/kvstore.md); "": none
    # CUDA: loads from the kvstore copy layer groups in turn; a forward's layer waits for its
    # own group only (kv_load_groups.py); at most one group a layer; 1: the whole load first.
    # 4 on an H200 (Llama-3.1-8B, prefix16k host hit): TTFT 65 ms vs 76 ms with 1
    kv_load_layer_groups: int = 4
    shutdown_timeout: float = 30.0  # s; on SIGTERM: serve steps until none came for 1 s, at most this

    __help__ = {
        "kv_node_id": "node id of the kvstore to use (empty: no kvstore)",
        "kv_load_layer_groups": "CUDA: copy each load from the kvstore in this many layer "
                                "groups (at most one a layer), so a forward's first layers "
                                "run while later ones still load (1: the whole load first; "
                                "4, the default, gave a 16k-token host hit a 65 ms TTFT on "
                                "an H200, 0.111 of recompute, against 76 ms with 1)",
        "replica_id": "replica this worker serves (its scheduler uses the same id)",
        "device": "auto, cpu, cuda or cuda:N",
        "dtype": "auto, float32, bfloat16 or float16",
        "kv_cache_memory": "memory for the KV cache, bytes or e.g. 512MiB, 2GiB (auto: 1GiB on "
                           "CPU; on GPU what --gpu-memory-utilization leaves after profiling)",
        "gpu_memory_utilization": "share of GPU memory to use, 0-1",
        "max_num_batched_tokens": "most tokens in one step (sizes the memory profile)",
        "max_num_seqs": "most sequences in one step (CUDA graph batch sizes)",
        "enforce_eager": "run every step eagerly: no CUDA graphs",
        "max_graph_tokens": "steps with prompt chunks of up to this many tokens run as CUDA "
                            "graphs between their attentions (0: eagerly)",
        "overlap_steps": "queue each step before the one before it is read back, so host work "
                         "hides behind the GPU's: auto (on CUDA), on or off",
        "seed": "seed of dummy models' random weights",
        "block_size": "tokens per KV cache block",
        "max_model_len": "context length limit (0: the model's own)",
        "num_threads": "torch CPU threads (0: torch default)",
        "shutdown_timeout": "on SIGTERM, keep serving steps until none came for a second "
                              "(its scheduler drained), at most this long; then exit",
    }

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], not "
                             f"{self.gpu_memory_utilization}")
        if self.overlap_steps not in ("auto", "on", "off"):
            raise ValueError(f"overlap_steps must be auto, on or off, not {self.overlap_steps!r}")
        if self.max_graph_tokens < 0:
            raise ValueError(f"max_graph_tokens must be >= 0, not {self.max_graph_tokens}")
        if self.kv_load_layer_groups < 1:
            raise ValueError(f"kv_load_layer_groups must be at least 1, not "
                             f"{self.kv_load_layer_groups}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")
