"""A Mixture-of-Experts block (Mixtral, Qwen2-MoE, Qwen3-MoE): the router, the experts' weights
stacked for the fused kernels, and Qwen2-MoE's gated shared expert.

The router stays in the checkpoint's dtype (never FP8: a quantized router picks other experts);
its logits' softmax and top-k run in fp32 with ties to the lower expert id
(``kernels.moe_routing.route``), so a token's experts do not depend on its batch. Rows that are
padding (a CUDA graph's rows past the real batch: slot -1) are routed to no expert, so they read
no expert's weights. Each block counts the tokens routed to each expert (in the routing
launch); ``take_expert_counts`` reads them for /metrics about once a second.
"""

from __future__ import annotations

import time

import msgspec
import torch
from torch import nn

from kernels import fused_moe
from kernels.moe_routing import route
from services.worker import ops
from services.worker.layers import MLP
from services.worker.model_config import ModelConfig, MoeSpec
from services.worker.moe_parallel import local_expert_ids
from services.worker.tensor_parallel import TensorParallel
from shared.messages import StepResult


class Experts(nn.Module):
    """The experts of one block, stacked: ``w13_weight`` [num_experts, 2 * intermediate, hidden]
    (each expert's gate rows, then its up rows) and ``w2_weight`` [num_experts, hidden,
    intermediate]. FP8 weights (--quantization fp8) come with a scale per output channel:
    ``w13_weight_scale`` [num_experts, 2 * intermediate], ``w2_weight_scale`` [num_experts,
    hidden] (None otherwise)."""

    def __init__(self, config: ModelConfig, spec: MoeSpec):
        super().__init__()
        hidden, inter, num_experts = config.hidden_size, spec.intermediate_size, spec.local_experts
        self.w13_weight = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.w2_weight = nn.Parameter(torch.empty(num_experts, hidden, inter))
        fp8 = config.quantization == "fp8"
        self.register_buffer("w13_weight_scale",
                             torch.empty(num_experts, 2 * inter) if fp8 else None)
        self.register_buffer("w2_weight_scale", torch.empty(num_experts, hidden) if fp8 else None)


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, spec: MoeSpec, tp: TensorParallel):
        """``config`` and ``spec``: this rank's (TensorParallel.local_config)."""
        super().__init__()
        self.spec, self.batch_invariant = spec, config.batch_invariant
        self.tp = tp if tp.size > 1 else None
        self.gate = nn.Linear(config.hidden_size, spec.num_experts, bias=False)  # the router
        self.experts = Experts(config, spec)
        if spec.shared_expert_intermediate_size:
            self.shared_expert = MLP(config, tp, spec.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None
        # [num_experts] int32 on the model's device: the tokens routed to each expert since
        # the last ``take_expert_counts`` (route adds to it; None until the model is placed)
        self.token_counts: torch.Tensor | None = None

    def forward(self, x: torch.Tensor, valid_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x [num_tokens, hidden] -> [num_tokens, hidden]; ``valid_rows`` [num_tokens] bool
        (None: all): the rest route to no expert and come out 0 (or the shared expert's)."""
        router_logits = ops.linear(x, self.gate.weight, batch_invariant=self.batch_invariant)
        topk_weights, topk_ids = route(router_logits, self.spec.top_k, self.spec.renormalize,
                                       valid_rows, self.token_counts)
        if self.spec.num_local_experts:  # expert parallel: the pairs of this rank's experts
            topk_ids = local_expert_ids(topk_ids, self.spec)
        experts = self.experts
        out = fused_moe.fused_moe(x, experts.w13_weight, experts.w2_weight, topk_weights,
                                  topk_ids, experts.w13_weight_scale, experts.w2_weight_scale,
                                  batch_invariant=self.batch_invariant)
        if self.tp is not None:  # the ranks' partial sums (moe_parallel.py)
            out = self.tp.all_reduce(out)
        if self.shared_expert is not None:
            gate = torch.sigmoid(ops.linear(x, self.shared_expert_gate.weight))  # [num_tokens, 1]
            out = out + gate * self.shared_expert(x)
        return out


def start_expert_counts(model: nn.Module, device: torch.device) -> None:
    """Give every sparse block of ``model`` its (zeroed) token counters on ``device``."""
    for block in model.modules():
        if isinstance(block, SparseMoeBlock):
            block.token_counts = torch.zeros(block.spec.num_experts, dtype=torch.int32,
                                             device=device)


def take_expert_counts(model: nn.Module) -> list[list[int]]:
    """Per sparse layer (in order), per expert, the tokens routed there since the last take,
    then zeroed; [] for a dense model. Reads the device (a sync): call it between steps."""
    counters = [block.token_counts for block in model.modules()
                if isinstance(block, SparseMoeBlock) and block.token_counts is not None]
    if not counters:
        return []
    stacked = torch.stack(counters)  # [num_sparse_layers, num_experts]
    for counter in counters:
        counter.zero_()
    return stacked.tolist()


class ExpertCountReports:
    """The model's expert counts on a step's result about once per ``period_s`` (the
    scheduler sums them for /metrics); nothing for a dense model."""

    def __init__(self, model: nn.Module, period_s: float = 1.0):
        self.model, self.period_s = model, period_s
        self.sparse = any(isinstance(m, SparseMoeBlock) for m in model.modules())
        self.last_report = time.monotonic()

    def attach(self, results: list[StepResult]) -> list[StepResult]:
        """``results`` with the counts since the last report on the last one, when due."""
        now = time.monotonic()
        if not self.sparse or not results or now - self.last_report < self.period_s:
            return results
        self.last_report = now
        counts = take_expert_counts(self.model)
        return results[:-1] + [msgspec.structs.replace(results[-1], expert_token_counts=counts)]
