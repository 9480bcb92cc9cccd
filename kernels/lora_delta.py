"""A projection's LoRA deltas in one step, as the ops take them (``LoraDelta``): its device
slots, the step's grouped rows (kernels/lora.py ``group_rows``) and the launch plan of this
row count (kernels/lora_configs.py). ``add`` is the shrink and expand launches after (or, into
a residual, before) the base GEMM; where the plan says ``beside``, the skinny GEMM runs the
shrink's programs in its own launch (kernels/skinny_gemm.py, ``ShrinkBeside`` their
arguments) and only the expand follows; a gate_up projection's expand may take the SwiGLU
after it into the same launch (``expand_silu_and_mul``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton

from kernels.lora import (
    lora_expand, lora_expand_silu_and_mul, lora_shrink, shrink_splits)
from kernels.lora_configs import LoraPlan, block_w

# The shrink run beside a projection's GEMM (``LoraDelta.beside``, where the plan says so):
# programs it adds after the GEMM's in the launch at most, its K tile at most (its shared
# memory stays within the GEMM's), its K loop's pipeline stages (1 and 3 timed alike on the
# H200; placed after the GEMM's programs it beat placed before them at 1 and 4 rows)
BESIDE_PROGRAMS = 64
BESIDE_MAX_BLOCK_K = 64
BESIDE_STAGES = 1


@dataclass(frozen=True)
class ShrinkBeside:
    """The shrink's launch arguments for programs run inside another kernel's launch (the
    skinny GEMM's: kernels/skinny_gemm.py), y its output ([num_splits, num_tokens, width])."""

    y: torch.Tensor
    num_programs: int  # row tiles x splits
    num_splits: int
    split_len: int
    block_m: int
    block_w: int
    block_k: int
    num_stages: int
    max_registers: int | None  # a cap on the shared launch's registers a thread (the plan's)


@dataclass(frozen=True)
class LoraDelta:
    """One projection's adapter deltas in a step: its slots (``a`` [max_loras, width,
    in_features], ``b`` [max_loras, out_features, width]), the step's grouped rows and the
    plan of this row count. ``add`` is the two launches; a projection on the skinny GEMM whose
    plan has ``beside`` runs the shrink inside its own launch (``beside``), then ``expand``."""

    a: torch.Tensor
    b: torch.Tensor
    lora_rows: torch.Tensor
    plan: LoraPlan

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out [num_tokens, out_features] plus the adapter rows' deltas of x, in place."""
        return self.expand(lora_shrink(x, self.a, self.lora_rows, self.plan.shrink), out)

    def expand(self, y: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return lora_expand(y, self.b, self.lora_rows, out, self.plan.expand)

    def expand_silu_and_mul(self, y: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU of gate_up [num_tokens, 2d] with the deltas in (``lora_expand_silu_and_mul``)."""
        return lora_expand_silu_and_mul(y, self.b, self.lora_rows, gate_up, self.plan.expand)

    def beside(self, x: torch.Tensor) -> ShrinkBeside:
        """The shrink of x as programs beside another launch's: the plan's row tiles, its K
        tile capped at BESIDE_MAX_BLOCK_K, splits for about BESIDE_PROGRAMS programs."""
        num_tokens, in_features = x.shape
        width = self.a.shape[1]
        if not self.a.is_contiguous() or self.a.shape[2] != in_features:
            raise ValueError(f"a {tuple(self.a.shape)} must be contiguous [max_loras, width, "
                             f"{in_features}]")
        config = dataclasses.replace(
            self.plan.shrink, block_k=min(self.plan.shrink.block_k, BESIDE_MAX_BLOCK_K),
            target_programs=BESIDE_PROGRAMS)
        num_splits, split_len = shrink_splits(num_tokens, in_features, config)
        y = torch.empty(num_splits, num_tokens, width, dtype=torch.float32, device=x.device)
        num_tiles = triton.cdiv(num_tokens, config.block_m)
        return ShrinkBeside(y, num_tiles * num_splits, num_splits, split_len, config.block_m,
                            block_w(width), config.block_k, BESIDE_STAGES,
                            self.plan.beside_max_registers)
