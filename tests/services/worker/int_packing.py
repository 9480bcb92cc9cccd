"""Integer weight-only checkpoints written from SmolLM2-135M-Instruct's real weights by a
round-to-nearest quantizer and reference packers of the tests' own: AWQ (AutoAWQ's GEMM
packing), GPTQ v1 (act-order on or off, 4 or 8 bits) and compressed-tensors pack-quantized (its
own ``pack_to_int32`` packs). Each writer returns the checkpoint's tensors dequantized in fp32
by the plain formula w = (q - z) * s, which ``write_plain`` saves as an ordinary checkpoint
for transformers. The tokenizer files come along, so ``flotilla serve --model DIR`` loads it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from shared.models import resolve_model
from tests.services.worker.moe_checkpoints import TOKENIZER_FILES

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's packer: the word's nibble i takes column ORDER[i]


def group_index(num_inputs: int, group_size: int, act_order: bool, seed: int = 0
                ) -> torch.Tensor:
    """Each input's group [K]: in order, or (act-order) groups of inputs taken in a seeded
    random order, as GPTQ's desc_act takes them by its Hessian's diagonal."""
    group = group_size if group_size > 0 else num_inputs
    if not act_order:
        return torch.arange(num_inputs) // group
    order = torch.randperm(num_inputs, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.empty(num_inputs, dtype=torch.long)
    g_idx[order] = torch.arange(num_inputs) // group
    return g_idx


def quantize_rtn(weight: torch.Tensor, bits: int, g_idx: torch.Tensor, symmetric: bool,
                 scale_dtype: torch.dtype, min_zero: int = 0):
    """Round to nearest per group: (q [N, K] unsigned, zeros [N, G], scales [N, G] in
    ``scale_dtype``), the scales rounded to their stored dtype before the weights use them."""
    maxq, num_groups = (1 << bits) - 1, int(g_idx.max()) + 1
    index = g_idx.expand_as(weight)  # [N, K]
    shape = (weight.shape[0], num_groups)
    hi = torch.zeros(shape).scatter_reduce(1, index, weight, "amax")  # [N, G], >= 0
    lo = torch.zeros(shape).scatter_reduce(1, index, weight, "amin")  # [N, G], <= 0
    if symmetric:
        scales = (torch.maximum(hi, -lo) / (maxq // 2)).clamp(min=1e-5).to(scale_dtype)
        zeros = torch.full(shape, (maxq + 1) // 2)
    else:
        scales = ((hi - lo) / maxq).clamp(min=1e-5).to(scale_dtype)
        zeros = torch.round(-lo / scales.float()).clamp(min_zero, maxq).long()
    q = torch.round(weight / scales.float()[:, g_idx]) + zeros[:, g_idx]
    return q.clamp(0, maxq).long(), zeros.long(), scales


def dequantize(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor) -> torch.Tensor:
    """The plain dequantization the checkpoint means: [N, K] fp32."""
    return (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 -> the same bits as int32."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack(values: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None
         ) -> torch.Tensor:
    """Unsigned values [R, C] packed 32/bits to an int32 along ``dim``, lowest bits first
    (``order``: which of a word's values each field takes, AWQ's)."""
    if dim == 0:
        return pack(values.T, bits, 1, order).T.contiguous()
    per_word = 32 // bits
    fields = values.long().reshape(values.shape[0], -1, per_word)  # [R, C/per_word, per_word]
    if order is not None:
        fields = fields[..., list(order)]
    shifts = torch.arange(per_word) * bits
    return to_int32((fields << shifts).sum(-1))


def awq_tensors(weight: torch.Tensor, group_size: int):
    """AutoAWQ GEMM tensors of one projection, and its dequantized weight [N, K]."""
    g_idx = group_index(weight.shape[1], group_size, act_order=False)
    q, zeros, scales = quantize_rtn(weight, 4, g_idx, symmetric=False, scale_dtype=torch.float16)
    packed = {"qweight": pack(q.T, 4, 1, AWQ_ORDER), "qzeros": pack(zeros.T, 4, 1, AWQ_ORDER),
              "scales": scales.T.contiguous()}  # [K, N/8], [G, N/8], [G, N]
    return packed, dequantize(q, zeros, scales, g_idx)


def gptq_tensors(weight: torch.Tensor, bits: int, group_size: int, act_order: bool,
                 symmetric: bool = True):
    """GPTQ v1 tensors of one projection (zeros stored minus one), and its dequantized weight."""
    g_idx = group_index(weight.shape[1], group_size, act_order)
    q, zeros, scales = quantize_rtn(weight, bits, g_idx, symmetric, torch.float16, min_zero=1)
    packed = {"qweight": pack(q.T, bits, 0), "qzeros": pack(zeros.T - 1, bits, 1),
              "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}
    return packed, dequantize(q, zeros, scales, g_idx)


def compressed_tensors_tensors(weight: torch.Tensor, bits: int, group_size: int,
                               symmetric: bool, act_order: bool = False):
    """compressed-tensors pack-quantized tensors of one projection (group_size -1: channel;
    act_order: actorder "group", with weight_g_idx), packed by the library itself, and its
    dequantized weight."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    offset = 1 << (bits - 1)
    g_idx = group_index(weight.shape[1], group_size, act_order)
    q, zeros, scales = quantize_rtn(weight, bits, g_idx, symmetric, torch.bfloat16)
    packed = {"weight_packed": pack_to_int32((q - offset).to(torch.int8), bits),
              "weight_scale": scales, "weight_shape": torch.tensor(list(weight.shape))}
    if act_order:
        packed["weight_g_idx"] = g_idx.to(torch.int32)
    if not symmetric:
        packed["weight_zero_point"] = pack_to_int32((zeros - offset).to(torch.int8), bits,
                                                    packed_dim=0)
    return packed, dequantize(q, zeros, scales, g_idx)


def quantization_config(method: str, bits: int, group_size: int, act_order: bool = False,
                        symmetric: bool = True) -> dict:
    if method == "awq":
        return {"quant_method": "awq", "version": "gemm", "bits": 4, "group_size": group_size,
                "zero_point": True, "modules_to_not_convert": None}
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "sym": symmetric,
                "desc_act": act_order, "damp_percent": 0.01, "static_groups": False,
                "true_sequential": True, "checkpoint_format": "gptq"}
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig,
                                                 QuantizationScheme)

    strategy = "channel" if group_size == -1 else "group"
    weights = QuantizationArgs(num_bits=bits, type="int", symmetric=symmetric, strategy=strategy,
                               group_size=None if group_size == -1 else group_size)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(
        targets=["Linear"], weights=weights)}, format="pack-quantized", ignore=["lm_head"])
    config = config.model_dump(mode="json")
    if act_order:  # what compressed-tensors before 0.20 wrote (0.20 refuses to make it)
        config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
    return config


def write_int_checkpoint(out: Path, method: str, bits: int = 4, group_size: int = 64,
                         act_order: bool = False, symmetric: bool = True,
                         num_layers: int | None = None) -> dict[str, torch.Tensor]:
    """SmolLM2 (its first ``num_layers``) at ``out`` in ``method``'s format; returns every
    tensor as the checkpoint means it, its projections dequantized (fp32)."""
    smol = resolve_model("smollm2").path
    config = json.loads((smol / "config.json").read_text())
    num_layers = num_layers or config["num_hidden_layers"]
    config.update(num_hidden_layers=num_layers, quantization_config=quantization_config(
        method, bits, group_size, act_order, symmetric))
    stored, plain = {}, {}
    for name, tensor in load_file(str(smol / "model.safetensors")).items():
        parts = name.split(".")
        if parts[1] == "layers" and int(parts[2]) >= num_layers:
            continue
        module = name.removesuffix(".weight")
        if not module.endswith(PROJECTIONS):
            stored[name] = plain[name] = tensor
            continue
        if method == "awq":
            packed, plain[name] = awq_tensors(tensor, group_size)
        elif method == "gptq":
            packed, plain[name] = gptq_tensors(tensor, bits, group_size, act_order, symmetric)
        else:
            packed, plain[name] = compressed_tensors_tensors(tensor, bits, group_size, symmetric,
                                                             act_order)
        stored.update({f"{module}.{suffix}": t for suffix, t in packed.items()})
    _write(out, stored, config)
    return plain


def write_plain(out: Path, tensors: dict[str, torch.Tensor], like: Path) -> Path:
    """``tensors`` as an ordinary fp32 checkpoint at ``out``, config.json as ``like``'s without
    its quantization_config."""
    config = json.loads((like / "config.json").read_text())
    config.pop("quantization_config")
    _write(out, tensors, config)
    return out


def _write(out: Path, tensors: dict[str, torch.Tensor], config: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()},
              str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    smol = resolve_model("smollm2").path
    for file in TOKENIZER_FILES:
        if (smol / file).exists():
            shutil.copy(smol / file, out / file)
