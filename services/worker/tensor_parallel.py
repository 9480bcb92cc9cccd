"""Tensor parallelism inside the model: which part of every weight a rank holds, and the
collectives that join the parts (docs/tensor-parallel.md).

A rank holds whole KV-head groups: its key/value heads and the query heads that read them
(q, k, v rows of qkv_proj; o_proj's matching input columns), a slice of the MLP's intermediate
size (gate and up rows, down's columns) and an equal, zero-padded slice of the vocabulary (the
embedding's and lm_head's rows). Norms and rotary tables are whole on every rank. Parts need
not be equal: SmolLM2's 3 KV heads split 2 + 1 over two ranks. o_proj and down give partial
sums that one all-reduce joins (their biases only on rank 0), the embedding's rows outside a
rank's slice are zeros in the same all-reduce, and the logits' slices are gathered.

``TensorParallel()`` is one rank holding everything: no collective runs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.worker import ops
from services.worker.moe_parallel import check_moe_parallel, local_spec, shard_moe

# fused projections: rows of qkv_proj and gate_up_proj are split, columns of o_proj and down
_ROW_SPLIT = ("self_attn.qkv_proj", "mlp.gate_up_proj")
_COLUMN_SPLIT = ("self_attn.o_proj", "mlp.down_proj")
_VOCAB_SPLIT = ("embed_tokens", "lm_head")


def split_range(total: int, size: int, rank: int) -> tuple[int, int]:
    """[start, end) of ``rank``'s part of ``total`` items in ``size`` contiguous parts whose
    lengths differ by at most one (the first ones longer)."""
    base, extra = divmod(total, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the ranks' torch.distributed group (NCCL or gloo); None: size 1
    # small sums over GPU peer memory (one_shot_reduce.OneShotReduce); None: all by NCCL/gloo
    one_shot: Any = None
    # --enable-expert-parallel: an MoE block's experts split whole between the ranks
    # (moe_parallel.py), not each expert sliced
    expert_parallel: bool = False

    def check(self, config) -> None:
        """A clear error when ``config`` (ModelConfig) cannot be split over ``size`` ranks."""
        if self.size > config.num_kv_heads:
            raise ValueError(f"tensor_parallel_size {self.size} exceeds the model's "
                             f"{config.num_kv_heads} key/value heads: each rank holds at least "
                             f"one (KV-head replication is not implemented)")
        if self.size > config.intermediate_size:
            raise ValueError(f"tensor_parallel_size {self.size} exceeds the intermediate size")
        check_moe_parallel(config.moe, self.size, self.expert_parallel)

    def part(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's part of ``total`` items (``split_range``)."""
        return split_range(total, self.size, self.rank)

    # ---- this rank's parts
    def kv_heads(self, config) -> tuple[int, int]:
        return split_range(config.num_kv_heads, self.size, self.rank)

    def q_heads(self, config) -> tuple[int, int]:
        group = config.num_heads // config.num_kv_heads  # query heads per KV head
        kv_start, kv_end = self.kv_heads(config)
        return kv_start * group, kv_end * group

    def intermediate(self, config) -> tuple[int, int]:
        return split_range(config.intermediate_size, self.size, self.rank)

    def vocab_rows(self, config) -> int:
        """Rows of a vocabulary slice: equal on every rank (the last one zero-padded), so the
        logits gather into one tensor."""
        return -(-config.vocab_size // self.size)

    def local_config(self, config):
        """``config`` as this rank's layers see it: its heads, KV heads and intermediate size;
        the vocabulary whole (the sampler's view)."""
        if self.size == 1:
            return config
        self.check(config)
        (q_start, q_end), (kv_start, kv_end) = self.q_heads(config), self.kv_heads(config)
        i_start, i_end = self.intermediate(config)
        return dataclasses.replace(
            config, num_heads=q_end - q_start, num_kv_heads=kv_end - kv_start,
            intermediate_size=i_end - i_start,
            moe=None if config.moe is None else local_spec(config.moe, self))

    # ---- collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the same bits). Every rank
        picks the same path: it depends on x's shape and dtype only."""
        if self.size > 1:
            if self.one_shot is not None and self.one_shot.takes(x):
                return self.one_shot.all_reduce(x)
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def linear_add_rms_norm(self, x: torch.Tensor, proj, residual: torch.Tensor, norm
                            ) -> tuple[torch.Tensor, torch.Tensor]:
        """A row-parallel projection (o_proj, down) of x [num_tokens, in_features/size] summed
        over the ranks, added into residual [num_tokens, hidden] and normalized by ``norm``:
        (normed, residual). Where the one-shot path takes it, one kernel after the GEMM; else
        the sum, then the norm's own add."""
        if self.one_shot is None or not self.one_shot.takes_add_rms_norm(residual) or \
                (proj.lora is not None and proj.lora.active):  # (its deltas join the sum)
            return norm(proj(x), residual)
        partial, bias = ops.linear_partials(x, proj.weight, proj.bias, proj.weight_scale)
        return self.one_shot.all_reduce_add_rms_norm(partial, bias, residual, norm.weight,
                                                     norm.eps)

    def gather_vocab(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """This rank's logits [num_rows, vocab_rows] -> all of them [num_rows, vocab_size]."""
        if self.size == 1:
            return logits
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        torch.distributed.all_gather(parts, logits.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV blocks: one block space for all)."""
        if self.size == 1:
            return value
        device = "cuda" if torch.distributed.get_backend(self.group) == "nccl" else "cpu"
        tensor = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MIN, group=self.group)
        return int(tensor.item())

    # ---- weights
    def shard(self, name: str, tensor: torch.Tensor, config) -> torch.Tensor:
        """A whole weight (this module's fused names; ``config`` the whole model's) -> this
        rank's part of it."""
        if self.size == 1:
            return tensor
        if config.moe is not None:
            part = shard_moe(name, tensor, config.moe, self)
            if part is not None:
                return part
        prefix, _, suffix = name.rpartition(".")  # suffix: weight, bias or weight_scale
        if prefix.endswith(_ROW_SPLIT):
            return torch.cat([tensor[start:end] for start, end in self._row_ranges(prefix, config)])
        if prefix.endswith(_COLUMN_SPLIT):
            if suffix == "bias":  # added once: on rank 0
                return tensor if self.rank == 0 else torch.zeros_like(tensor)
            if suffix == "weight_scale":  # per output channel: whole
                return tensor
            start, end = self._column_range(prefix, config)
            return tensor[:, start:end].contiguous()
        if prefix in _VOCAB_SPLIT:
            rows = self.vocab_rows(config)
            part = tensor[self.rank * rows:(self.rank + 1) * rows]
            return F.pad(part, (0, 0, 0, rows - part.shape[0]))
        return tensor

    def _row_ranges(self, prefix: str, config) -> list[tuple[int, int]]:
        if prefix.endswith("qkv_proj"):
            head_dim, q_size = config.head_dim, config.num_heads * config.head_dim
            kv_size = config.num_kv_heads * head_dim
            (q_start, q_end), (kv_start, kv_end) = self.q_heads(config), self.kv_heads(config)
            return [(q_start * head_dim, q_end * head_dim),
                    (q_size + kv_start * head_dim, q_size + kv_end * head_dim),
                    (q_size + kv_size + kv_start * head_dim, q_size + kv_size + kv_end * head_dim)]
        start, end = self.intermediate(config)
        size = config.intermediate_size
        return [(start, end), (size + start, size + end)]

    def _column_range(self, prefix: str, config) -> tuple[int, int]:
        if prefix.endswith("o_proj"):
            q_start, q_end = self.q_heads(config)
            return q_start * config.head_dim, q_end * config.head_dim
        return self.intermediate(config)


class VocabParallelEmbedding(nn.Embedding):
    """nn.Embedding of this rank's vocabulary rows [vocab_rows, hidden_size]: ids outside them
    give zeros, and the all-reduce fills each row in from the rank that holds it."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel, config):
        super().__init__(tp.vocab_rows(config) if tp.size > 1 else vocab_size, hidden_size)
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens]
        if self.tp.size == 1:
            return super().forward(input_ids)
        local_ids = input_ids - self.tp.rank * self.num_embeddings
        outside = (local_ids < 0) | (local_ids >= self.num_embeddings)
        x = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0.0))
