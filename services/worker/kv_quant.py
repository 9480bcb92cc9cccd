"""The KV cache's dtype, and an FP8 cache's scales (``--kv-cache-dtype fp8``).

An FP8 cache (e4m3) holds each layer's keys divided by its ``k_scale`` and its values by its
``v_scale`` (kernels/kv_cache.py writes them so, kernels/paged_attention.py multiplies back):
half the bytes of bf16, so twice the blocks in the same memory and half the bytes a decode's
attention reads. The scales come from the checkpoint where it ships them (compressed-tensors'
``kv_cache_scheme`` writes ``self_attn.k_scale`` / ``v_scale``), else from one calibration
prefill at start-up: the largest |key| and |value| each layer writes for CALIBRATION_TOKENS
seeded random tokens, with HEADROOM for real text, rounded up to a power of 2 (so the
kernels' widening and rescaling are exact, and a restart that draws the same amax to within
a factor 2 gets the same scales and so the same kvstore namespace). Values beyond
448 * scale saturate; e4m3's normal range spans 2^15, so the headroom costs small values
little.

The scales are baked into the CUDA graphs as launch arguments: they are set before capture
and never change while the worker lives.
"""

from __future__ import annotations

import hashlib
import math

import structlog
import torch

from kernels.paged_attention_ref import FP8_KV_DTYPE, FP8_KV_MAX, allocate_kv_cache
from services.worker.config import KvCacheDtype
from services.worker.memory import prefill_metadata
from services.worker.model import Transformer
from services.worker.weights import require_fp8_device

log = structlog.get_logger()

CALIBRATION_TOKENS = 512
CALIBRATION_SEED = 1234
HEADROOM = 2.0  # the calibrated amax lands at 448 / 4 .. 448 / 2 of e4m3's range


def resolve_kv_cache_dtype(requested: str, model_dtype: torch.dtype, device: torch.device
                           ) -> torch.dtype:
    """The cache's torch dtype; a clear error naming the flag where FP8 cannot run."""
    if requested == KvCacheDtype.AUTO:
        return model_dtype
    require_fp8_device(f"--kv-cache-dtype {requested}", device)
    return FP8_KV_DTYPE


def power_of_two_scale(amax: float) -> float:
    """The smallest power of 2 that maps amax * HEADROOM within e4m3's range."""
    wanted = max(amax, 1e-6) * HEADROOM / FP8_KV_MAX
    return 2.0 ** math.ceil(math.log2(wanted))


def set_fp8_kv_scales(model: Transformer, block_size: int, device: torch.device,
                      dtype: torch.dtype) -> None:
    """Give every attention layer its FP8 scales: the checkpoint's (``model.checkpoint_kv_scales``)
    where it has them for every layer, else calibrated."""
    from_checkpoint = getattr(model, "checkpoint_kv_scales", {})
    if len(from_checkpoint) == len(model.layers):
        scales = [from_checkpoint[index] for index in range(len(model.layers))]
        source = "checkpoint"
    else:
        scales = calibrate_kv_scales(model, block_size, device, dtype)
        source = "calibration"
    for layer, (k_scale, v_scale) in zip(model.layers, scales, strict=True):
        layer.self_attn.k_scale, layer.self_attn.v_scale = k_scale, v_scale
    log.info("fp8_kv_scales", source=source, k_scales=sorted({k for k, _ in scales}),
             v_scales=sorted({v for _, v in scales}))


@torch.inference_mode()
def calibrate_kv_scales(model: Transformer, block_size: int, device: torch.device,
                        dtype: torch.dtype) -> list[tuple[float, float]]:
    """One prefill of seeded random tokens into a scratch cache in the model's dtype: per
    layer, (k_scale, v_scale) from the largest |key| and |value| written. Every tensor-
    parallel rank runs it in step (the forward all-reduces) and scales its own heads."""
    config = model.config
    num_blocks = -(-CALIBRATION_TOKENS // block_size)
    # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
    scratch = allocate_kv_cache(config.num_layers, num_blocks, block_size, config.num_kv_heads,
                                config.head_dim, dtype, device)
    model.bind_kv_cache(scratch)
    generator = torch.Generator().manual_seed(CALIBRATION_SEED)
    input_ids = torch.randint(0, config.vocab_size, (CALIBRATION_TOKENS,), generator=generator)
    metadata = prefill_metadata([CALIBRATION_TOKENS], block_size, 1, device)
    model(input_ids.to(device), torch.arange(CALIBRATION_TOKENS, device=device), metadata)
    amax = scratch.abs().amax(dim=(2, 3, 4, 5)).float().cpu()  # [num_layers, 2]
    model.bind_kv_cache(None)
    return [(power_of_two_scale(float(k)), power_of_two_scale(float(v))) for k, v in amax]


def kv_scales_tag(model: Transformer) -> str:
    """A short name for the layers' FP8 scales, part of the kvstore namespace (KvLayout): blocks
    written with other scales mean other values."""
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in model.layers]
    return hashlib.sha256(repr(scales).encode()).hexdigest()[:12]
