"""Integer weight-only projections kept packed on the GPU (kernels/int_pack.py's layout,
multiplied by kernels/int_gemm.py), and where they are not.

- **An integer checkpoint** (AWQ, GPTQ, compressed-tensors W4A16 / W8A16: int_checkpoints.py)
  on one CUDA GPU: each dense projection's q, zeros and scales are repacked along K
  (``packed_checkpoint``; act-order's inputs sorted by group, the permutation kept to gather
  x's columns) and stay packed: ~3.6x fewer bytes than bf16 at 4 bits, group 128.
- **--quantization int4**: each projection's weight, from a bf16 checkpoint or a dummy
  model's random draw, is rounded to nearest as it reaches the GPU (4 bits, groups of 128,
  zero points: ``quantize_rtn``), the way FP8 weights are made; what benchmarks of a 4-bit
  model run on dummy weights. A dummy model whose config carries an integer
  quantization_config (``dummy:llama-3.1-8b-awq``, the config vLLM's dummy loader takes
  too) draws its random weights into that config's layout the same way (``dummy_layout``).
- Everywhere else an integer checkpoint is dequantized while it loads, the log saying why
  (``packing_refusal``): the CPU, tensor parallelism and MoE models (packed shards and
  packed experts are not built), --quantization fp8 on top, or a checkpoint the layout
  cannot hold (fused parts with different act-orders, groups of unequal sizes, a quantized
  lm_head or a projection left unquantized).
"""

from __future__ import annotations

import structlog
import torch
import torch.nn.functional as F

from kernels.int_pack import IntLayout, IntWeight, pack
from services.worker.int_checkpoints import (IntCheckpoint, QuantParts, pop_parts,
                                             quantized_modules)

log = structlog.get_logger()

RTN_LAYOUT = IntLayout(bits=4, group_size=128, zero_points=True, act_order=False)
# each fused projection's parts (they must share their input order), then the unfused ones
FUSED = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
         ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))
# IntWeight field -> the Linear buffer holding it (and the HF-side tensor suffix)
BUFFERS = {"qweight": "int_qweight", "scales": "int_scales", "zeros": "int_zeros",
           "perm": "int_perm"}


def packing_refusal(device: torch.device, tp_size: int, moe: bool, quantization: str
                    ) -> str | None:
    """Why an integer checkpoint is not kept packed here, or None (it is)."""
    if device.type != "cuda":
        return f"the packed kernels run on CUDA; this worker runs on {device.type}"
    if tp_size > 1:
        return "tensor parallel: packed shards are not built"
    if moe:
        return "an MoE model: the expert kernels take plain weights"
    if quantization == "fp8":
        return "--quantization fp8 requantizes the dequantized weights"
    return None


def packed_checkpoint(hf: dict[str, torch.Tensor], checkpoint: IntCheckpoint, num_layers: int
                      ) -> tuple[dict[str, torch.Tensor], IntLayout] | str:
    """A checkpoint's tensors (HF names) with each dense projection as ``<module>.int_*``
    tensors in kernels/int_pack.py's layout, and that layout; or why the layout cannot hold
    them (``hf`` is left as it was)."""
    modules = quantized_modules(hf, checkpoint)
    expected = [f"model.layers.{i}.{part}" for i in range(num_layers) for group in FUSED
                for part in group]
    if sorted(modules) != sorted(expected):
        odd = sorted(set(modules) ^ set(expected))[0]
        return f"{odd} is {'quantized' if odd in modules else 'not quantized'}"
    out, packed = dict(hf), {}
    for layer in range(num_layers):
        for group in FUSED:
            names = [f"model.layers.{layer}.{part}" for part in group]
            parts = [pop_parts(out, name, checkpoint) for name in names]
            if any(not torch.equal(p.g_idx, parts[0].g_idx) for p in parts):
                return f"{names[0]}'s fused parts order their inputs differently (g_idx)"
            for name, part in zip(names, parts):
                weight = _repacked(part, checkpoint)
                if isinstance(weight, str):
                    return f"{name}: {weight}"
                packed[name] = weight
    layout = IntLayout(checkpoint.bits, checkpoint.group_size,
                       zero_points=any(w.zeros is not None for w in packed.values()),
                       act_order=any(w.perm is not None for w in packed.values()))
    for name, weight in packed.items():
        out.update({f"{name}.{suffix}": tensor for suffix, tensor
                    in int_tensors(weight, layout).items()})
    return out, layout


def _repacked(part: QuantParts, checkpoint: IntCheckpoint) -> IntWeight | str:
    """One projection's parts in the packed layout (zeros dropped where each is 2^(bits - 1),
    perm where the inputs are in order), or why the layout cannot hold it."""
    q, zeros, scales, g_idx = part
    bits, k = checkpoint.bits, q.shape[1]
    if checkpoint.group_size > 0 and checkpoint.group_size % (32 // bits):
        return f"group_size {checkpoint.group_size} is not a multiple of {32 // bits}"
    group = checkpoint.group_size if checkpoint.group_size > 0 else k
    order = torch.argsort(g_idx, stable=True)  # each group's inputs side by side, in order
    if not torch.equal(g_idx[order].long(), torch.arange(k, device=g_idx.device) // group):
        return f"its groups are not {group} inputs each"
    in_order = torch.equal(order, torch.arange(k, device=order.device))
    symmetric = bool((zeros == 1 << (bits - 1)).all())
    return pack(q if in_order else q[:, order], None if symmetric else zeros, scales, bits,
                checkpoint.group_size, None if in_order else order)


def int_tensors(weight: IntWeight, layout: IntLayout) -> dict[str, torch.Tensor]:
    """The Linear buffers (by name) holding ``weight`` as ``layout`` stores it: zeros of
    2^(bits - 1) and an identity perm written out where the layout has them."""
    n, k = weight.shape
    zeros, perm = weight.zeros, weight.perm
    if layout.zero_points and zeros is None:
        zeros = torch.full_like(weight.scales, 1 << (weight.bits - 1), dtype=torch.uint8)
    if layout.act_order and perm is None:
        perm = torch.arange(k, dtype=torch.int32, device=weight.qweight.device)
    tensors = {"int_qweight": weight.qweight, "int_scales": weight.scales}
    if layout.zero_points:
        tensors["int_zeros"] = zeros
    if layout.act_order:
        tensors["int_perm"] = perm
    return tensors


def quantize_rtn(weight: torch.Tensor, layout: IntLayout = RTN_LAYOUT) -> IntWeight:
    """weight [N, K] (float, on its device) rounded to nearest per group of inputs, scales in
    the weight's dtype: with zero points scale (max - min) / (2^bits - 1) and z = round(-min /
    scale); symmetric (``layout.zero_points`` false), scale max|w| / (2^(bits-1) - 1)."""
    n, k = weight.shape
    maxq, half = (1 << layout.bits) - 1, 1 << (layout.bits - 1)
    group = layout.group_size if layout.group_size > 0 else k
    num_groups = -(-k // group)
    # the last group's padding is zeros: inside [min, max] already, since both take 0 in
    w = F.pad(weight.float(), (0, num_groups * group - k)).view(n, num_groups, group)
    hi, lo = w.amax(dim=-1).clamp(min=0), w.amin(dim=-1).clamp(max=0)  # [N, groups]
    if layout.zero_points:
        scales = ((hi - lo) / maxq).clamp(min=1e-8).to(weight.dtype)
        zeros = torch.round(-lo / scales.float()).clamp(0, maxq)  # [N, groups]
    else:
        scales = (torch.maximum(hi, -lo) / (half - 1)).clamp(min=1e-8).to(weight.dtype)
        zeros = torch.full_like(hi, half)
    q = (torch.round(w / scales.float()[..., None]) + zeros[..., None]).clamp(0, maxq)
    q = q.view(n, -1)[:, :k].to(torch.int32)
    return pack(q, zeros.to(torch.int32) if layout.zero_points else None, scales, layout.bits,
                layout.group_size)


def dummy_layout(checkpoint: IntCheckpoint) -> IntLayout | str:
    """The layout a dummy model's random weights take from its config's integer
    quantization_config (as vLLM's dummy loader takes the same config), or why none."""
    if checkpoint.group_size > 0 and checkpoint.group_size % (32 // checkpoint.bits):
        return f"group_size {checkpoint.group_size} is not a multiple of {32 // checkpoint.bits}"
    return IntLayout(checkpoint.bits, checkpoint.group_size,
                     zero_points=not checkpoint.symmetric, act_order=False)


def log_packed(layout: IntLayout, model: torch.nn.Module, source: str) -> None:
    """The log line saying the weights stay packed, with their bytes."""
    num_bytes = sum(buffer.numel() * buffer.element_size() for name, buffer
                    in model.named_buffers() if name.rpartition(".")[2] in BUFFERS.values())
    log.info("int_weights_packed", source=source, bits=layout.bits,
             group_size=layout.group_size, zero_points=layout.zero_points,
             act_order=layout.act_order, packed_bytes=num_bytes,
             note="kept packed on the GPU (kernels/int_gemm.py)")
