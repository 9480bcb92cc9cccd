"""rms_norm_skinny_gemm (the RMSNorm fused into the skinny GEMM after it) against the norm then
the GEMM, and the worker's routing to it (ops.rms_norm_linear).

On CPU under TRITON_INTERPRET=1 in fp32 and fp16 (the interpreter's tl.dot is wrong for bf16);
bf16, fp16 and the Llama-3.1-8B shapes on the GPU (-m gpu)."""

from __future__ import annotations

import pytest
import torch

from kernels import skinny_gemm as skinny_module
from kernels.rms_norm import rms_norm
from kernels.skinny_gemm import (MAX_M, SkinnyConfig, rms_norm_skinny_gemm,
                                 rms_norm_skinny_gemm_ref, serves_norm, skinny_gemm,
                                 skinny_gemm_silu_and_mul)
from services.worker import ops

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIGS = {"one_pass": SkinnyConfig(block_n=16, block_k=32),
           "split3": SkinnyConfig(block_n=16, block_k=32, split_k=3)}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def randn(*shape, gen, device=DEVICE, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


def operands(m: int, n: int, k: int, seed: int, device=DEVICE, dtype=torch.float32):
    """x, residual, norm weight, projection weight, bias; the stream's scale (tens) in x."""
    gen = torch.Generator(device=device).manual_seed(seed)
    x = 8.0 * randn(m, k, gen=gen, device=device, dtype=dtype)
    residual = randn(m, k, gen=gen, device=device, dtype=dtype)
    norm_weight = (1.0 + 0.5 * randn(k, gen=gen, device=device)).to(dtype)
    weight = randn(n, k, gen=gen, device=device, dtype=dtype) / k ** 0.5
    bias = randn(n, gen=gen, device=device, dtype=dtype)
    return x, residual, norm_weight, weight, bias


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (3, 40, 96), (16, 37, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_matches_norm_then_gemm(config, m, n, k, with_residual):
    """Odd N, K not a multiple of BLOCK_K, splits: the same as rms_norm then the GEMM; x and
    the residual untouched, x + residual returned."""
    x, residual, norm_weight, weight, bias = operands(m, n, k, seed=m * n + k)
    residual = residual if with_residual else None
    inputs = [t.clone() for t in (x, residual) if t is not None]
    out, total = rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, bias, residual,
                                      config=config)
    expected, expected_total = rms_norm_skinny_gemm_ref(x, norm_weight, 1e-5, weight, bias,
                                                        residual)
    assert out.shape == (m, n) and not out.isnan().any()
    assert rel_err(out, expected) < 1e-5
    assert torch.equal(total, expected_total)
    assert total is x if residual is None else total.data_ptr() != residual.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(inputs, [t for t in (x, residual)
                                                          if t is not None]))


@pytest.mark.parametrize("with_residual", [False, True])
def test_rows_longer_than_one_pass(monkeypatch, with_residual):
    """Rows over NORM_BLOCK (shrunk here): the first pass loops over the row."""
    monkeypatch.setattr(skinny_module, "NORM_BLOCK", 32)
    x, residual, norm_weight, weight, _ = operands(5, 24, 200, seed=3)
    residual = residual if with_residual else None
    out, total = rms_norm_skinny_gemm(x, norm_weight, 1e-6, weight, None, residual,
                                      config=CONFIGS["one_pass"])
    expected, expected_total = rms_norm_skinny_gemm_ref(x, norm_weight, 1e-6, weight, None,
                                                        residual)
    assert rel_err(out, expected) < 1e-5 and torch.equal(total, expected_total)


@pytest.mark.parametrize("m,d,k", [(1, 32, 128), (4, 40, 96)])
def test_silu_and_mul(m, d, k):
    x, residual, norm_weight, weight, bias = operands(m, 2 * d, k, seed=d + k)
    gated = SkinnyConfig(block_n=16, block_k=32)
    out, total = rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, bias, residual,
                                      silu_and_mul=True, config=gated)
    expected, expected_total = rms_norm_skinny_gemm_ref(x, norm_weight, 1e-5, weight, bias,
                                                        residual, silu_and_mul=True)
    assert out.shape == (m, d) and rel_err(out, expected) < 1e-5
    assert torch.equal(total, expected_total)


@pytest.mark.parametrize("silu", [False, True])
def test_batch_invariant(silu):
    """A row's output and sum are bitwise the same alone and in batches of every size."""
    x, residual, norm_weight, weight, bias = operands(MAX_M, 48, 200, seed=4)
    config = SkinnyConfig(block_n=16, block_k=64)

    def run(rows):
        return rms_norm_skinny_gemm(x[rows].contiguous(), norm_weight, 1e-5, weight, bias,
                                    residual[rows].contiguous(), silu_and_mul=silu,
                                    config=config)

    alone, alone_total = run(slice(5, 6))
    for m in (6, 9, MAX_M):
        out, total = run(slice(0, m))
        assert torch.equal(out[5], alone[0]) and torch.equal(total[5], alone_total[0]), m


def test_fp16_is_the_two_kernels():
    """fp16: the norm rounded as kernels/rms_norm.py rounds it (to about an ulp: only the sum
    of squares' order differs), then the GEMM."""
    x, residual, norm_weight, weight, bias = operands(3, 40, 256, seed=5, dtype=torch.float16)
    out, total = rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, bias, residual,
                                      config=CONFIGS["one_pass"])
    assert out.dtype == total.dtype == torch.float16
    normed, expected_total = rms_norm(x, norm_weight, 1e-5, residual.clone())
    assert torch.equal(total, expected_total)
    expected = skinny_gemm(normed, weight, bias, config=CONFIGS["one_pass"])
    torch.testing.assert_close(out, expected, rtol=2e-3, atol=2e-3)


def test_errors():
    x, residual, norm_weight, weight, _ = operands(2, 24, 64, seed=6)
    with pytest.raises(ValueError, match="norm_weight"):
        rms_norm_skinny_gemm(x, norm_weight[:32], 1e-5, weight)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, residual=residual[:1])
    with pytest.raises(ValueError, match="norm_weight is"):
        rms_norm_skinny_gemm(x, norm_weight.half(), 1e-5, weight)
    with pytest.raises(ValueError, match="even"):
        rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight[:23], silu_and_mul=True,
                             config=CONFIGS["one_pass"])


def test_serves_norm_only_where_the_gemm_serves(monkeypatch):
    """The fused path: CUDA, the skinny GEMM's shapes and rows, at most NORM_MAX_M rows, one
    dtype throughout; anything else takes the two ops."""
    monkeypatch.setitem(skinny_module.CONFIGS, (24, 64), SkinnyConfig(16, 64, max_m=16))
    x, residual, norm_weight, weight, _ = [t.to(torch.bfloat16) for t in operands(8, 24, 64, 7,
                                                                                 device="cpu")]
    assert not serves_norm(x[:1], residual[:1], norm_weight, weight)  # CPU
    if not torch.cuda.is_available():
        return
    x, residual, norm_weight, weight = (t.cuda() for t in (x, residual, norm_weight, weight))
    bound = skinny_module.NORM_MAX_M
    assert serves_norm(x[:1], residual[:1], norm_weight, weight)
    assert serves_norm(x[:bound], None, norm_weight, weight)
    assert not serves_norm(x[:bound + 1], residual[:bound + 1], norm_weight, weight)
    assert not serves_norm(x[:1], residual[:1], norm_weight.float(), weight)
    assert not serves_norm(x[:1], residual[:1].half(), norm_weight, weight)
    assert not serves_norm(x[:1], residual[:1], norm_weight, weight, silu_and_mul=True)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_ops_routes_to_the_fusion_and_falls_back(monkeypatch, with_residual, silu):
    """ops.rms_norm_linear: the two ops where the fusion does not serve (here the CPU), the
    fused launch where it does (forced here), the same result both ways."""
    x, residual, norm_weight, weight, bias = operands(3, 48, 64, seed=8)
    residual = residual if with_residual else None
    two_ops, two_ops_total = ops.rms_norm_linear(
        x, None if residual is None else residual.clone(), norm_weight, 1e-5, weight, bias,
        silu_and_mul=silu)
    monkeypatch.setattr(skinny_module, "serves_norm", lambda *args: True)
    fused, fused_total = ops.rms_norm_linear(x, residual, norm_weight, 1e-5, weight, bias,
                                             silu_and_mul=silu)
    assert rel_err(fused, two_ops) < 1e-5 and torch.equal(fused_total, two_ops_total)
    assert (fused_total is x) == (residual is None)


@torch.inference_mode()
def test_the_models_decode_step_with_the_fusion_forced(monkeypatch):
    """A tiny Llama's decode step of 3 sequences, every norm fused into its projection: the
    logits of the unfused step (to fp32 sums' order), the same greedy tokens."""
    from tests.services.worker.test_cuda_graphs import _cache, _model
    from services.worker.runner import SequenceChunk, build_step_inputs

    model = _model("llama")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 4, 11)]
    tables = [[3, 7, 1], [12], [5, 0, 20]]
    results = []
    for fused in (False, True):
        if fused:
            monkeypatch.setattr(skinny_module, "serves_norm", lambda x, *args: x.shape[0] <= 4)
        model.bind_kv_cache(_cache(model))
        for step in ([(s, 0, len(seq) - 1) for s, seq in enumerate(seqs)],  # prompts
                     [(s, len(seq) - 1, len(seq)) for s, seq in enumerate(seqs)]):  # decodes
            chunks = [SequenceChunk(token_ids=seqs[s][start:end], start=start,
                                    block_table=tables[s], sample=True)
                      for s, start, end in step]
            logits = model(*build_step_inputs(chunks, 4, torch.device("cpu")))
        results.append(logits)
    unfused, fused = results
    assert rel_err(fused, unfused) < 1e-5
    assert torch.equal(fused.argmax(-1), unfused.argmax(-1))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("silu", [False, True], ids=["qkv", "gate_up"])
def test_gpu_real_shapes(dtype, silu):
    """Llama-3.1-8B's qkv and gate_up (served, so the table's configs): x + residual bitwise
    the norm kernel's, the output the norm kernel then the GEMM's but for the few elements
    whose norm rounds the other way (the sum of squares' order), batch invariant at every M."""
    n = 28672 if silu else 6144
    x, residual, norm_weight, weight, bias = operands(MAX_M, n, 4096, seed=9, device="cuda",
                                                      dtype=dtype)
    bias = None
    assert serves_norm(x[:1], residual[:1], norm_weight, weight, silu_and_mul=silu)
    out, total = rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, bias, residual,
                                      silu_and_mul=silu)
    normed, expected_total = rms_norm(x, norm_weight, 1e-5, residual.clone())
    assert torch.equal(total, expected_total)
    expected = (skinny_gemm_silu_and_mul if silu else skinny_gemm)(normed, weight, bias)
    assert rel_err(out, expected) < 2e-3
    assert (out != expected).float().mean().item() < 0.1
    exact, _ = rms_norm_skinny_gemm_ref(x.double(), norm_weight.double(), 1e-5,
                                        weight.double(), None, residual.double(), silu)
    assert rel_err(out, exact) < 1e-2  # bf16 roundings of the norm and the output
    for m in (1, 2, 3, 4, 8):
        part, part_total = rms_norm_skinny_gemm(x[:m], norm_weight, 1e-5, weight, bias,
                                                residual[:m], silu_and_mul=silu)
        assert torch.equal(part, out[:m]) and torch.equal(part_total, total[:m]), m


@pytest.mark.gpu
@gpu
def test_gpu_without_residual_and_fp32():
    """The first layer's norm (no residual) in bf16; fp32 (the worker's fp32 tests, forced)
    in full precision."""
    x, _, norm_weight, weight, bias = operands(2, 6144, 4096, seed=10, device="cuda",
                                               dtype=torch.bfloat16)
    out, total = rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, bias)
    assert total is x
    expected = skinny_gemm(rms_norm(x, norm_weight, 1e-5), weight, bias)
    assert rel_err(out, expected) < 2e-3
    x, residual, norm_weight, weight, bias = operands(3, 1000, 1000, seed=11, device="cuda")
    out, total = rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, bias, residual)
    expected, expected_total = rms_norm_skinny_gemm_ref(x, norm_weight, 1e-5, weight, bias,
                                                        residual)
    assert rel_err(out, expected) < 5e-6 and torch.equal(total, expected_total)


@pytest.mark.gpu
@gpu
def test_gpu_cuda_graph_capture():
    """Captured (x and the residual written by kernels just before) and replayed on new
    inputs: bitwise as eager."""
    x, residual, norm_weight, weight, _ = operands(1, 28672, 4096, seed=12, device="cuda",
                                                   dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up: compile outside the capture
        rms_norm_skinny_gemm(x, norm_weight, 1e-5, weight, None, residual, silu_and_mul=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, total = rms_norm_skinny_gemm(x * 2.0, norm_weight, 1e-5, weight, None,
                                          residual + 1.0, silu_and_mul=True)
    gen = torch.Generator(device="cuda").manual_seed(13)
    for _ in range(3):
        x.copy_(randn(*x.shape, gen=gen, device="cuda", dtype=x.dtype))
        graph.replay()
        expected, expected_total = rms_norm_skinny_gemm(x * 2.0, norm_weight, 1e-5, weight,
                                                        None, residual + 1.0,
                                                        silu_and_mul=True)
        assert torch.equal(out, expected) and torch.equal(total, expected_total)
