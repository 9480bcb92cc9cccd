"""LoRA's shrink and expand kernels (kernels/lora.py) against their torch references and
against each part's own product: mixed slots with base rows (-1) between them, ranks under
max_rank, fused parts, splits of in_features, base rows left with their bits.

On CPU under TRITON_INTERPRET=1 (tests/conftest.py), small shapes; the real projections'
shapes, CUDA graphs and recompiles on the GPU (-m gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.lora import (
    _expand_kernel, _shrink_kernel, group_rows, lora_expand, lora_expand_ref, lora_rows_of,
    lora_shrink, lora_shrink_ref, shrink_splits)
from kernels.lora_configs import ExpandConfig, LoraPlan, ShrinkConfig, default_plan

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# bf16: the interpreter rounds fp32 to bf16 toward zero (numpy has no bf16)
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2 if DEVICE == "cuda" else 3e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def slot_pattern(kind: str, num_tokens: int, num_slots: int, gen) -> torch.Tensor:
    """token_slots [num_tokens] int32 of a kind of step."""
    if kind == "base":
        slots = torch.full((num_tokens,), -1)
    elif kind == "one":
        slots = torch.full((num_tokens,), num_slots - 1)
    elif kind == "interleaved":  # a decode batch over every adapter and the base model
        slots = torch.arange(num_tokens) % (num_slots + 1)
        slots[slots == num_slots] = -1
    else:  # random runs: prompt chunks of several requests
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen, device=gen.device)
        slots = slots[torch.arange(num_tokens) // 4 * 4]
    return slots.to(torch.int32).to(DEVICE)


def random_slots(num_slots, width, in_features, out_features, gen, dtype):
    a = torch.randn(num_slots, width, in_features, generator=gen, device=gen.device)
    b = torch.randn(num_slots, out_features, width, generator=gen, device=gen.device)
    a, b = a / in_features ** 0.5, b / width ** 0.5
    return a.to(DEVICE, dtype), b.to(DEVICE, dtype)


def test_group_rows_orders_adapter_rows_by_slot():
    slots = np.array([2, -1, 0, 2, -1, 0, 1], np.int32)
    assert group_rows(slots).tolist() == [5, 2, 0, 5, 0, 6, 1, 0, 2, 3, 2]
    assert group_rows(np.full(3, -1, np.int32)).tolist() == [0]


def test_splits_cover_in_features_and_shrink_with_more_rows():
    for num_tokens in (1, 16, 64, 256, 4096):
        for in_features in (64, 300, 4096, 14336):
            for config in (default_plan(num_tokens, 48).shrink,
                           ShrinkConfig(block_m=32, block_k=128, target_programs=512,
                                        max_splits=64)):
                num_splits, split_len = shrink_splits(num_tokens, in_features, config)
                assert split_len % config.block_k == 0
                assert (num_splits - 1) * split_len < in_features <= num_splits * split_len
    assert shrink_splits(1, 4096, default_plan(1, 48).shrink)[0] == 16
    assert shrink_splits(4096, 4096, default_plan(4096, 48).shrink)[0] == 1


# a swept plan's shapes: the two kernels' tiles differ, many splits, 8 warps
OTHER_PLAN = LoraPlan(ShrinkConfig(block_m=32, block_k=32, target_programs=512, max_splits=64,
                                   num_warps=8, num_stages=2),
                      ExpandConfig(block_m=16, block_n=128, num_warps=8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens,in_features,kind,plan", [
    (1, 96, "one", None), (5, 1024, "interleaved", None), (37, 200, "runs", None),
    (300, 96, "runs", None), (24, 130, "base", None), (5, 4096, "interleaved", OTHER_PLAN),
    (70, 200, "runs", OTHER_PLAN)])
def test_shrink_and_expand_match_the_references(num_tokens, in_features, kind, plan, dtype):
    gen = torch.Generator().manual_seed(num_tokens + in_features)
    num_slots, width, out_features = 3, 24, 80
    a, b = random_slots(num_slots, width, in_features, out_features, gen, dtype)
    x = torch.randn(num_tokens, in_features, generator=gen).to(DEVICE, dtype)
    token_slots = slot_pattern(kind, num_tokens, num_slots, gen)
    lora_rows = lora_rows_of(token_slots)
    adapter = token_slots >= 0
    y = lora_shrink(x, a, lora_rows, plan and plan.shrink)  # [num_splits, num_tokens, width]
    y_ref = lora_shrink_ref(x, a, token_slots)
    if adapter.any():
        assert rel_err(y.sum(0)[adapter], y_ref[adapter]) < 1e-5
    out = torch.randn(num_tokens, out_features, generator=gen).to(DEVICE, dtype)
    out[~adapter] = float("nan")  # a base row is never read, nor written
    before = out.clone()
    expected = lora_expand_ref(y_ref, b, token_slots, out.clone())
    assert lora_expand(y, b, lora_rows, out, plan and plan.expand) is out
    assert out[~adapter].isnan().all()
    if adapter.any():
        assert rel_err(out[adapter] - before[adapter],
                       expected[adapter] - before[adapter]) < TOLERANCE[dtype]


def test_fused_parts_with_smaller_ranks_add_each_parts_product():
    """Slots laid out as lora_slots.py writes them: part p's A and B blocks at column
    p * max_rank, rank under max_rank, an untargeted part all zeros; the delta of each part's
    rows is x @ A_p^T @ B_p^T (fp64) and nothing in the untargeted part's."""
    gen = torch.Generator().manual_seed(7)
    part_sizes, max_rank, in_features, num_tokens = (48, 16, 16), 8, 64, 12
    ranks = {0: (4, 8), 1: (8, None), 2: (2, 4)}  # slot -> (q rank, k rank or untargeted)
    a = torch.zeros(len(ranks), 3 * max_rank, in_features)
    b = torch.zeros(len(ranks), sum(part_sizes), 3 * max_rank)
    parts = {}
    for slot, (q_rank, k_rank) in ranks.items():
        for p, rank in ((0, q_rank), (1, k_rank), (2, q_rank)):
            if rank is None:
                continue
            lora_a = torch.randn(rank, in_features, generator=gen)
            lora_b = torch.randn(part_sizes[p], rank, generator=gen)
            row, col = sum(part_sizes[:p]), p * max_rank
            a[slot, col:col + rank] = lora_a
            b[slot, row:row + part_sizes[p], col:col + rank] = lora_b
            parts[slot, p] = (lora_a, lora_b)
    x = torch.randn(num_tokens, in_features, generator=gen)
    token_slots = torch.tensor([0, 0, -1, 1, 2, 2, 2, -1, 1, 0, 2, 1], dtype=torch.int32)
    out = torch.zeros(num_tokens, sum(part_sizes))
    lora_rows = lora_rows_of(token_slots.to(DEVICE))
    y = lora_shrink(x.to(DEVICE), a.to(DEVICE), lora_rows)
    got = lora_expand(y, b.to(DEVICE), lora_rows, out.to(DEVICE)).cpu()
    for t, slot in enumerate(token_slots.tolist()):
        for p in range(3):
            start, end = sum(part_sizes[:p]), sum(part_sizes[:p + 1])
            pair = parts.get((slot, p))
            expected = torch.zeros(end - start, dtype=torch.float64) if pair is None else (
                x[t].double() @ pair[0].double().T @ pair[1].double().T)
            torch.testing.assert_close(got[t, start:end].double(), expected, atol=1e-4,
                                       rtol=1e-5)


def test_tiles_past_the_adapter_rows_write_nothing():
    """A captured launch's grid covers the bucket: rows past the step's (padding) and
    every row when n is 0 keep their bits, whatever y's unwritten rows hold."""
    gen = torch.Generator().manual_seed(3)
    a, b = random_slots(2, 16, 64, 32, gen, torch.float32)
    x = torch.randn(40, 64, generator=gen).to(DEVICE)
    for token_slots in ([1, 0, -1] + [-1] * 37, [-1] * 40):
        token_slots = torch.tensor(token_slots, dtype=torch.int32, device=DEVICE)
        lora_rows = lora_rows_of(token_slots)
        y = lora_shrink(x, a, lora_rows)
        y[:, token_slots < 0] = float("nan")  # (unwritten rows: never read)
        out = torch.randn(40, 32, generator=gen).to(DEVICE)
        before = out.clone()
        lora_expand(y, b, lora_rows, out)
        base = token_slots < 0
        assert torch.equal(out[base], before[base])
        assert not out.isnan().any()


def test_bad_shapes_are_refused():
    a = torch.zeros(2, 16, 64, device=DEVICE)
    with pytest.raises(ValueError, match="must be contiguous"):
        lora_shrink(torch.zeros(4, 32, device=DEVICE), a, lora_rows_of(
            torch.zeros(4, dtype=torch.int32, device=DEVICE)))
    with pytest.raises(ValueError, match="do not fit"):
        lora_expand(torch.zeros(1, 4, 16, device=DEVICE), torch.zeros(2, 8, 16, device=DEVICE),
                    torch.zeros(1, dtype=torch.int32, device=DEVICE),
                    torch.zeros(4, 9, device=DEVICE))


# the real projections of Llama-3.1-8B at rank 16 on all seven: (in, parts * rank, out)
SHAPES = {"qkv": (4096, 48, 6144), "o": (4096, 16, 4096), "gate_up": (4096, 32, 28672),
          "down": (14336, 16, 4096)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("num_tokens", [1, 7, 64, 256, 1000, 4096])
@pytest.mark.parametrize("kind", ["interleaved", "runs"])
def test_real_shapes_on_the_gpu(shape, num_tokens, kind):
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
    in_features, width, out_features = SHAPES[shape]
    a, b = random_slots(8, width, in_features, out_features, gen, torch.bfloat16)
    x = torch.randn(num_tokens, in_features, generator=gen, device=DEVICE).bfloat16()
    token_slots = slot_pattern(kind, num_tokens, 8, gen)
    lora_rows = lora_rows_of(token_slots)
    out = torch.randn(num_tokens, out_features, generator=gen, device=DEVICE).bfloat16()
    expected = lora_expand_ref(lora_shrink_ref(x, a, token_slots), b, token_slots, out.clone())
    lora_expand(lora_shrink(x, a, lora_rows), b, lora_rows, out)
    base = token_slots < 0
    assert torch.equal(out[base], expected[base])
    if not base.all():  # (one row of the base model: nothing else to compare)
        assert rel_err(out[~base], expected[~base]) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_capture_serves_any_rows_and_sizes_compile_once():
    """A CUDA graph of both launches over a static lora_rows replays with other rows written
    into it (and none); token counts from 1 to 300 compile each kernel at most twice (the two
    tile shapes), never per count."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    in_features, width, out_features = SHAPES["qkv"]
    a, b = random_slots(4, width, in_features, out_features, gen, torch.bfloat16)
    num_tokens = 64
    x = torch.randn(num_tokens, in_features, generator=gen, device=DEVICE).bfloat16()
    out = torch.zeros(num_tokens, out_features, device=DEVICE, dtype=torch.bfloat16)
    static_rows = torch.zeros(1 + 2 * num_tokens, dtype=torch.int32, device=DEVICE)
    lora_expand(lora_shrink(x, a, static_rows), b, static_rows, out)  # (compile)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        lora_expand(lora_shrink(x, a, static_rows), b, static_rows, out)
    for kind in ("interleaved", "runs", "base"):
        token_slots = slot_pattern(kind, num_tokens, 4, gen)
        grouped = lora_rows_of(token_slots)
        static_rows[:len(grouped)].copy_(grouped)
        out.zero_()
        graph.replay()
        expected = lora_expand_ref(lora_shrink_ref(x, a, token_slots), b, token_slots,
                                   torch.zeros_like(out))
        assert torch.equal(out[token_slots < 0], expected[token_slots < 0])
        if kind != "base":
            assert rel_err(out, expected) < 1e-2
    for kernel in (_shrink_kernel, _expand_kernel):
        kernel.device_caches.clear()
    for n in range(1, 300, 7):
        token_slots = slot_pattern("runs", n, 4, gen)
        rows = lora_rows_of(token_slots)
        lora_expand(lora_shrink(x[:1].expand(n, -1).contiguous(), a, rows), b, rows,
                    torch.zeros(n, out_features, device=DEVICE, dtype=torch.bfloat16))
    for kernel in (_shrink_kernel, _expand_kernel):
        assert sum(len(cache[0]) for cache in kernel.device_caches.values()) <= 2
