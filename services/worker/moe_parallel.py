"""A Mixture-of-Experts block over tensor-parallel ranks, two ways (docs/moe.md):

- **tensor parallel** (the default): every rank holds every expert, each expert's intermediate
  sliced as a dense MLP's is (gate and up rows, down's columns);
- **expert parallel** (``--enable-expert-parallel``): rank r holds whole experts, a contiguous
  ``split_range`` of them, and computes only the (token, k) pairs routed to those.

Either way every rank has every token's hidden state (attention's all-reduce leaves it
replicated), the router is whole on every rank, and the block's partial outputs are summed by
one all-reduce (which is the dispatch and combine of expert parallelism at this scale: each
rank "receives" the tokens it already has, and the sum is the reduce-scatter + all-gather).
Qwen2-MoE's shared expert is sliced like a dense MLP in both modes.
"""

from __future__ import annotations

import dataclasses

import torch

from services.worker.model_config import MoeSpec


def check_moe_parallel(spec: MoeSpec | None, size: int, expert_parallel: bool) -> None:
    """A clear error where the MoE block cannot be split over ``size`` ranks so."""
    if expert_parallel and spec is None:
        raise ValueError("--enable-expert-parallel needs a Mixture-of-Experts model "
                         "(Mixtral, Qwen2-MoE, Qwen3-MoE); this model is dense")
    if spec is None or size == 1:
        return
    if expert_parallel and size > spec.num_experts:
        raise ValueError(f"--enable-expert-parallel over {size} ranks needs at least {size} "
                         f"experts; the model has {spec.num_experts}")
    if not expert_parallel and size > spec.intermediate_size:
        raise ValueError(f"tensor_parallel_size {size} exceeds the experts' intermediate size "
                         f"{spec.intermediate_size}")


def local_spec(spec: MoeSpec, tp) -> MoeSpec:
    """``spec`` as one rank's block sees it (``tp``: its TensorParallel): its experts (EP) or
    its intermediate slice (TP), its slice of the shared expert."""
    shared = spec.shared_expert_intermediate_size
    if shared:
        start, end = tp.part(shared)
        spec = dataclasses.replace(spec, shared_expert_intermediate_size=end - start)
    if tp.expert_parallel:
        start, end = tp.part(spec.num_experts)
        return dataclasses.replace(spec, first_local_expert=start, num_local_experts=end - start)
    start, end = tp.part(spec.intermediate_size)
    return dataclasses.replace(spec, intermediate_size=end - start)


def shard_moe(name: str, tensor: torch.Tensor, spec: MoeSpec, tp) -> torch.Tensor | None:
    """One rank's part of an MoE block's weight (``spec`` the whole model's), or None when
    ``name`` is no expert or shared-expert tensor."""
    prefix, _, suffix = name.rpartition(".")  # suffix: w13_weight(_scale), weight, ...
    if prefix.endswith("mlp.experts"):
        if tp.expert_parallel:
            start, end = tp.part(spec.num_experts)
            return tensor[start:end].contiguous()
        start, end = tp.part(spec.intermediate_size)
        inter = spec.intermediate_size
        if suffix.startswith("w13"):  # [E, 2 * inter, ...]: gate rows, then up rows
            return torch.cat([tensor[:, start:end], tensor[:, inter + start:inter + end]],
                             dim=1).contiguous()
        if suffix == "w2_weight":  # [E, hidden, inter]: columns
            return tensor[:, :, start:end].contiguous()
        return tensor  # w2's scales: per output channel, whole
    if prefix.endswith(("mlp.shared_expert.gate_up_proj", "mlp.shared_expert.down_proj")):
        shared = spec.shared_expert_intermediate_size
        start, end = tp.part(shared)
        if prefix.endswith("gate_up_proj"):
            return torch.cat([tensor[start:end], tensor[shared + start:shared + end]])
        return tensor if suffix == "weight_scale" else tensor[:, start:end].contiguous()
    return None


def local_expert_ids(topk_ids: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """Global expert ids [num_tokens, top_k] -> this rank's (EP): its experts numbered from 0,
    every other id (and padding's sentinel) the local sentinel."""
    local = topk_ids - spec.first_local_expert
    outside = (local < 0) | (local >= spec.local_experts)
    return local.masked_fill_(outside, spec.local_experts)
