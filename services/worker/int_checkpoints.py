"""Checkpoints that ship integer weight-only projections, detected from config.json's
``quantization_config``:

- **AWQ** (AutoAWQ's GEMM format): ``quant_method: "awq"``, ``version: "gemm"``, 4 bits,
  zero points. ``qweight`` [K, N/8] int32 (eight columns a word, in AutoAWQ's nibble order
  ``AWQ_PACK_ORDER``), ``qzeros`` [K/group, N/8] packed the same way, ``scales`` [K/group, N].
- **GPTQ** (AutoGPTQ / GPTQModel, the v1 format): ``quant_method: "gptq"``, 4 or 8 bits,
  ``group_size`` (-1: one group), ``sym``, ``desc_act``. ``qweight`` [K*bits/32, N] int32
  (consecutive input rows in a word, lowest bits first), ``qzeros`` [groups, N*bits/32] holding
  each zero minus one (v1), ``scales`` [groups, N], ``g_idx`` [K] (each input's group; with
  ``desc_act`` they are not in order).
- **compressed-tensors** ``format: "pack-quantized"`` (llm-compressor's W4A16 / W8A16):
  ``weight_packed`` [N, K*bits/32] int32 (consecutive inputs, lowest bits first, stored as
  q + 2^(bits-1)), ``weight_scale`` [N, groups] (1 group: strategy ``channel``),
  ``weight_zero_point`` [N*bits/32, groups] packed along the outputs (asymmetric only),
  ``weight_shape`` [2], ``weight_g_idx`` [K] (actorder ``group``).

Every one is w = (q - z) * s per group (``QuantParts``). On a CUDA GPU the projections stay
packed (services/worker/int_weights.py repacks them into kernels/int_pack.py's layout); on
the CPU (and where that layout cannot hold them) they are computed in fp32 and cast to the
serving dtype while the checkpoint loads (``dequantized_weights``): the rest of the worker
then sees plain ``.weight`` tensors [N, K]. Any other combination is refused by field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import structlog
import torch

log = structlog.get_logger()

SUPPORTED_METHODS = ("awq", "gptq", "compressed-tensors (pack-quantized int, float 8-bit)", "fp8")
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ: the word's nibble i holds column ORDER[i]
# the tensors only these checkpoints have: read in their own dtypes (weights.read_safetensors)
PACKED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_zero_point",
                   "weight_shape", "weight_g_idx")


@dataclass(frozen=True)
class IntCheckpoint:
    """How a checkpoint stores its integer weights."""

    method: str  # "awq", "gptq" or "compressed-tensors"
    bits: int
    group_size: int  # inputs sharing a scale; -1: all of them (GPTQ -1, compressed-tensors channel)
    symmetric: bool  # no zero points stored (compressed-tensors) / a fixed one (GPTQ sym)
    act_order: bool = False  # groups given per input (g_idx), not in input order


def checkpoint_int(config: dict) -> IntCheckpoint | None:
    """The integer format of a checkpoint's config.json; None when it has no quantization_config
    or an FP8 one (fp8_checkpoints.py); a ValueError naming the field for anything else."""
    quantization = config.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method")
    if method == "awq":
        return _awq(quantization)
    if method == "gptq":
        return _gptq(quantization)
    if method == "compressed-tensors":
        schemes = [(group or {}).get("weights") or {}
                   for group in (quantization.get("config_groups") or {}).values()]
        if any(scheme.get("type") == "int" for scheme in schemes):
            return _compressed_tensors(quantization, schemes)
        return None
    if method == "fp8":
        return None
    raise ValueError(f"quantization_config.quant_method {method!r} is not supported "
                     f"(supported: {', '.join(SUPPORTED_METHODS)})")


def _refuse(field: str, value, accepted: str) -> ValueError:
    return ValueError(f"quantization_config.{field} is {value!r}: {accepted}")


def _awq(quantization: dict) -> IntCheckpoint:
    version = str(quantization.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse("version", version, "only AWQ's gemm packing loads")
    bits = quantization.get("bits", quantization.get("w_bit"))
    if bits != 4:
        raise _refuse("bits", bits, "AWQ loads with 4 bits")
    group_size = quantization.get("group_size", quantization.get("q_group_size"))
    if not isinstance(group_size, int) or group_size <= 0:
        raise _refuse("group_size", group_size, "AWQ needs a positive group size")
    if not quantization.get("zero_point", True):
        raise _refuse("zero_point", False, "AWQ loads with zero points only")
    return IntCheckpoint("awq", 4, group_size, symmetric=False)


def _gptq(quantization: dict) -> IntCheckpoint:
    bits = quantization.get("bits")
    if bits not in (4, 8):
        raise _refuse("bits", bits, "GPTQ loads with 4 or 8 bits")
    group_size = quantization.get("group_size", -1)
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise _refuse("group_size", group_size, "GPTQ needs a positive group size or -1")
    fmt = quantization.get("checkpoint_format", quantization.get("format", "gptq"))
    if fmt != "gptq":
        raise _refuse("checkpoint_format", fmt, "only the gptq (v1) packing loads")
    return IntCheckpoint("gptq", bits, group_size, symmetric=bool(quantization.get("sym", True)),
                         act_order=bool(quantization.get("desc_act", False)))


def _compressed_tensors(quantization: dict, schemes: list[dict]) -> IntCheckpoint:
    if quantization.get("format") != "pack-quantized":
        raise _refuse("format", quantization.get("format"),
                      "integer compressed-tensors weights load as pack-quantized only")
    groups = list(quantization["config_groups"].items())
    for name, group in groups:
        if group.get("input_activations") or group.get("output_activations"):
            raise ValueError(f"quantization_config.config_groups.{name} quantizes activations: "
                             f"only weight-only schemes (W4A16, W8A16) load")
        if group.get("format") not in (None, "pack-quantized"):
            raise _refuse(f"config_groups.{name}.format", group["format"], "pack-quantized only")
    if any(scheme != schemes[0] for scheme in schemes):
        raise ValueError("quantization_config.config_groups differ in their weights: one "
                         "weight scheme for every group loads")
    scheme, field = schemes[0], f"config_groups.{groups[0][0]}.weights"
    if scheme.get("type") != "int" or scheme.get("num_bits") not in (4, 8):
        raise _refuse(f"{field}.num_bits", scheme.get("num_bits"), "int 4 or 8 bits load")
    if scheme.get("dynamic"):
        raise _refuse(f"{field}.dynamic", True, "weights must be static")
    strategy = scheme.get("strategy")
    if strategy not in ("group", "channel"):
        raise _refuse(f"{field}.strategy", strategy, "group or channel")
    group_size = scheme.get("group_size") if strategy == "group" else -1
    if not isinstance(group_size, int) or (group_size <= 0 and group_size != -1):
        raise _refuse(f"{field}.group_size", group_size, "a positive group size")
    actorder = scheme.get("actorder")
    if actorder not in (None, "static", "weight", "group"):
        raise _refuse(f"{field}.actorder", actorder, "null, static, weight or group")
    return IntCheckpoint("compressed-tensors", scheme["num_bits"], group_size,
                         symmetric=scheme.get("symmetric", True), act_order=actorder == "group")


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """The unsigned ``bits``-wide values packed along ``dim`` of int32 words (lowest bits
    first): [R, C] -> [R * 32/bits, C] (dim 0) or [R, C * 32/bits] (dim 1), int32."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)  # [per_word]
    # an arithmetic shift smears the sign bit only into bits the mask drops
    if dim == 1:
        values = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [R, C, per_word]
        return values.reshape(packed.shape[0], -1)
    values = (packed.unsqueeze(1) >> shifts.view(1, -1, 1)) & ((1 << bits) - 1)  # [R, pw, C]
    return values.reshape(-1, packed.shape[1])


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's 4-bit words [R, C] -> values [R, C * 8] with the columns in order."""
    nibbles = unpack_int32(packed, 4, dim=1).view(packed.shape[0], -1, 8)  # [R, C, nibble]
    column_at = [AWQ_PACK_ORDER.index(column) for column in range(8)]  # column j's nibble
    return nibbles[..., column_at].reshape(packed.shape[0], -1)


class QuantParts(NamedTuple):
    """One projection as its checkpoint means it: w = (q - zeros) * scales per input's group."""

    q: torch.Tensor  # [N, K] int32, unsigned (0 .. 2^bits - 1)
    zeros: torch.Tensor  # [N, groups] int32
    scales: torch.Tensor  # [N, groups], the checkpoint's float dtype
    g_idx: torch.Tensor  # [K]: each input's group


def dequantize_groups(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                      g_idx: torch.Tensor) -> torch.Tensor:
    """w [N, K] fp32 = (q - z) * s, each input k with its group ``g_idx[k]``'s zero and scale:
    q [N, K], zeros [N, groups] (integers), scales [N, groups], g_idx [K]."""
    g = g_idx.long()
    return ((q - zeros[:, g]).float() * scales.float()[:, g]).contiguous()


def quantized_modules(hf: dict[str, torch.Tensor], checkpoint: IntCheckpoint) -> list[str]:
    """The modules of a checkpoint's tensors (HF names) that ship packed weights; a
    ValueError for a packed tensor with no packed weight beside it."""
    primary = "weight_packed" if checkpoint.method == "compressed-tensors" else "qweight"
    modules = [name.removesuffix(f".{primary}") for name in hf if name.endswith(f".{primary}")]
    known = set(modules)
    stray = [name for name in hf if name.rpartition(".")[0] not in known and (
        name.rpartition(".")[2] in PACKED_SUFFIXES
        or (primary == "weight_packed" and name.endswith(".weight_scale")))]
    if stray:
        raise ValueError(f"{stray[0]} has no {primary} beside it ({checkpoint.method} checkpoint)")
    return modules


def pop_parts(hf: dict[str, torch.Tensor], module: str, checkpoint: IntCheckpoint
              ) -> QuantParts:
    """Take one module's packed tensors out of ``hf`` -> its ``QuantParts``, checked against
    the config (a ValueError naming the tensor that disagrees)."""
    parts = {suffix: hf.pop(f"{module}.{suffix}") for suffix in
             ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
              "weight_zero_point", "weight_shape", "weight_g_idx")
             if f"{module}.{suffix}" in hf}
    if checkpoint.method == "compressed-tensors":
        return _compressed_tensors_parts(module, parts, checkpoint)
    return _awq_gptq_parts(module, parts, checkpoint)


def dequantized_weights(hf: dict[str, torch.Tensor], checkpoint: IntCheckpoint,
                        dtype: torch.dtype, reason: str = "CPU") -> dict[str, torch.Tensor]:
    """A checkpoint's tensors (HF names) with every packed projection as ``<module>.weight``
    [N, K] in ``dtype``, its packed tensors consumed; every other tensor as it was.
    ``reason``: why they are not kept packed (the log says it)."""
    out = dict(hf)
    modules = quantized_modules(out, checkpoint)
    for module in modules:  # one projection unpacked at a time
        out[f"{module}.weight"] = dequantize_groups(*pop_parts(out, module, checkpoint)).to(dtype)
    log.info("int_checkpoint_dequantized", method=checkpoint.method, bits=checkpoint.bits,
             group_size=checkpoint.group_size, symmetric=checkpoint.symmetric,
             act_order=checkpoint.act_order, num_projections=len(modules), dtype=str(dtype),
             note=f"served dequantized ({reason}): no memory saved")
    return out


def _require(module: str, parts: dict, suffix: str) -> torch.Tensor:
    if suffix not in parts:
        raise ValueError(f"{module}.{suffix} is missing beside its packed weight")
    return parts[suffix]


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], why: str) -> None:
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {list(tensor.shape)}, expected {list(expected)} "
                         f"({why})")


def _group_index(module: str, parts: dict, names: tuple[str, str, str],
                 checkpoint: IntCheckpoint, num_inputs: int, num_groups: int) -> torch.Tensor:
    """Each input's group [K]: the checkpoint's g_idx where it has one (act-order needs it),
    else inputs in order, ``group_size`` a group. ``names``: (weight, scales, g_idx) suffixes."""
    weight, scales, key = names
    group = checkpoint.group_size if checkpoint.group_size > 0 else num_inputs
    expected_groups = -(-num_inputs // group)
    if num_groups != expected_groups:
        raise ValueError(f"{module}.{weight} holds {num_inputs} inputs but {module}.{scales} has "
                         f"{num_groups} groups (group_size {checkpoint.group_size}: expected "
                         f"{expected_groups})")
    if key in parts:
        g_idx = parts[key]
        _check_shape(f"{module}.{key}", g_idx, (num_inputs,), "one group index per input")
        if int(g_idx.min()) < 0 or int(g_idx.max()) >= num_groups:
            raise ValueError(f"{module}.{key} names groups outside 0..{num_groups - 1}")
        return g_idx
    if checkpoint.act_order:
        raise ValueError(f"{module}.{key} is missing: an act-order checkpoint needs it")
    return torch.arange(num_inputs, device=parts[weight].device) // group


def _awq_gptq_parts(module: str, parts: dict, checkpoint: IntCheckpoint) -> QuantParts:
    """One AWQ or GPTQ projection's parts."""
    bits, per_word = checkpoint.bits, 32 // checkpoint.bits
    qweight, qzeros = _require(module, parts, "qweight"), _require(module, parts, "qzeros")
    scales = _require(module, parts, "scales")  # [groups, N]
    num_groups, n = scales.shape
    if checkpoint.method == "awq":
        num_inputs = qweight.shape[0]
        _check_shape(f"{module}.qweight", qweight, (num_inputs, n // per_word),
                     f"AWQ: [K, N/{per_word}] for the {n} outputs of {module}.scales")
        q = unpack_awq(qweight)  # [K, N]
    else:  # the inputs counted by g_idx where there is one: a wrong bits then names qweight
        num_inputs = len(parts["g_idx"]) if "g_idx" in parts else qweight.shape[0] * per_word
        if num_inputs % per_word:
            raise ValueError(f"{module}.g_idx has {num_inputs} inputs: not a whole number of "
                             f"{bits}-bit words of {module}.qweight")
        _check_shape(f"{module}.qweight", qweight, (num_inputs // per_word, n),
                     f"GPTQ {bits}-bit: [K*{bits}/32, N] for the {n} outputs of {module}.scales")
        q = unpack_int32(qweight, bits, dim=0)  # [K, N]
    _check_shape(f"{module}.qzeros", qzeros, (num_groups, n // per_word),
                 f"[groups, N*{bits}/32], {bits}-bit zeros")
    g_idx = _group_index(module, parts, ("qweight", "scales", "g_idx"), checkpoint, num_inputs,
                         num_groups)
    if checkpoint.method == "awq":
        zeros = unpack_awq(qzeros)  # [groups, N]
    else:
        zeros = unpack_int32(qzeros, bits, dim=1) + 1  # [groups, N]: v1 stores zero - 1
    return QuantParts(q.T, zeros.T, scales.T, g_idx)


def _compressed_tensors_parts(module: str, parts: dict, checkpoint: IntCheckpoint
                              ) -> QuantParts:
    """One compressed-tensors pack-quantized projection's parts."""
    bits, offset = checkpoint.bits, 1 << (checkpoint.bits - 1)
    packed, scales = parts["weight_packed"], _require(module, parts, "weight_scale")
    n, num_inputs = (int(d) for d in _require(module, parts, "weight_shape").tolist())
    _check_shape(f"{module}.weight_packed", packed, (n, -(-num_inputs * bits // 32)),
                 f"[N, ceil(K*{bits}/32)] for weight_shape [{n}, {num_inputs}]")
    num_groups = scales.shape[1] if scales.dim() == 2 else 0
    _check_shape(f"{module}.weight_scale", scales, (n, num_groups), "[N, groups]")
    g_idx = _group_index(module, parts, ("weight_packed", "weight_scale", "weight_g_idx"),
                         checkpoint, num_inputs, num_groups)
    q = unpack_int32(packed, bits, dim=1)[:, :num_inputs]  # [N, K], unsigned: q + offset
    if checkpoint.symmetric:
        zeros = torch.full((n, num_groups), offset, dtype=torch.int32, device=q.device)
    else:
        packed_zeros = _require(module, parts, "weight_zero_point")
        _check_shape(f"{module}.weight_zero_point", packed_zeros,
                     (-(-n * bits // 32), num_groups), f"[ceil(N*{bits}/32), groups]")
        zeros = unpack_int32(packed_zeros, bits, dim=0)[:n]  # [N, groups], z + offset
    return QuantParts(q, zeros, scales, g_idx)
