"""The MoE kernels (kernels/fused_moe.py, moe_routing.py, moe_configs.py): fused_moe_ref against
a per-token loop, the Triton path against fused_moe_ref, routing's tie rule and padded rows,
the align step's invariants, batch invariance, the config table.

On CPU under TRITON_INTERPRET=1 (tests/conftest.py), small shapes; the real layer shapes and
CUDA graphs on the GPU (-m gpu)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from kernels import moe_configs
from kernels.fp8 import quantize_per_channel
from kernels.fused_moe import fused_moe, fused_moe_ref, fused_moe_triton
from kernels.moe_configs import MoeConfig, MoePlan, config_source, plan_for
from kernels.moe_routing import align, max_blocks, route, route_ref, route_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = MoeConfig(block_m=16, block_n=16, block_k=32)
PLANS = {"m16": MoePlan(SMALL, SMALL),
         "m32_grouped": MoePlan(MoeConfig(32, 32, 64, group_m=4), MoeConfig(32, 16, 16))}


# fp32: the same sums in another order; fp16: a last-bit flip of h moves the rest; bf16 under
# the interpreter, which rounds fp32 to bf16 toward zero (numpy has no bf16): each of the
# five roundings shrinks a value by up to 2^-8 (the GPU tests hold bf16 to 1e-2)
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3,
             torch.bfloat16: 1e-2 if DEVICE == "cuda" else 4e-2}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def layer(num_experts, hidden, inter, gen, dtype=torch.float32, device=DEVICE):
    """(w13 [E, 2 * inter, hidden], w2 [E, hidden, inter]) scaled to keep activations O(1)."""
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=gen, device=device) / hidden ** 0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=gen, device=device) / inter ** 0.5
    return w13.to(dtype), w2.to(dtype)


def routed(num_tokens, num_experts, top_k, gen, device=DEVICE):
    logits = torch.randn(num_tokens, num_experts, generator=gen, device=device)
    return route(logits, top_k, renormalize=True)


def naive_moe(x, w13, w2, weights, ids):
    """One token and one k at a time, in fp64."""
    num_experts, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e == num_experts:
                continue
            gate_up = w13[e].double() @ x[t].double()
            h = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(weights[t, k]) * (w2[e].double() @ h)
    return out


@pytest.mark.parametrize("num_tokens,num_experts,top_k", [(1, 8, 2), (17, 8, 1), (40, 16, 8)])
def test_ref_matches_naive_loop(num_tokens, num_experts, top_k):
    gen = torch.Generator(device="cpu").manual_seed(num_tokens)
    w13, w2 = layer(num_experts, 64, 32, gen, device="cpu")
    x = torch.randn(num_tokens, 64, generator=gen)
    weights, ids = routed(num_tokens, num_experts, top_k, gen, device="cpu")
    ids[0, -1] = num_experts  # a sentinel pair: nothing
    out = fused_moe_ref(x, w13, w2, weights, ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), naive_moe(x, w13, w2, weights, ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_tokens", [1, 3, 17, 40])
@pytest.mark.parametrize("num_experts,top_k", [(8, 1), (8, 2), (16, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_matches_ref(num_tokens, num_experts, top_k, dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens * num_experts + top_k)
    w13, w2 = layer(num_experts, 64, 32, gen, dtype)
    x = torch.randn(num_tokens, 64, generator=gen, device=DEVICE).to(dtype)
    weights, ids = routed(num_tokens, num_experts, top_k, gen)
    plan = PLANS["m16" if num_tokens < 17 else "m32_grouped"]
    out = fused_moe_triton(x, w13, w2, weights, ids, plan=plan)
    assert out.dtype == dtype and not out.isnan().any()
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids)) < TOLERANCE[dtype]


def quantized_layer(w13, w2):
    """Per-output-channel FP8 of each expert (kernels/fp8.py's quantizer)."""
    q13, s13 = zip(*(quantize_per_channel(w) for w in w13))
    q2, s2 = zip(*(quantize_per_channel(w) for w in w2))
    return torch.stack(q13), torch.stack(s13), torch.stack(q2), torch.stack(s2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [3, 17])
def test_fp8_weights(dtype, num_tokens):
    """FP8 weights with scales: dequantized in the kernel, x stays in its dtype."""
    gen = torch.Generator(device=DEVICE).manual_seed(7 + num_tokens)
    w13, w2, = layer(8, 64, 32, gen)
    q13, s13, q2, s2 = quantized_layer(w13, w2)
    x = torch.randn(num_tokens, 64, generator=gen, device=DEVICE).to(dtype)
    weights, ids = routed(num_tokens, 8, 2, gen)
    out = fused_moe_triton(x, q13, q2, weights, ids, s13, s2, plan=PLANS["m16"])
    ref = fused_moe_ref(x, q13, q2, weights, ids, s13, s2)
    assert out.dtype == dtype
    assert rel_err(out, ref) < TOLERANCE[dtype]
    # and close to the unquantized layer (e4m3: ~3 mantissa bits)
    assert rel_err(ref.float(), fused_moe_ref(x.float(), w13, w2, weights, ids)) < 0.1


ROUTERS = {"torch": route_ref, "triton": route_triton}


@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_route_tie_goes_to_the_lower_id_alone_and_in_a_batch(router):
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    logits = torch.randn(6, 16, generator=gen, device=DEVICE)
    logits[2, 11] = logits[2, 4] = logits[2].max() + 1.0  # an exact tie for first place
    logits[2, 9] = logits[2, 13] = logits[2, 4] - 0.5  # and for third
    weights, ids = router(logits, 4, renormalize=False)
    assert ids[2].tolist()[:4] == [4, 11, 9, 13]
    assert weights[2, 0] == weights[2, 1] and weights[2, 2] == weights[2, 3]
    alone_weights, alone_ids = router(logits[2:3].clone(), 4, renormalize=False)
    assert torch.equal(alone_ids[0], ids[2]) and torch.equal(alone_weights[0], weights[2])
    bf16_logits = torch.zeros(1, 8, dtype=torch.bfloat16, device=DEVICE)  # all tied
    assert router(bf16_logits, 3, renormalize=True)[1].tolist() == [[0, 1, 2]]


@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
@pytest.mark.parametrize("renormalize", [False, True])
def test_route_matches_softmax_topk(router, renormalize):
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    # distinct logits (bf16 ones tie often): a shuffle of 16 levels a row, and fp32 noise
    levels = torch.stack([torch.randperm(16, generator=gen, device=DEVICE) for _ in range(40)])
    logits = (levels * 0.37).to(torch.bfloat16)
    for logits in (logits, torch.randn(40, 16, generator=gen, device=DEVICE)):
        check_softmax_topk(router, logits, renormalize)


def check_softmax_topk(router, logits, renormalize):
    weights, ids = router(logits, 8, renormalize)
    probs = torch.softmax(logits.float(), dim=-1)
    expected_weights, expected_ids = probs.topk(8, dim=-1)
    if renormalize:
        expected_weights = expected_weights / expected_weights.sum(-1, keepdim=True)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int32
    assert torch.equal(ids.long(), expected_ids)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("router", ROUTERS.values(), ids=ROUTERS.keys())
def test_route_invalid_rows_get_the_sentinel(router):
    gen = torch.Generator(device=DEVICE).manual_seed(5)
    logits = torch.randn(5, 8, generator=gen, device=DEVICE)
    valid = torch.tensor([True, False, True, True, False], device=DEVICE)
    weights, ids = router(logits, 2, True, valid)
    assert (ids[~valid] == 8).all() and (weights[~valid] == 0).all()
    all_weights, all_ids = router(logits, 2, True)
    assert torch.equal(ids[valid], all_ids[valid]) and torch.equal(weights[valid],
                                                                   all_weights[valid])


MOES = {"ref": fused_moe_ref,
        "triton": lambda *args: fused_moe_triton(*args, plan=PLANS["m16"])}


@pytest.mark.parametrize("moe", MOES.values(), ids=MOES.keys())
def test_padded_rows_contribute_nothing(moe):
    """A graph's padded rows (invalid: routed nowhere) come out 0 and leave the valid rows'
    result as it is without them."""
    gen = torch.Generator(device=DEVICE).manual_seed(6)
    w13, w2 = layer(8, 64, 32, gen)
    x = torch.randn(7, 64, generator=gen, device=DEVICE)
    logits = torch.randn(7, 8, generator=gen, device=DEVICE)
    valid = torch.tensor([True] * 4 + [False] * 3, device=DEVICE)
    weights, ids = route(logits, 2, True, valid)
    out = moe(x, w13, w2, weights, ids)
    assert (out[4:] == 0).all()
    valid_weights, valid_ids = route(logits[:4], 2, True)
    assert torch.equal(out[:4], moe(x[:4], w13, w2, valid_weights, valid_ids))


@pytest.mark.parametrize("num_tokens,num_experts,top_k,block_m",
                         [(1, 8, 8, 16), (3, 16, 2, 16), (40, 8, 2, 16), (40, 16, 8, 32),
                          (300, 8, 8, 16)])
def test_align_groups_every_pair_once(num_tokens, num_experts, top_k, block_m):
    gen = torch.Generator(device=DEVICE).manual_seed(num_tokens + block_m)
    ids = routed(num_tokens, num_experts, top_k, gen)[1]
    ids[::3, 0] = num_experts  # sentinels: no slot
    num_pairs = ids.numel()
    sorted_pair_ids, block_expert_ids = align(ids, num_experts, block_m)
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    assert sorted_pair_ids.shape == (num_blocks * block_m,)
    assert block_expert_ids.shape == (num_blocks,)
    flat = ids.reshape(-1).long().cpu()
    slots, blocks = sorted_pair_ids.long().cpu(), block_expert_ids.long().cpu()
    real = slots[slots < num_pairs]
    assert sorted(real.tolist()) == [p for p in range(num_pairs) if flat[p] < num_experts]
    assert ((slots == num_pairs) | (slots < num_pairs)).all()  # padding: exactly num_pairs
    used = blocks >= 0
    assert (blocks[~used] == -1).all() and not used[used.sum():].any()  # -1 only at the end
    for b in range(num_blocks):
        block = slots[b * block_m:(b + 1) * block_m]
        if not used[b]:
            assert (block == num_pairs).all()
            continue
        pairs = block[block < num_pairs]
        assert len(pairs) > 0 and (flat[pairs] == blocks[b]).all()  # one expert per block
    # each expert's blocks in a row, no more of them than its pairs need
    counts = torch.bincount(flat[flat < num_experts], minlength=num_experts)
    assert torch.equal(torch.bincount(blocks[used], minlength=num_experts),
                       (counts + block_m - 1) // block_m)
    assert (blocks[used].diff() >= 0).all()


def test_batch_invariant_row_alone_equals_row_in_batch():
    """Under batch_invariant a row's output is bitwise the same alone and in batches of any
    size (one plan whatever the row count; each row summed on its own)."""
    gen = torch.Generator(device=DEVICE).manual_seed(8)
    w13, w2 = layer(8, 64, 32, gen)
    x = torch.randn(40, 64, generator=gen, device=DEVICE)
    weights, ids = routed(40, 8, 2, gen)
    batch = fused_moe_triton(x, w13, w2, weights, ids, batch_invariant=True)
    for row in (0, 5, 39):
        alone = fused_moe_triton(x[row:row + 1].clone(), w13, w2, weights[row:row + 1],
                                 ids[row:row + 1], batch_invariant=True)
        assert torch.equal(alone[0], batch[row]), row
    middle = fused_moe_triton(x[3:20], w13, w2, weights[3:20], ids[3:20], batch_invariant=True)
    assert torch.equal(middle, batch[3:20])


def test_fused_moe_dispatches_cpu_tensors_to_the_ref():
    gen = torch.Generator(device="cpu").manual_seed(9)
    w13, w2 = layer(8, 64, 32, gen, device="cpu")
    x = torch.randn(3, 64, generator=gen)
    weights, ids = routed(3, 8, 2, gen, device="cpu")
    assert torch.equal(fused_moe(x, w13, w2, weights, ids), fused_moe_ref(x, w13, w2, weights, ids))
    with pytest.raises(ValueError, match="do not match"):
        fused_moe(x[:, :32], w13, w2, weights, ids)
    with pytest.raises(ValueError, match="scales"):
        fused_moe(x, w13.to(torch.float8_e4m3fn), w2, weights, ids)


def test_plans_by_shape_and_bucket(tmp_path):
    """A tuned shape's plan by the smallest bucket holding the rows (past the largest, the
    largest), its invariant plan under batch invariance; an untuned shape the default."""
    small, large = MoePlan(SMALL, SMALL), PLANS["m32_grouped"]
    key = moe_configs.shape_key(8, 32, 64, torch.bfloat16)
    path = tmp_path / "moe.json"
    path.write_text(json.dumps({"device": "H200", "triton": "3.6.0", "shapes": {key: {
        "1": small.to_json(), "16": large.to_json(), "invariant": small.to_json()}}}))
    table = moe_configs.load_table(path)
    assert plan_for(8, 2, 32, 64, torch.bfloat16, 1, table) == small
    assert plan_for(8, 2, 32, 64, torch.bfloat16, 2, table) == large
    assert plan_for(8, 2, 32, 64, torch.bfloat16, 5000, table) == large
    assert plan_for(8, 2, 32, 64, torch.bfloat16, None, table) == small
    assert config_source(8, 32, 64, torch.bfloat16, table) == "tuned on H200, triton 3.6.0"
    assert config_source(8, 32, 64, torch.float8_e4m3fn, table) == "default (untuned)"
    untuned = plan_for(8, 2, 32, 64, torch.float8_e4m3fn, 7, table)
    assert untuned == moe_configs.default_plan(8, 2, 7)
    # batch invariance: the default is one plan whatever the rows
    assert {moe_configs.default_plan(8, 2, None)} == {
        plan_for(8, 2, 32, 64, torch.float32, None, table) for _ in range(2)}
    with pytest.raises(ValueError, match="block_m"):
        MoePlan(SMALL, MoeConfig(32, 16, 16))


QWEN3_30B_A3B = (128, 8, 2048, 768)  # experts, top_k, hidden, inter
MIXTRAL_8X7B = (8, 2, 4096, 14336)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [QWEN3_30B_A3B, MIXTRAL_8X7B], ids=["qwen3_30b", "mixtral"])
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens", [1, 8, 200])
def test_gpu_real_shapes(shape, fp8, num_tokens):
    num_experts, top_k, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13, w2 = layer(num_experts, hidden, inter, gen, torch.bfloat16, "cuda")
    scales = (None, None)
    if fp8:
        w13, s13, w2, s2 = quantized_layer(w13, w2)
        scales = (s13, s2)
    x = torch.randn(num_tokens, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    weights, ids = routed(num_tokens, num_experts, top_k, gen, device="cuda")
    out = fused_moe(x, w13, w2, weights, ids, *scales)
    assert rel_err(out, fused_moe_ref(x, w13, w2, weights, ids, *scales)) < 1e-2
    alone = fused_moe(x[:1].clone(), w13, w2, weights[:1], ids[:1], *scales,
                      batch_invariant=True)
    batch = fused_moe(x, w13, w2, weights, ids, *scales, batch_invariant=True)
    assert torch.equal(alone[0], batch[0])


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """route + fused_moe capture into a CUDA graph (no host sync) and replay on new inputs,
    bitwise as eager."""
    num_experts, top_k, hidden, inter = QWEN3_30B_A3B
    gen = torch.Generator(device="cuda").manual_seed(10)
    w13, w2 = layer(num_experts, hidden, inter, gen, torch.bfloat16, "cuda")
    x = torch.randn(4, hidden, generator=gen, device="cuda").to(torch.bfloat16)
    logits = torch.randn(4, num_experts, generator=gen, device="cuda")
    valid = torch.tensor([True, True, True, False], device="cuda")

    def step():
        weights, ids = route(logits, top_k, True, valid)
        return fused_moe(x, w13, w2, weights, ids)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for _ in range(3):
        x.copy_(torch.randn(4, hidden, generator=gen, device="cuda"))
        logits.copy_(torch.randn(4, num_experts, generator=gen, device="cuda"))
        graph.replay()
        assert torch.equal(out, step()) and (out[3] == 0).all()


def test_shipped_table_parses_and_names_its_tuning():
    """kernels/moe_configs.json (the sweep's output): every entry a valid plan, every bucket
    and the invariant plan present, and its device and Triton version recorded."""
    table = moe_configs.load_table()
    assert table["device"] and table["triton"]
    for key in (moe_configs.shape_key(*shape, dtype) for shape in ((128, 768, 2048),
                (8, 14336, 4096)) for dtype in (torch.bfloat16, torch.float8_e4m3fn)):
        entry = table["shapes"][key]
        assert set(entry) == {str(b) for b in moe_configs.BUCKETS} | {moe_configs.INVARIANT}
        assert all(isinstance(plan, MoePlan) for plan in entry.values())
    assert config_source(128, 768, 2048, torch.bfloat16).startswith("tuned on NVIDIA H200")
