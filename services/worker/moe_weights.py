"""A Mixture-of-Experts checkpoint's tensors, from the Hub's per-expert names to the stacked
layout of ``moe.Experts``.

The Hub stores one tensor per expert and projection: Mixtral
``model.layers.{i}.block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down) and its router
``block_sparse_moe.gate``; Qwen2/3-MoE ``model.layers.{i}.mlp.experts.{e}.gate_proj/up_proj/
down_proj`` and ``mlp.gate`` (Qwen2-MoE also ``mlp.shared_expert.*`` and
``mlp.shared_expert_gate``). ``hub_moe_names`` renames Mixtral's to Qwen's (so FP8 checkpoints'
projections are recognised by their names, fp8_checkpoints.py); ``stack_experts`` then stacks
each layer's experts into ``mlp.experts.w13_weight`` [E, 2 * inter, hidden] and ``w2_weight``
[E, hidden, inter] (their per-channel ``_scale`` too, for FP8), one layer at a time, freeing the
per-expert tensors as it goes: the host peak stays near the checkpoint's size plus one layer.
A missing expert tensor, or a router of the wrong shape, fails here naming it.
"""

from __future__ import annotations

import re

import torch

from services.worker.model_config import ModelConfig

_MIXTRAL_NAMES = (("block_sparse_moe.", "mlp."), (".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                  (".w2.", ".down_proj."))
_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(\d+)\.")


def hub_moe_names(hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's MoE names as Qwen-MoE's (``block_sparse_moe`` -> ``mlp``, w1/w3/w2 ->
    gate/up/down_proj); every other name as it was."""
    renamed = {}
    for name, tensor in hf.items():
        if "block_sparse_moe." in name:
            for old, new in _MIXTRAL_NAMES:
                name = name.replace(old, new)
        renamed[name] = tensor
    return renamed


def stack_experts(hf: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Per-expert tensors (module names: ``layers.{i}.mlp.experts.{e}.{proj}.{suffix}``, the
    ``model.`` prefix already off) -> each sparse layer's ``mlp.experts.w13_weight`` and
    ``w2_weight`` (+ ``_scale`` where the checkpoint is FP8); the shared expert's gate and up
    fused as a dense MLP's. ``hf`` is consumed."""
    spec = config.moe
    sparse = set(spec.sparse_layers)
    stray = sorted({int(m.group(1)) for m in map(_EXPERT.match, hf) if m} - sparse)
    if stray:
        raise ValueError(f"the checkpoint has experts in layers {stray}, which config.json "
                         f"makes dense (decoder_sparse_step, mlp_only_layers)")
    out = {}
    for layer in range(config.num_layers):
        if layer in sparse:
            out.update(_stacked_layer(hf, layer, config))
    out.update(hf)  # what is left: attention, norms, dense MLPs, embeddings
    return out


def _stacked_layer(hf: dict[str, torch.Tensor], layer: int, config: ModelConfig
                   ) -> dict[str, torch.Tensor]:
    spec, prefix = config.moe, f"layers.{layer}.mlp."
    router = _take(hf, f"{prefix}gate.weight")
    if router.shape != (spec.num_experts, config.hidden_size):
        raise ValueError(f"router model.{prefix}gate.weight has shape {list(router.shape)}; "
                         f"config.json makes it [{spec.num_experts}, {config.hidden_size}] "
                         f"(num_experts, hidden_size)")
    out = {f"{prefix}gate.weight": router}
    suffixes = ["weight"] + (["weight_scale"] if f"{prefix}experts.0.gate_proj.weight_scale"
                             in hf else [])
    for suffix in suffixes:
        gate, up, down = ([_take(hf, f"{prefix}experts.{e}.{proj}.{suffix}")
                           for e in range(spec.num_experts)]
                          for proj in ("gate_proj", "up_proj", "down_proj"))
        out[f"{prefix}experts.w13_{suffix}"] = torch.stack(
            [torch.cat(pair) for pair in zip(gate, up, strict=True)])
        out[f"{prefix}experts.w2_{suffix}"] = torch.stack(down)
        del gate, up, down
    if spec.shared_expert_intermediate_size:
        shared = f"{prefix}shared_expert."
        for suffix in suffixes:
            out[f"{shared}gate_up_proj.{suffix}"] = torch.cat(
                [_take(hf, f"{shared}gate_proj.{suffix}"), _take(hf, f"{shared}up_proj.{suffix}")])
            out[f"{shared}down_proj.{suffix}"] = _take(hf, f"{shared}down_proj.{suffix}")
        out[f"{prefix}shared_expert_gate.weight"] = _take(hf, f"{prefix}shared_expert_gate.weight")
    return out


def _take(hf: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in hf:
        raise ValueError(f"the checkpoint has no model.{name}, which its config.json needs "
                         f"(an MoE checkpoint missing an expert or router tensor)")
    return hf.pop(name)
