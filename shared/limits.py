"""The engine's per-device defaults, in one place: the batch limits (the scheduler plans steps
within them; the worker sizes its memory profile and CUDA graphs by the same ones) and the
decode-stall target of a GPU worker's streams. The knobs themselves are declared in
shared/sections/engine.py and shared/sections/scheduling.py."""

from __future__ import annotations

# On a CPU: the knobs' own defaults.
MAX_NUM_SEQS = 64  # requests running at once
MAX_NUM_BATCHED_TOKENS = 2048  # tokens computed in one step: decodes and prompt chunks
MAX_MODEL_LEN = 0  # context length; 0: the model's own (max_position_embeddings)

# On a GPU, vLLM's: the worker sizes its KV cache after the CUDA graphs and these steps'
# activations, so they fit. flotilla serve and flotilla bench apply them when the worker
# runs on CUDA and the flag is not given.
GPU_MAX_NUM_SEQS = 1024
GPU_MAX_NUM_BATCHED_TOKENS = 16384
# A GPU worker's streams: steps that also take a prompt chunk last at most this long unless
# --max-decode-stall-ms says otherwise (services/scheduler/chunk_pacer.py says why 300).
GPU_DECODE_STALL_MS = 300.0


def device_defaults(on_gpu: bool) -> dict[str, int]:
    """The batch limits' defaults where the worker runs (knob name -> value)."""
    if not on_gpu:
        return {"max_num_seqs": MAX_NUM_SEQS, "max_num_batched_tokens": MAX_NUM_BATCHED_TOKENS}
    return {"max_num_seqs": GPU_MAX_NUM_SEQS, "max_num_batched_tokens": GPU_MAX_NUM_BATCHED_TOKENS}
