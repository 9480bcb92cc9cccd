"""The decode-size MoE path (kernels/moe_pairs.py): a program per (token, k) pair gives
fused_moe_ref's result for every dtype, FP8 weights and sentinel pairs (padded rows, another
rank's experts), under TRITON_INTERPRET=1 on the CPU (tests/conftest.py); fused_moe takes it
for a few rows on CUDA, never with batch_invariant."""

from __future__ import annotations

import pytest
import torch

from kernels import moe_pairs
from kernels.fused_moe import fused_moe_ref
from kernels.moe_pairs import pairs_moe
from tests.kernels.test_fused_moe import DEVICE, TOLERANCE, layer, quantized_layer, rel_err, routed


def _inputs(num_tokens, num_experts, top_k, dtype, seed, hidden=96, inter=40):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    w13, w2 = layer(num_experts, hidden, inter, gen, dtype)  # (shapes off every block size)
    x = torch.randn(num_tokens, hidden, generator=gen, device=DEVICE).to(dtype)
    weights, ids = routed(num_tokens, num_experts, top_k, gen)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (3, 16, 8), (4, 8, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pairs_match_ref(num_tokens, num_experts, top_k, dtype):
    x, w13, w2, weights, ids = _inputs(num_tokens, num_experts, top_k, dtype,
                                       num_tokens * 31 + top_k)
    out = pairs_moe(x, w13.contiguous(), w2.contiguous(), weights, ids, None, None)
    assert out.dtype == dtype and out.shape == x.shape and not out.isnan().any()
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < TOLERANCE[dtype]


def test_sentinel_pairs_and_fp8_weights():
    x, w13, w2, weights, ids = _inputs(3, 8, 2, torch.float32, 5)
    ids[1, :] = 8  # a padded row: routed nowhere, comes out 0
    ids[2, 1] = -1  # (another rank's expert, as local ids leave it: nothing either)
    ref_ids = torch.where(ids < 0, torch.full_like(ids, 8), ids)
    out = pairs_moe(x, w13, w2, weights, ids, None, None)
    assert (out[1] == 0).all()
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ref_ids)) < 1e-5
    q13, s13, q2, s2 = quantized_layer(w13, w2)
    out = pairs_moe(x, q13, q2, weights, ref_ids, s13, s2)
    assert rel_err(out, fused_moe_ref(x, q13, q2, weights, ref_ids, s13, s2)) < 1e-5


def test_fused_moe_takes_the_path_for_few_rows_only():
    assert 1 <= moe_pairs.MAX_TOKENS <= 16
