"""Launch configs of the LoRA shrink and expand (kernels/lora.py), per projection shape and row
count.

A ``LoraPlan`` is the two kernels' configs; they need not share BLOCK_M (each groups the step's
rows into its own tiles; the shrink's partial sums are indexed by row). Plans are chosen by
(in_features, width, out_features, dtype) and the bucket of the row count (the smallest swept
count at least the step's; past the largest, the largest), from ``lora_configs.json`` beside
this module: what ``benchmarks/gpu/lora_kernels.py --sweep --out`` writes, with the device and
Triton version it was tuned on. A shape without an entry runs ``default_plan``. The row
buckets are few, so a CUDA graph bucket compiles at most one kernel pair of each shape, never
one per context length.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

TABLE_PATH = Path(__file__).with_name("lora_configs.json")
BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)  # the sweep's row counts


@dataclass(frozen=True)
class ShrinkConfig:
    block_m: int  # rows per tile
    block_k: int
    target_programs: int = 64  # row tiles x splits of in_features a launch aims at
    max_splits: int = 16
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class ExpandConfig:
    block_m: int
    block_n: int  # output columns per program
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class LoraPlan:
    shrink: ShrinkConfig
    expand: ExpandConfig
    # the shrink as programs inside the projection's skinny GEMM launch (kernels/lora_delta.py
    # ``LoraDelta.beside``), where benchmarks/gpu/lora_beside.py timed it faster, and the cap
    # on that launch's registers a thread it was timed with (None: the compiler's choice; the
    # shrink's code may otherwise take the GEMM's programs per SM)
    beside: bool = False
    beside_max_registers: int | None = None

    def to_json(self) -> dict:
        entry = {"shrink": asdict(self.shrink), "expand": asdict(self.expand)}
        if self.beside:
            entry["beside"] = True
            if self.beside_max_registers is not None:
                entry["beside_max_registers"] = self.beside_max_registers
        return entry

    @staticmethod
    def from_json(entry: dict) -> LoraPlan:
        return LoraPlan(ShrinkConfig(**entry["shrink"]), ExpandConfig(**entry["expand"]),
                        entry.get("beside", False), entry.get("beside_max_registers"))


def block_w(width: int) -> int:
    """The tile width the kernels pad a projection's parts * max_rank to."""
    return max(16, 1 << (width - 1).bit_length())


def default_plan(num_tokens: int, width: int) -> LoraPlan:
    """The first guesses (before any sweep): few-row tiles at decode sizes; 8 warps for wide
    or 64-row shrink tiles (4 spilled registers there, compiled for sm_90)."""
    block_m = 16 if num_tokens <= 256 else 64
    wide = block_w(width)
    shrink = ShrinkConfig(block_m=block_m, block_k=32 if wide >= 256 else 64,
                          num_warps=8 if block_m == 64 or wide >= 128 else 4)
    return LoraPlan(shrink, ExpandConfig(block_m=block_m, block_n=64 if wide <= 128 else 32))


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def shape_key(in_features: int, width: int, out_features: int, dtype: torch.dtype) -> str:
    return f"{in_features}x{width}x{out_features}/{dtype_name(dtype)}"


def bucket(num_tokens: int) -> int:
    return next((b for b in BUCKETS if b >= num_tokens), BUCKETS[-1])


@functools.cache
def _table(path: Path) -> dict:
    if not path.is_file():
        return {}
    return json.loads(path.read_text()).get("plans", {})


def plan_for(in_features: int, width: int, out_features: int, num_tokens: int,
             dtype: torch.dtype, path: Path = TABLE_PATH) -> LoraPlan:
    """The swept plan of this shape at the step's row bucket, else ``default_plan``."""
    entry = _table(path).get(shape_key(in_features, width, out_features, dtype), {})
    plan = entry.get(str(bucket(num_tokens)))
    return LoraPlan.from_json(plan) if plan else default_plan(num_tokens, width)
