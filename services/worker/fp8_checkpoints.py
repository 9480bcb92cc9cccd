"""Checkpoints that ship FP8 weights, detected from config.json's ``quantization_config``:

- **compressed-tensors** (what llm-compressor writes): ``quant_method: "compressed-tensors"``,
  ``format: "float-quantized"``, FP8 weights with ``weight_scale`` per output channel
  ([N, 1], strategy ``channel``) or per tensor ([1], strategy ``tensor``), activations dynamic.
- **fp8 with block scales** (the official Qwen3-*-FP8 style): ``quant_method: "fp8"``,
  ``weight_block_size: [128, 128]``, FP8 weights with ``weight_scale_inv`` [ceil(N / 128),
  ceil(K / 128)] (each a multiplier of its block).

The worker's FP8 kernels take one scale per output channel (kernels/fp8.py). Channel and
tensor scales are that already (a tensor scale repeated); block-scaled weights are dequantized
in fp32 and requantized per channel, which rounds each weight a second time (e4m3's 3 mantissa
bits: at most half a step more). Activation scales in a checkpoint (``input_scale``, static
schemes) are dropped: the worker quantizes activations per token in each step. A projection the
checkpoint left unquantized (its ``ignore`` list) is quantized per channel here.

A checkpoint calibrated for an FP8 KV cache (compressed-tensors' ``kv_cache_scheme``) ships
``self_attn.k_scale`` and ``v_scale`` per layer: ``pop_checkpoint_kv_scales`` takes them out
for ``--kv-cache-dtype fp8`` (services/worker/kv_quant.py), in any checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.fp8 import FP8_DTYPE, quantize_per_channel

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KV_SCALE_SUFFIXES = ("self_attn.k_scale", "self_attn.v_scale")  # compressed-tensors' kv_cache_scheme


@dataclass(frozen=True)
class Fp8Checkpoint:
    """How a checkpoint stores its FP8 weights."""

    method: str  # "compressed-tensors" or "fp8"
    block_size: tuple[int, int] | None = None  # "fp8": rows and columns a scale covers


def checkpoint_fp8(config: dict) -> Fp8Checkpoint | None:
    """The FP8 format of a checkpoint's config.json, None when it has no quantization_config;
    a ValueError naming the method for a quantization the worker cannot load."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method == "fp8":
        if quantization.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"fp8 checkpoint with fmt {quantization['fmt']!r}: only e4m3 loads")
        block = quantization.get("weight_block_size")
        return Fp8Checkpoint("fp8", tuple(block) if block else None)
    if method == "compressed-tensors" and _float8_weights(quantization):
        return Fp8Checkpoint("compressed-tensors")
    raise ValueError(f"checkpoint quantization {method!r} is not supported (FP8 checkpoints "
                     f"load: compressed-tensors float8, fp8 with or without block scales)")


def _float8_weights(quantization: dict) -> bool:
    """Whether every config group of a compressed-tensors config stores 8-bit float weights."""
    groups = (quantization.get("config_groups") or {}).values()
    return bool(groups) and all(
        (group.get("weights") or {}).get("type") == "float"
        and (group.get("weights") or {}).get("num_bits") == 8 for group in groups)


def per_channel_weights(hf: dict[str, torch.Tensor], checkpoint: Fp8Checkpoint
                        ) -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (HF names) with every projection as an FP8 weight [N, K] and
    ``<name>.weight_scale`` [N] fp32; the checkpoint's own scale tensors consumed, activation
    scales dropped, every other tensor as it was."""
    out = {}
    for name, tensor in hf.items():
        if name.endswith((".weight_scale", ".weight_scale_inv", ".input_scale")):
            continue
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.rpartition(".")[2] in PROJECTIONS:
            out[name], out[f"{module}.weight_scale"] = _channel_scaled(hf, module, checkpoint)
        elif tensor.dtype == FP8_DTYPE:
            raise ValueError(f"{name} is FP8 in this checkpoint: only the projections (q/k/v, o, "
                             f"gate/up, down) load as FP8")
        else:
            out[name] = tensor
    return out


def _channel_scaled(hf: dict[str, torch.Tensor], module: str, checkpoint: Fp8Checkpoint
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight [N, K], scale [N] fp32) of one projection."""
    weight = hf[f"{module}.weight"]
    if weight.dtype != FP8_DTYPE:  # left unquantized by the checkpoint
        return quantize_per_channel(weight)
    n, k = weight.shape
    if checkpoint.method == "compressed-tensors":
        scale = hf[f"{module}.weight_scale"].float().reshape(-1)  # [N] or [1]
        return weight, scale.expand(n).contiguous() if scale.numel() == 1 else scale
    scale_inv = hf[f"{module}.weight_scale_inv"].float()
    if checkpoint.block_size is None:  # one scale for the tensor
        return weight, scale_inv.reshape(-1).expand(n).contiguous()
    block_n, block_k = checkpoint.block_size
    # [N, K]: each block's multiplier, repeated over its rows and columns (edge blocks cut)
    multipliers = scale_inv.repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)[:n, :k]
    return quantize_per_channel(weight.float() * multipliers)


def pop_checkpoint_kv_scales(hf_weights: dict[str, torch.Tensor]) -> dict[int, tuple[float, float]]:
    """Take a checkpoint's KV scales out of its tensors (HF names): {layer: (k_scale,
    v_scale)} for the layers that have both."""
    found: dict[int, dict[str, float]] = {}
    for name in [n for n in hf_weights if n.endswith(KV_SCALE_SUFFIXES)]:
        scale = float(hf_weights.pop(name).float().max())
        if not 0.0 < scale < float("inf"):  # the cache divides by it
            raise ValueError(f"{name} is {scale}: a KV scale must be positive and finite")
        layer = int(name.split("layers.")[1].split(".")[0])
        found.setdefault(layer, {})[name.rpartition(".")[2]] = scale
    return {layer: (scales["k_scale"], scales["v_scale"]) for layer, scales in found.items()
            if len(scales) == 2}
