"""Worker configuration."""

from __future__ import annotations

from shared.config import ServiceConfig


class WorkerConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla worker: owns the model weights and the paged KV cache; runs steps."""

    replica_id: str = "0"  # pairs this worker with the scheduler of the same replica
    device: str = "auto"  # "auto" (cuda if available, else cpu), "cpu", "cuda", "cuda:1"
    dtype: str = "auto"  # "auto" (bf16 on cuda, fp32 on cpu), "float32", "bfloat16", "float16"
    kv_cache_memory: str = "1GiB"  # bytes or e.g. 512MiB, 2GiB
    block_size: int = 16  # tokens per KV block
    max_model_len: int = 0  # 0: the model's max_position_embeddings
    num_threads: int = 0  # torch intra-op threads on CPU; 0: torch's default

    __help__ = {
        "replica_id": "replica this worker serves (its scheduler uses the same id)",
        "device": "auto, cpu, cuda or cuda:N",
        "dtype": "auto, float32, bfloat16 or float16",
        "kv_cache_memory": "memory for the KV cache, bytes or e.g. 512MiB, 2GiB",
        "block_size": "tokens per KV cache block",
        "max_model_len": "context length limit (0: the model's own)",
        "num_threads": "torch CPU threads (0: torch default)",
    }
