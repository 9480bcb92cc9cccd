"""Weights for the decoder (model.py): from a Hugging Face directory (``config.json`` +
``*.safetensors``, HF parameter names, q/k/v and gate/up fused at load time), or, for a directory
marked as a dummy model (``shared.models.DUMMY_MARKER``), seeded random weights built on the target
device."""

from __future__ import annotations

import zlib
from pathlib import Path

import structlog
import torch
from safetensors import safe_open

from kernels.rotary import build_cos_sin_cache
from services.worker.model import ModelConfig, Transformer, compute_inv_freq
from shared.models import DUMMY_MARKER

log = structlog.get_logger()


def load_model(path: Path, device: torch.device, dtype: torch.dtype, seed: int = 0) -> Transformer:
    """Build the model from a Hugging Face directory without materializing random weights first.

    A dummy-model directory (``DUMMY_MARKER``) gets random weights from ``seed`` instead, made
    directly on ``device`` in ``dtype``.
    """
    config = ModelConfig.from_path(path)
    with torch.device("meta"):
        model = Transformer(config)
    if (path / DUMMY_MARKER).exists():
        state_dict = random_weights(model, device, dtype, seed)
        log.info("model_random_weights", family=config.family, seed=seed,
                 num_params=sum(t.numel() for t in state_dict.values()))
    else:
        state_dict = fuse_hf_weights(read_safetensors(path, device, dtype), config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    model.inv_freq = compute_inv_freq(config).to(device)  # the meta-built buffers are empty
    model.cos_sin_cache = build_cos_sin_cache(model.inv_freq, config.max_position_embeddings)
    return model.eval()


def random_weights(model: Transformer, device: torch.device, dtype: torch.dtype, seed: int,
                   std: float = 0.02) -> dict[str, torch.Tensor]:
    """Weights for every parameter of a (meta) model: norms 1, matrices and biases N(0, std).

    std 0.02 keeps the residual stream to tens and the logits near unit scale even for 32 layers
    of hidden 4096, so bf16 stays finite. Each tensor is drawn from its own generator seeded by
    (seed, name), on the target device: the same seed gives the same weights there.
    """
    weights = {}
    for name, param in model.named_parameters():
        tensor = torch.empty(param.shape, device=device, dtype=dtype)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            generator = torch.Generator(device=device)
            generator.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
            tensor.normal_(0.0, std, generator=generator)
        weights[name] = tensor
    return weights


def read_safetensors(path: Path, device: torch.device, dtype: torch.dtype
                      ) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors in {path}")
    tensors = {}
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if "rotary_emb" not in name:
                    tensors[name] = f.get_tensor(name).to(device=device, dtype=dtype)
    return tensors


def fuse_hf_weights(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names (``model.layers.0.self_attn.q_proj.weight``, ...) -> this module's names."""
    hf = {name.removeprefix("model."): tensor for name, tensor in hf.items()}
    if config.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    elif "lm_head.weight" not in hf:
        raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    fused = {}
    for name, tensor in hf.items():
        prefix, _, suffix = name.rpartition(".")  # suffix: weight or bias
        if prefix.endswith(("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj")):
            continue  # consumed with q_proj / gate_proj
        if prefix.endswith("self_attn.q_proj"):
            base = prefix.removesuffix("q_proj")
            parts = [hf[f"{base}{p}_proj.{suffix}"] for p in ("q", "k", "v")]
            fused[f"{base}qkv_proj.{suffix}"] = torch.cat(parts, dim=0)
        elif prefix.endswith("mlp.gate_proj"):
            base = prefix.removesuffix("gate_proj")
            parts = [hf[f"{base}gate_proj.{suffix}"], hf[f"{base}up_proj.{suffix}"]]
            fused[f"{base}gate_up_proj.{suffix}"] = torch.cat(parts, dim=0)
        else:
            fused[name] = tensor
    return fused
