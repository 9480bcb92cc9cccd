"""The decoder's dense building blocks: RMSNorm, the projection (``Linear``, bf16 or FP8 with
per-channel scales, summed over tensor-parallel ranks where it is row-parallel), a projection
into the residual stream with the norm after it (``add_rms_norm``), and the SwiGLU MLP. model.py
builds attention and layers from them; moe.py its sparse blocks (Qwen2-MoE's shared expert is an
``MLP``). A LoRA-targeted ``Linear`` adds its adapters' deltas (``lora``, lora_slots.py);
in a step with adapter rows the fused projection-and-SiLU path runs as the projection, then
the op after it, so the deltas are in before it; so does projection-and-norm on the torch
path, while the kernels add the deltas to its residual and keep it fused. On the skinny GEMM
the deltas' shrink runs inside the projection's own launch (kernels/skinny_gemm.py)."""

from __future__ import annotations

import torch
from torch import nn

from kernels.int_pack import IntWeight
from services.worker import ops
from services.worker.lora_slots import LinearLora
from services.worker.model_config import ModelConfig
from services.worker.tensor_parallel import TensorParallel


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x: [..., dim] -> normed x; with a residual, (norm(x + residual), x + residual)."""
        return ops.rms_norm(x, self.weight, self.eps, residual)


class Linear(nn.Linear):
    """nn.Linear whose weight may be FP8 (e4m3) with ``weight_scale`` [out_features] fp32, one
    scale per output channel (kernels/fp8.py); without FP8 that buffer is None. With
    ``config.int_layout`` the weight stays packed (``weight`` is None): buffers ``int_qweight``,
    ``int_scales``, ``int_zeros``, ``int_perm`` in kernels/int_pack.py's layout (the last two
    None where the layout has none). With ``reduce`` (tensor parallel o_proj and down: a slice
    of the input features) the ranks' partial outputs are summed. ``lora``: its LoRA slots
    (lora_slots.py; None: LoRA off, nothing added, no op more)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, config: ModelConfig,
                 reduce: TensorParallel | None = None):
        super().__init__(in_features, out_features, bias=bias)
        fp8 = config.quantization == "fp8"
        self.register_buffer("weight_scale", torch.empty(out_features) if fp8 else None)
        self.int_layout = config.int_layout
        if self.int_layout is not None:
            del self.weight
            self.weight = None
            shapes = self.int_layout.shapes(in_features, out_features)
            dtypes = {"qweight": torch.int32, "scales": torch.float16, "zeros": torch.uint8,
                      "perm": torch.int32}  # (the checkpoint's scales keep their own dtype)
            for field in ("qweight", "scales", "zeros", "perm"):
                self.register_buffer(f"int_{field}", torch.empty(shapes[field], dtype=dtypes[
                    field]) if field in shapes else None)
        self.reduce = reduce if reduce is not None and reduce.size > 1 else None
        self.batch_invariant = config.batch_invariant
        self.lora: LinearLora | None = None

    @property
    def kernel_weight(self) -> torch.Tensor | IntWeight:
        """The weight as the ops take it: the plain (or FP8) tensor, or the packed one."""
        if self.int_layout is None:
            return self.weight
        return IntWeight(self.int_qweight, self.int_scales, self.int_zeros, self.int_perm,
                         self.int_layout.bits, self.int_layout.group_size, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        delta = self.lora.delta(x) if self.lora is not None else None  # (the kernels' deltas)
        out = ops.linear(x, self.kernel_weight, self.bias, self.weight_scale,
                         batch_invariant=self.batch_invariant, lora=delta)
        if self.lora is not None and delta is None:  # (the torch path's, if any)
            out = self.lora.add(x, out)
        return out if self.reduce is None else self.reduce.all_reduce(out)


def add_rms_norm(x: torch.Tensor, proj: Linear, residual: torch.Tensor, norm: RMSNorm
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(proj(x) + residual), proj(x) + residual), the sum written into residual: in the
    projection's reduce where ``ops.linear_add_rms_norm`` can, after the ranks' sum when
    tensor parallel."""
    if proj.reduce is not None:
        return proj.reduce.linear_add_rms_norm(x, proj, residual, norm)
    delta = None
    if proj.lora is not None and proj.lora.active:  # the deltas go in before the norm
        if not proj.lora.kernels:
            return norm(proj(x), residual)
        delta = proj.lora.delta(x)  # (the kernels add them to the residual: the op stays fused)
    return ops.linear_add_rms_norm(x, proj.kernel_weight, proj.bias, residual, norm.weight,
                                   norm.eps, proj.weight_scale, proj.batch_invariant, delta)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel,
                 intermediate_size: int | None = None):
        """``intermediate_size``: None, the model's (a shared expert's is its own)."""
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * intermediate_size, config.mlp_bias,
                                   config)
        self.down_proj = Linear(intermediate_size, config.hidden_size, config.mlp_bias, config,
                                tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden_size]
        return self.down_proj(self.gated(x))

    def gated(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of gate_up: [num_tokens, hidden_size] -> [num_tokens, intermediate_size]."""
        up = self.gate_up_proj
        delta = None
        if up.lora is not None and up.lora.active:  # the deltas go in before SiLU-and-mul
            delta = up.lora.delta(x)
            if delta is None:  # (the torch path)
                return ops.silu_and_mul(up(x))
        return ops.linear_silu_and_mul(x, up.kernel_weight, up.bias, up.weight_scale,
                                       up.batch_invariant, delta)
