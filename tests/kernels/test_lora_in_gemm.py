"""The LoRA expand in the skinny GEMM's epilogue (kernels/skinny_gemm.py ``lora``): plain,
split-K (with the residual add and RMSNorm) and gated launches against the unfused
shrink-GEMM-expand references, with adapter rows of several slots and base rows in one tile;
base rows keep the plain GEMM's bits.

On CPU under TRITON_INTERPRET=1 in fp32 (the interpreter's bf16 tl.dot is wrong); bf16 and the
8B's shapes on the GPU (-m gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.activation import silu_and_mul_ref
from kernels.lora import LoraDelta, lora_rows_of, lora_shrink
from kernels.lora_configs import ShrinkConfig
from kernels.rms_norm import rms_norm_ref
from kernels.skinny_gemm import (SkinnyConfig, skinny_gemm, skinny_gemm_add_rms_norm,
                                 skinny_gemm_silu_and_mul)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONE_PASS = SkinnyConfig(block_n=16, block_k=32)
SPLIT = SkinnyConfig(block_n=16, block_k=32, split_k=3)
# small splits of in_features, so the epilogue sums several of the shrink's partials
SHRINK = ShrinkConfig(block_m=16, block_k=32, max_splits=4, target_programs=4)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def operands(num_tokens, in_features, out_features, width, num_slots, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, in_features, generator=gen)
    weight = torch.randn(out_features, in_features, generator=gen) / in_features ** 0.5
    a = torch.randn(num_slots, width, in_features, generator=gen) / in_features ** 0.5
    b = torch.randn(num_slots, out_features, width, generator=gen) / width ** 0.5
    slots = torch.arange(num_tokens, dtype=torch.int32) % (num_slots + 1)
    slots[slots == num_slots] = -1  # base rows between the adapters' rows
    return [t.to(DEVICE, dtype) for t in (x, weight, a, b)] + [slots.to(DEVICE)]


def delta_of(x, a, b, slots) -> LoraDelta:
    y = lora_shrink(x, a, lora_rows_of(slots), SHRINK)
    assert y.shape[0] > 1  # (the epilogue adds several splits)
    return LoraDelta(y, b, slots)


def reference(x, weight, a, b, slots) -> torch.Tensor:
    """x @ W^T plus each adapter row's (x @ a[slot]^T) @ b[slot]^T, in float64."""
    out = F.linear(x.double(), weight.double())
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            out[row] += (x[row].double() @ a[slot].double().T) @ b[slot].double().T
    return out


@pytest.mark.parametrize("config", [ONE_PASS, SPLIT], ids=["one_pass", "split3"])
@pytest.mark.parametrize("num_tokens", [1, 5, 19])
def test_plain_launch_adds_each_rows_delta(config, num_tokens):
    x, weight, a, b, slots = operands(num_tokens, 400, 40, 24, 3, num_tokens, torch.float32)
    out = skinny_gemm(x, weight, config=config, lora=delta_of(x, a, b, slots))
    assert rel_err(out, reference(x, weight, a, b, slots)) < 1e-5
    base = slots < 0  # base rows: the plain GEMM's bits
    assert torch.equal(out[base], skinny_gemm(x, weight, config=config)[base])


def test_split_launch_with_the_norm_adds_the_delta_before_the_residual():
    x, weight, a, b, slots = operands(6, 400, 40, 16, 2, 7, torch.float32)
    gen = torch.Generator().manual_seed(3)
    residual = torch.randn(6, 40, generator=gen).to(DEVICE)
    norm_weight = torch.rand(40, generator=gen).to(DEVICE) + 0.5
    expected_sum = reference(x, weight, a, b, slots).float() + residual
    normed, summed = skinny_gemm_add_rms_norm(x, weight, None, residual.clone(), norm_weight,
                                              1e-6, config=SPLIT,
                                              lora=delta_of(x, a, b, slots))
    assert rel_err(summed, expected_sum) < 1e-5
    assert rel_err(normed, rms_norm_ref(expected_sum, norm_weight, 1e-6)) < 1e-5


def test_gated_launch_adds_gate_and_up_deltas_before_swiglu():
    x, weight, a, b, slots = operands(5, 300, 2 * 24, 32, 2, 11, torch.float32)
    out = skinny_gemm_silu_and_mul(x, weight, config=ONE_PASS, lora=delta_of(x, a, b, slots))
    expected = silu_and_mul_ref(reference(x, weight, a, b, slots).float())
    assert rel_err(out, expected) < 1e-5


def test_lora_operands_that_do_not_fit_are_refused():
    x, weight, a, b, slots = operands(4, 300, 32, 16, 2, 1, torch.float32)
    delta = delta_of(x, a, b, slots)
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm(x, weight, config=ONE_PASS, lora=delta._replace(b=b[:, :16].contiguous()))
    with pytest.raises(ValueError, match="do not fit"):
        skinny_gemm(x, weight, config=ONE_PASS, lora=delta._replace(token_slots=slots[:2]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("out_features,in_features,width", [
    (6144, 4096, 48), (4096, 4096, 16), (4096, 14336, 16)])
@pytest.mark.parametrize("num_tokens", [1, 4, 16])
def test_real_shapes_in_bf16_on_the_gpu(out_features, in_features, width, num_tokens):
    x, weight, a, b, slots = operands(num_tokens, in_features, out_features, width, 8,
                                      num_tokens, torch.bfloat16)
    y = lora_shrink(x, a, lora_rows_of(slots))
    out = skinny_gemm(x, weight, lora=LoraDelta(y, b, slots))
    assert rel_err(out, reference(x, weight, a, b, slots)) < 1e-2
    base = slots < 0
    assert torch.equal(out[base], skinny_gemm(x, weight)[base])
