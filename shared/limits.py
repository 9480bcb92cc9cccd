"""The engine's limits, read by more than one service: the scheduler plans steps within the
batch limits and the worker sizes its memory profile and CUDA graphs by the same ones; the
tokenizer (so the gateway) and the worker hold requests to the same context length. Their
defaults, help and checks live here once; each service's config declares the fields with
these defaults (msgspec structs take one base, and the three services need different sets),
and ``flotilla serve`` passes one value to every service that reads it."""

from __future__ import annotations

MAX_NUM_SEQS = 64  # requests running at once (CPU default; flotilla serve raises it on a GPU)
MAX_NUM_BATCHED_TOKENS = 2048  # tokens computed in one step: decodes and prompt chunks
MAX_MODEL_LEN = 0  # context length; 0: the model's own (max_position_embeddings)

BATCH_LIMITS_HELP = {
    "max_num_seqs": "most requests running at once: the scheduler's batch, the worker's "
                    "largest CUDA graph",
    "max_num_batched_tokens": "most tokens computed in one step (the worker's memory "
                              "profile is sized by it)",
}
CONTEXT_LIMIT_HELP = {"max_model_len": "context length limit (0: the model's own)"}


def check_batch_limits(max_num_seqs: int, max_num_batched_tokens: int) -> None:
    if max_num_seqs < 1 or max_num_batched_tokens < 1:
        raise ValueError("max_num_seqs and max_num_batched_tokens must be at least 1")


def check_context_limit(max_model_len: int) -> None:
    if max_model_len < 0:
        raise ValueError(f"max_model_len must be 0 (the model's own) or positive, "
                         f"not {max_model_len}")
