"""Launch configs of the fused MoE GEMMs (kernels/fused_moe.py), per layer shape and row count.

A ``MoePlan`` is the two GEMMs' configs (gate_up + SwiGLU, then down), sharing BLOCK_M (the
align step pads each expert's pairs to it). Plans are chosen by (num_experts, inter, hidden,
weight dtype) and the bucket of the row count (the smallest swept count at least the step's;
past the largest, the largest), from ``moe_configs.json`` beside this module: what
``benchmarks/gpu/fused_moe.py --sweep --out`` writes, with the device and Triton version it was
tuned on. A shape without an entry runs ``default_plan`` (``config_source`` says which, and
the first untuned launch of a shape logs ``moe_config_untuned``). Under batch invariance one
plan per shape whatever the row count (the entry's ``invariant``): a row's numbers then
depend on that row alone (the BLOCK_K steps and the dot's instruction shape fixed).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog
import torch

TABLE_PATH = Path(__file__).with_name("moe_configs.json")
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)  # the sweep's row counts
INVARIANT = "invariant"  # the entry's bucket-independent plan


@dataclass(frozen=True)
class MoeConfig:
    block_m: int  # sorted pairs per program (an expert's share padded to this)
    block_n: int  # output columns per program (GEMM 1: columns of gate and of up each)
    block_k: int
    group_m: int = 1  # row blocks side by side per column tile (L2 reuse of weight tiles)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoePlan:
    gate_up: MoeConfig
    down: MoeConfig

    def __post_init__(self):
        if self.gate_up.block_m != self.down.block_m:
            raise ValueError(f"the GEMMs must share block_m: {self}")

    @property
    def block_m(self) -> int:
        return self.gate_up.block_m

    def to_json(self) -> dict:
        return {"gate_up": asdict(self.gate_up), "down": asdict(self.down)}

    @staticmethod
    def from_json(entry: dict) -> MoePlan:
        return MoePlan(MoeConfig(**entry["gate_up"]), MoeConfig(**entry["down"]))


def dtype_name(dtype: torch.dtype) -> str:
    return "fp8" if dtype == torch.float8_e4m3fn else str(dtype).removeprefix("torch.")


def shape_key(num_experts: int, inter: int, hidden: int, dtype: torch.dtype) -> str:
    return f"E{num_experts}_I{inter}_H{hidden}_{dtype_name(dtype)}"


@functools.cache
def load_table(path: Path = TABLE_PATH) -> dict:
    """{"device", "triton", "shapes": {shape_key: {bucket or "invariant": plan}}} parsed into
    MoePlans; an empty table when the file is absent."""
    if not path.exists():
        return {"device": None, "triton": None, "shapes": {}}
    raw = json.loads(path.read_text())
    shapes = {key: {bucket: MoePlan.from_json(plan) for bucket, plan in entry.items()}
              for key, entry in raw.get("shapes", {}).items()}
    return {"device": raw.get("device"), "triton": raw.get("triton"), "shapes": shapes}


def bucket_of(num_tokens: int, buckets) -> str:
    """The smallest bucket holding num_tokens rows (past the largest: the largest)."""
    sizes = sorted(int(b) for b in buckets if b != INVARIANT)
    return str(next((size for size in sizes if size >= num_tokens), sizes[-1]))


def default_plan(num_experts: int, top_k: int, num_tokens: int | None) -> MoePlan:
    """Untuned: BLOCK_M from the mean pairs per expert (None, batch invariance: one plan),
    64 columns and 128-wide K steps per program."""
    if num_tokens is None:
        block_m = 32
    else:
        per_expert = num_tokens * top_k / num_experts
        block_m = 16 if per_expert <= 16 else 32 if per_expert <= 64 else 64
    config = MoeConfig(block_m=block_m, block_n=64, block_k=128, group_m=8 if block_m > 16 else 1)
    return MoePlan(config, config)


def plan_for(num_experts: int, top_k: int, inter: int, hidden: int, dtype: torch.dtype,
             num_tokens: int | None, table: dict | None = None) -> MoePlan:
    """The plan for a step of num_tokens rows (None: batch invariant, one plan per shape)."""
    entry = (table or load_table())["shapes"].get(shape_key(num_experts, inter, hidden, dtype))
    if entry is not None:
        if num_tokens is None and INVARIANT in entry:
            return entry[INVARIANT]
        buckets = [b for b in entry if b != INVARIANT]
        if num_tokens is not None and buckets:
            return entry[bucket_of(num_tokens, buckets)]
    _warn_untuned(shape_key(num_experts, inter, hidden, dtype))
    return default_plan(num_experts, top_k, num_tokens)


def config_source(num_experts: int, inter: int, hidden: int, dtype: torch.dtype,
                  table: dict | None = None) -> str:
    """Where this shape's plans come from: 'tuned on <device>, triton <version>' or
    'default (untuned)'."""
    table = table or load_table()
    if shape_key(num_experts, inter, hidden, dtype) in table["shapes"]:
        return f"tuned on {table['device']}, triton {table['triton']}"
    return "default (untuned)"


@functools.cache
def _warn_untuned(key: str) -> None:
    structlog.get_logger().warning("moe_config_untuned", shape=key, table=str(TABLE_PATH))
