"""The packed layout of integer weight-only projections (W4A16 / W8A16) that
kernels/int_gemm.py reads, its packer, and the plain-torch dequantization and GEMM it is
tested against.

An ``IntWeight`` holds one projection ``y = x @ W^T`` of ``out_features`` N and
``in_features`` K, with W = (q - z) * s per group of inputs:

- ``qweight`` [ceil(K / per_word), N] int32: packed along K, ``per_word`` = 32 / bits
  consecutive inputs a word, the lowest bits first (GPTQ v1's order), so projections fused
  along N (q/k/v, gate/up) are the columns of their parts side by side. The unsigned values
  0..2^bits - 1; a last partial word is padded with zeros.
- ``scales`` [num_groups, N] in the checkpoint's float dtype (fp16, bf16 or fp32: widened to
  fp32 where used, so nothing rounds them), ``zeros`` [num_groups, N] uint8, or None where
  every zero is 2^(bits - 1) (symmetric). Input k (in the packed order) is in group
  k // group_size; ``group_size`` is a multiple of per_word (a word's inputs share a group),
  or -1: one group (channel-wise).
- ``perm`` [K] int32 or None (act-order): packed input j is the activation's column perm[j].
  An act-order checkpoint's inputs are sorted by their group at load (a stable sort), which
  puts each group's inputs side by side, and the kernel gathers x's columns through perm:
  exact, the same products summed in another order. Where the sorted groups are not
  ``group_size`` inputs each, the layout cannot hold them (the loader dequantizes instead).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class IntLayout:
    """How a model's packed projections are stored (one for all of them): what the worker's
    ``Linear`` registers its buffers by."""

    bits: int  # 4 or 8
    group_size: int  # -1: one group (channel-wise)
    zero_points: bool  # a zeros tensor per projection (False: 2^(bits - 1) each)
    act_order: bool  # a perm per projection

    def shapes(self, in_features: int, out_features: int) -> dict[str, tuple[int, ...]]:
        """Each packed tensor's shape by ``IntWeight`` field name."""
        per_word, groups = 32 // self.bits, num_groups(in_features, self.group_size)
        shapes = {"qweight": (-(-in_features // per_word), out_features),
                  "scales": (groups, out_features)}
        if self.zero_points:
            shapes["zeros"] = (groups, out_features)
        if self.act_order:
            shapes["perm"] = (in_features,)
        return shapes


@dataclass(frozen=True)
class IntWeight:
    """One packed projection (the layout above)."""

    qweight: torch.Tensor  # [ceil(K / per_word), N] int32
    scales: torch.Tensor  # [num_groups, N] float
    zeros: torch.Tensor | None  # [num_groups, N] uint8; None: 2^(bits - 1) each
    perm: torch.Tensor | None  # [K] int32; None: inputs in order
    bits: int
    group_size: int  # -1: one group
    in_features: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def per_word(self) -> int:
        return 32 // self.bits

    @property
    def shape(self) -> tuple[int, int]:
        """The plain weight's [N, K], as nn.Linear holds it."""
        return self.out_features, self.in_features

    @property
    def num_bytes(self) -> int:
        tensors = (self.qweight, self.scales, self.zeros, self.perm)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def num_groups(in_features: int, group_size: int) -> int:
    return 1 if group_size <= 0 else -(-in_features // group_size)


def pack_along_k(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned values q [N, K] (0..2^bits - 1, any int dtype) -> [ceil(K / per_word), N]
    int32, per_word inputs a word, lowest bits first."""
    per_word = 32 // bits
    n, k = q.shape
    num_words = -(-k // per_word)
    padded = torch.zeros(n, num_words * per_word, dtype=torch.int64, device=q.device)
    padded[:, :k] = q
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=q.device)  # [per_word]
    words = (padded.view(n, num_words, per_word) << shifts).sum(dim=-1)  # [N, words] < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words)  # as int32's bits
    return words.to(torch.int32).T.contiguous()


def unpack_along_k(qweight: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """``pack_along_k``'s inverse: [words, N] int32 -> q [N, K] int32."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=qweight.device)
    # an arithmetic shift smears the sign bit only into bits the mask drops
    values = (qweight.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)  # [W, pw, N]
    return values.reshape(-1, qweight.shape[1])[:in_features].T.contiguous()


def pack(q: torch.Tensor, zeros: torch.Tensor | None, scales: torch.Tensor, bits: int,
         group_size: int, perm: torch.Tensor | None = None) -> IntWeight:
    """An ``IntWeight`` from q [N, K] (unsigned, already in the packed input order), zeros
    [N, groups] (None: symmetric), scales [N, groups] and perm [K] (None: in order)."""
    if group_size > 0 and group_size % (32 // bits):
        raise ValueError(f"group_size {group_size} is not a multiple of {32 // bits}")
    k = q.shape[1]
    return IntWeight(
        qweight=pack_along_k(q, bits), scales=scales.T.contiguous(),
        zeros=None if zeros is None else zeros.T.to(torch.uint8).contiguous(),
        perm=None if perm is None else perm.to(torch.int32).contiguous(), bits=bits,
        group_size=group_size, in_features=k)


def dequantize(weight: IntWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The plain weight [N, K] in the activation's input order: (q - z) * s in fp32, cast to
    ``dtype`` (int_checkpoints' dequantization, bit for bit)."""
    k = weight.in_features
    q = unpack_along_k(weight.qweight, weight.bits, k)  # [N, K]
    group = weight.group_size if weight.group_size > 0 else k
    g = torch.arange(k, device=q.device) // group  # [K]
    zeros = (torch.full_like(q, 1 << (weight.bits - 1)) if weight.zeros is None
             else weight.zeros.T.to(torch.int32)[:, g])
    w = ((q - zeros).float() * weight.scales.T.float()[:, g]).to(dtype)  # [N, K], packed order
    if weight.perm is None:
        return w
    plain = torch.empty_like(w)
    plain[:, weight.perm.long()] = w
    return plain


def int_gemm_ref(x: torch.Tensor, weight: IntWeight, bias: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype: F.linear in fp32 on the dequantized weight (what the
    CPU would run and what the kernels are tested against)."""
    out = F.linear(x.float(), dequantize(weight), None if bias is None else bias.float())
    return out.to(x.dtype)


def random_int_weight(n: int, k: int, bits: int, group_size: int, device, generator,
                      zero_points: bool = True, act_order: bool = False,
                      scale_dtype: torch.dtype = torch.float16, std: float = 0.02
                      ) -> IntWeight:
    """A random packed projection whose dequantized values have about ``std`` (tests and
    benchmarks): q uniform, zeros near the middle, scales std / (2^bits / sqrt(12))."""
    groups = num_groups(k, group_size)
    levels = 1 << bits
    q = torch.randint(0, levels, (n, k), generator=generator, device=device)
    zeros = (torch.randint(levels // 2 - 2, levels // 2 + 2, (n, groups), generator=generator,
                           device=device) if zero_points else None)
    base = std * 12 ** 0.5 / levels
    scales = base * (0.5 + torch.rand(n, groups, generator=generator, device=device))
    perm = (torch.randperm(k, generator=generator, device=device) if act_order else None)
    return pack(q, zeros, scales.to(scale_dtype), bits, group_size, perm)
