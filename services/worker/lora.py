"""LoRA adapters in the PEFT format, read from disk into host memory, checked against the
base model by shared/lora_adapters.py's rules (which also describe the format); the delta of
target t is ``scaling * B @ A``. An adapter is validated whole when it is loaded, so a bad
one is refused by name before any request can use it. Device slots: lora_slots.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file

from services.worker.model_config import ModelConfig
from shared.lora_adapters import (
    MLP_TARGETS, TENSORS_FILE, BaseShapes, check_tensor_shapes, read_settings, tensor_name,
    where_of)

if TYPE_CHECKING:
    from services.worker.tensor_parallel import TensorParallel

# flotilla's fused projections (layers.py) -> their PEFT parts, in the fused rows' order
FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


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


def base_shapes(config: ModelConfig, max_rank: int) -> BaseShapes:
    """What an adapter must fit on this model (announced to the scheduler, which checks
    adapters loaded at run time with it): a Mixture-of-Experts model has no MLP parts."""
    parts = {part: list(shape) for part, shape in part_shapes(config).items()
             if config.moe is None or part not in MLP_TARGETS}
    return BaseShapes(num_layers=config.num_layers, part_shapes=parts, max_rank=max_rank)


def shard_part(part: str, lora_a: torch.Tensor, lora_b: torch.Tensor, config: ModelConfig,
               tp: TensorParallel) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's piece of one part's (A [r, in], B [out, r]) (``config``: the whole
    model's), split as tensor_parallel.py splits the base projection: a column-parallel
    part (q, k, v by their heads; gate, up by the intermediate slice) keeps A whole and its
    rows of B; a row-parallel one (o, down) its columns of A and B whole, so its delta is a
    partial sum that the projection's all-reduce joins with the base output's."""
    if tp.size == 1:
        return lora_a, lora_b
    head_dim = config.head_dim
    if part in ("q_proj", "o_proj"):
        start, end = (head * head_dim for head in tp.q_heads(config))
    elif part in ("k_proj", "v_proj"):
        start, end = (head * head_dim for head in tp.kv_heads(config))
    else:
        start, end = tp.intermediate(config)
    if part in ("o_proj", "down_proj"):
        return lora_a[:, start:end].contiguous(), lora_b
    return lora_a, lora_b[start:end].contiguous()


def load_adapter(name: str, path: str | Path, config: ModelConfig,
                 max_rank: int) -> LoraAdapter:
    """The adapter in PEFT directory ``path``, checked against ``config`` (the base model's);
    a ValueError names the adapter and what is wrong (file, field, target, tensor)."""
    path = Path(path)
    where = where_of(name, path)
    base = base_shapes(config, max_rank)
    settings = read_settings(path, where, base)
    tensors_path = path / TENSORS_FILE
    if not tensors_path.is_file():
        raise ValueError(f"{where}: no {TENSORS_FILE}")
    tensors = load_file(str(tensors_path))
    check_tensor_shapes({key: tuple(t.shape) for key, t in tensors.items()}, settings, base,
                        where)
    weights = {(layer, part): (tensors[tensor_name(layer, part, "lora_A")].float(),
                               tensors[tensor_name(layer, part, "lora_B")].float())
               for layer in range(config.num_layers) for part in settings.target_modules}
    return LoraAdapter(name=name, path=path, rank=settings.rank, scaling=settings.scaling,
                       target_modules=settings.target_modules, weights=weights)
