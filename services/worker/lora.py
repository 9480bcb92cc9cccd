"""LoRA adapters in the PEFT format, read from disk and checked against the base model.

A PEFT directory holds ``adapter_config.json`` (``r``, ``lora_alpha``, ``use_rslora``,
``target_modules``) and ``adapter_model.safetensors`` with, per layer i and target t,
``base_model.model.model.layers.{i}.{self_attn|mlp}.{t}.lora_A.weight`` [r, in_features] and
``...lora_B.weight`` [out_features, r]; the delta of t is ``scaling * B @ A`` with scaling
``alpha / r`` (rsLoRA: ``alpha / sqrt(r)``). An adapter is validated whole when it is loaded
(rank, targets, every tensor's presence and shape against the base's ``ModelConfig``), so a
bad one is refused by name before any request can use it. Device slots: lora_slots.py.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from services.worker.model_config import ModelConfig

# flotilla's fused projections (layers.py) -> their PEFT parts, in the fused rows' order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
TARGETS = tuple(part for parts in FUSED_PARTS.values() for part in parts)
_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
           "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# PEFT options that change the math in ways flotilla does not compute: refused by name
_UNSUPPORTED = {"use_dora": False, "fan_in_fan_out": False, "bias": "none",
                "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
                "alpha_pattern": {}, "layer_replication": None}


@dataclass(frozen=True)
class LoraAdapter:
    """One adapter in host memory, fp32, checked against the base model."""

    name: str
    path: Path
    rank: int
    scaling: float  # alpha / r, or alpha / sqrt(r) with use_rslora
    target_modules: tuple[str, ...]  # PEFT part names, in TARGETS order
    # (layer, part) -> (A [rank, in_features], B [out_features, rank]) for each target
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]

    def part(self, layer: int, part: str) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(A, B) of ``part`` in ``layer``; None where the adapter does not target it."""
        return self.weights.get((layer, part))


def part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """PEFT part -> (out_features, in_features) of the base's projection."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    return {"q_proj": (q_size, hidden), "k_proj": (kv_size, hidden), "v_proj": (kv_size, hidden),
            "o_proj": (hidden, q_size), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


def tensor_name(layer: int, part: str, matrix: str) -> str:
    """PEFT's saved name of one matrix (``matrix``: lora_A or lora_B)."""
    return f"base_model.model.model.layers.{layer}.{_PARENT[part]}.{part}.{matrix}.weight"


def load_adapter(name: str, path: str | Path, config: ModelConfig,
                 max_rank: int) -> LoraAdapter:
    """The adapter in PEFT directory ``path``, checked against ``config`` (the base model's);
    a ValueError names the adapter and what is wrong (file, field, target, tensor)."""
    path = Path(path)
    where = f"LoRA adapter {name!r} ({path})"
    settings = _read_settings(path, where)
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"{where}: r must be a positive integer, not {rank!r}")
    if rank > max_rank:
        raise ValueError(f"{where}: rank r={rank} is above max_lora_rank {max_rank}")
    targets = _targets(settings.get("target_modules"), config, where)
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    tensors_path = path / "adapter_model.safetensors"
    if not tensors_path.is_file():
        raise ValueError(f"{where}: no adapter_model.safetensors")
    tensors = load_file(str(tensors_path))
    weights = _check_tensors(tensors, targets, rank, config, where)
    return LoraAdapter(name=name, path=path, rank=rank, scaling=float(scaling),
                       target_modules=targets, weights=weights)


def _read_settings(path: Path, where: str) -> dict:
    config_path = path / "adapter_config.json"
    if not config_path.is_file():
        raise ValueError(f"{where}: no adapter_config.json")
    settings = json.loads(config_path.read_text())
    if settings.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {settings['peft_type']!r} is not LORA")
    for field, plain in _UNSUPPORTED.items():
        value = settings.get(field, plain)
        if value != plain and value not in (None, [], {}):
            raise ValueError(f"{where}: {field}={value!r} is not supported")
    return settings


def _targets(value, config: ModelConfig, where: str) -> tuple[str, ...]:
    """PEFT's target_modules (a list, or one name) -> the parts, in TARGETS order."""
    names = [value] if isinstance(value, str) else list(value or [])
    if not names:
        raise ValueError(f"{where}: target_modules is empty")
    for module in names:
        if module not in TARGETS:
            raise ValueError(f"{where}: target module {module!r} is not supported (LoRA "
                             f"targets only {', '.join(TARGETS)})")
    if config.moe is not None and {"gate_proj", "up_proj", "down_proj"} & set(names):
        raise ValueError(f"{where}: MLP targets on a Mixture-of-Experts model are not "
                         f"supported (target the attention projections)")
    return tuple(part for part in TARGETS if part in names)


def _check_tensors(tensors: dict[str, torch.Tensor], targets: tuple[str, ...], rank: int,
                   config: ModelConfig, where: str
                   ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """Every target of every layer present with the base's shapes, nothing else there."""
    shapes = part_shapes(config)
    weights, expected = {}, set()
    for layer in range(config.num_layers):
        for part in targets:
            out_features, in_features = shapes[part]
            pair = []
            for matrix, shape in (("lora_A", (rank, in_features)),
                                  ("lora_B", (out_features, rank))):
                key = tensor_name(layer, part, matrix)
                expected.add(key)
                if key not in tensors:
                    raise ValueError(f"{where}: tensor {key} is missing")
                if tuple(tensors[key].shape) != shape:
                    raise ValueError(f"{where}: tensor {key} has shape "
                                     f"{list(tensors[key].shape)}, the base model's "
                                     f"{part} needs {list(shape)}")
                pair.append(tensors[key].float())
            weights[layer, part] = (pair[0], pair[1])
    extra = sorted(set(tensors) - expected)
    if extra:
        raise ValueError(f"{where}: tensor {extra[0]} is not a LoRA matrix of a target "
                         f"flotilla computes ({len(extra)} such)")
    return weights
