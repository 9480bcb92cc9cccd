"""int_gemm (Triton, W4A16 / W8A16 on the packed layout of kernels/int_pack.py) against
F.linear on the plainly dequantized weight; the layout's packer against its unpacker.

On CPU under TRITON_INTERPRET=1 with small shapes, fp32 and fp16 x (the interpreter's tl.dot is
wrong for bf16); bf16, the decode and prefill launches at the real shapes on the GPU (-m gpu)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.int_gemm import (DECODE_MAX_M, IntGemmConfig, decode_config, int_gemm,
                              int_gemm_add_rms_norm, prefill_config, serves_add_rms_norm)
from kernels.rms_norm import rms_norm
from kernels.int_pack import (dequantize, int_gemm_ref, pack, pack_along_k, random_int_weight,
                              unpack_along_k)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONE_PASS = IntGemmConfig(block_m=16, block_n=16, block_kw=16)
SPLIT3 = IntGemmConfig(block_m=16, block_n=32, block_kw=16, split_k=3)
BANDS = IntGemmConfig(block_m=16, block_n=16, block_kw=16, group_m=2)  # 3 row tiles, 2 a band
# the fields interleaved into one dot (the prefill launch's way)
ONE_DOT = IntGemmConfig(block_m=16, block_n=16, block_kw=16, one_dot=True)
ONE_DOT_SPLIT3 = IntGemmConfig(block_m=32, block_n=32, block_kw=16, split_k=3, one_dot=True)
CONFIGS = {"one_pass": ONE_PASS, "split3": SPLIT3, "one_dot": ONE_DOT,
           "one_dot_split3": ONE_DOT_SPLIT3}


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.double() - expected.double()).norm() / expected.double().norm()).item()


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def exact(x: torch.Tensor, weight, bias=None) -> torch.Tensor:
    """x @ the dequantized weight^T in float64."""
    return F.linear(x.double(), dequantize(weight).double(),
                    None if bias is None else bias.double())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("k", [64, 100, 257])
def test_pack_round_trips(bits, k):
    """Every value of every bit width survives packing, K a multiple of a word or not."""
    q = torch.randint(0, 1 << bits, (6, k), generator=gen(k), device=DEVICE)
    packed = pack_along_k(q, bits)
    assert packed.shape == (-(-k // (32 // bits)), 6) and packed.dtype == torch.int32
    assert torch.equal(unpack_along_k(packed, bits, k), q.to(torch.int32))


def test_dequantize_is_the_plain_formula():
    """(q - z) * s per group, in fp32, the columns put back through perm."""
    g = gen(3)
    q = torch.randint(0, 16, (5, 64), generator=g, device=DEVICE)
    zeros = torch.randint(0, 16, (5, 2), generator=g, device=DEVICE)
    scales = torch.rand(5, 2, generator=g, device=DEVICE).half()
    perm = torch.randperm(64, generator=g, device=DEVICE)
    group = torch.arange(64, device=DEVICE) // 32
    sorted_w = (q - zeros[:, group]).float() * scales.float()[:, group]
    expected = torch.empty_like(sorted_w)
    expected[:, perm] = sorted_w
    assert torch.equal(dequantize(pack(q, zeros, scales, 4, 32, perm)), expected)
    symmetric = (q - 8).float() * scales.float()[:, group]
    assert torch.equal(dequantize(pack(q, None, scales, 4, 32)), symmetric)


CASES = [  # (bits, group_size, zero_points, act_order)
    (4, 32, True, False), (4, 64, False, False), (4, 128, True, True), (4, -1, False, False),
    (4, 32, False, True), (8, 32, True, False), (8, 64, False, True), (8, -1, True, False),
    (8, 128, False, False),
]


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("bits,group_size,zero_points,act_order", CASES)
def test_matches_dequantized(config, bits, group_size, zero_points, act_order):
    """4 and 8 bits, groups of 32-128 and channel-wise, zero points or symmetric, act-order;
    odd N (masked columns), K not a whole number of tiles, K split unevenly."""
    g = gen(bits * 1000 + group_size)
    m, n, k = 3, 40, 384
    weight = random_int_weight(n, k, bits, group_size, DEVICE, g, zero_points, act_order)
    x = torch.randn(m, k, generator=g, device=DEVICE)
    out = torch.full((m, n), float("nan"), device=DEVICE)
    assert int_gemm(x, weight, config=config, out=out) is out
    assert not out.isnan().any()
    assert rel_err(out, exact(x, weight)) < 1e-5


@pytest.mark.parametrize("config", [ONE_PASS, ONE_DOT], ids=["per_field", "one_dot"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bits,zero_points,act_order", [(4, True, True), (8, False, False)])
def test_registers_hold_the_dequantized_weights_bit_for_bit(config, dtype, bits, zero_points,
                                                           act_order):
    """x = the identity: each output is one weight times 1, so the kernel's in-register
    weights come out as they are: the dequantized checkpoint's, in x's dtype, bit for bit."""
    weight = random_int_weight(24, 128, bits, 32, DEVICE, gen(bits), zero_points, act_order)
    eye = torch.eye(128, device=DEVICE, dtype=dtype)
    assert torch.equal(int_gemm(eye, weight, config=config), dequantize(weight, dtype).T)


@pytest.mark.parametrize("config", [ONE_PASS, SPLIT3, BANDS, ONE_DOT_SPLIT3],
                         ids=["one_pass", "split3", "bands", "one_dot_split3"])
def test_bias_and_rows_past_a_tile(config):
    """A bias (in the epilogue, or the split reduce), 40 rows over three row tiles."""
    g = gen(7)
    weight = random_int_weight(24, 200, 4, 40, DEVICE, g, zero_points=True)
    x, bias = torch.randn(40, 200, generator=g, device=DEVICE), torch.randn(24, generator=g,
                                                                             device=DEVICE)
    assert rel_err(int_gemm(x, weight, bias, config=config), exact(x, weight, bias)) < 1e-5


@pytest.mark.parametrize("config", [None, ONE_DOT_SPLIT3], ids=["worker", "one_dot_split3"])
def test_fewer_inputs_than_a_tile(config):
    """K = 64 (8 words, half a tile) and one group of 128 padded past K, as --quantization
    int4 packs a tiny model's 64-wide projections."""
    from services.worker.int_weights import quantize_rtn

    g = gen(17)
    plain = torch.randn(8, 64, generator=g, device=DEVICE) * 0.05
    weight = quantize_rtn(plain)
    x = torch.randn(3, 64, generator=g, device=DEVICE)
    assert rel_err(int_gemm(x, weight, config=config), exact(x, weight)) < 1e-5
    assert rel_err(dequantize(weight), plain) < 0.2  # 4 bits of one group


def test_fp16_rounds_as_the_dequantized_weight():
    """fp16 x: the weights are the checkpoint's dequantized fp16 values, fp32 sums, one
    rounding: close to F.linear on the fp16 dequantized weight."""
    g = gen(11)
    weight = random_int_weight(48, 256, 4, 64, DEVICE, g, act_order=True)
    x = torch.randn(5, 256, generator=g, device=DEVICE).half()
    out = int_gemm(x, weight, config=SPLIT3)
    torch.testing.assert_close(int_gemm(x, weight, config=ONE_DOT_SPLIT3), out, rtol=2 ** -9,
                               atol=1e-5)
    assert out.dtype == torch.float16
    # the weights rounded to fp16 as the dequantized checkpoint's, the products summed exactly
    expected = F.linear(x.double(), dequantize(weight, torch.float16).double())
    torch.testing.assert_close(out.double(), expected, rtol=2 ** -9, atol=1e-5)
    assert torch.equal(int_gemm_ref(x, weight), F.linear(
        x.float(), dequantize(weight)).half())


def test_decode_launch_is_batch_invariant():
    """The decode launch: a row's output bitwise the same alone and among up to 16 rows."""
    g = gen(5)
    weight = random_int_weight(40, 256, 4, 32, DEVICE, g)
    x = torch.randn(DECODE_MAX_M, 256, generator=g, device=DEVICE)
    alone = int_gemm(x[5:6].clone(), weight, config=SPLIT3)
    for m in (6, 11, DECODE_MAX_M):
        assert torch.equal(int_gemm(x[:m], weight, config=SPLIT3)[5], alone[0]), m


def test_default_configs():
    """Decode: 16-row tiles, K split where N is narrow; prefill: wider row tiles, no split."""
    assert decode_config(4, 4096, 4096).split_k > 1 and decode_config(4, 4096, 4096).block_m == 16
    assert decode_config(4, 28672, 4096).split_k == 1
    assert prefill_config(4, 4096, 4096, 4096).block_m == 128
    assert all(c.split_k == 1 for c in (prefill_config(8, m, 4096, 4096) for m in (17, 300)))
    g = gen(9)
    weight = random_int_weight(32, 128, 8, -1, DEVICE, g)
    x = torch.randn(20, 128, generator=g, device=DEVICE)  # past 16 rows: the prefill launch
    assert rel_err(int_gemm(x, weight), exact(x, weight)) < 1e-5


@pytest.mark.parametrize("config", [SPLIT3, ONE_DOT_SPLIT3], ids=["split3", "one_dot_split3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_add_rms_norm_in_the_reduce_is_bitwise_the_two_kernels(config, dtype):
    """The residual add and the norm in the split reduce: bitwise int_gemm then rms_norm."""
    g = gen(13)
    weight = random_int_weight(40, 384, 4, 64, DEVICE, g, act_order=True)
    x = torch.randn(5, 384, generator=g, device=DEVICE).to(dtype)
    bias = torch.randn(40, generator=g, device=DEVICE).to(dtype)
    residual = torch.randn(5, 40, generator=g, device=DEVICE).to(dtype)
    norm_weight = (1 + 0.5 * torch.randn(40, generator=g, device=DEVICE)).to(dtype)
    expected, expected_residual = rms_norm(int_gemm(x, weight, bias, config=config),
                                           norm_weight, 1e-5, residual.clone())
    stream = residual.clone()
    normed, returned = int_gemm_add_rms_norm(x, weight, bias, stream, norm_weight, 1e-5,
                                             config=config)
    assert returned is stream and torch.equal(stream, expected_residual)
    assert torch.equal(normed, expected)
    with pytest.raises(ValueError, match="split"):
        int_gemm_add_rms_norm(x, weight, bias, stream, norm_weight, 1e-5, config=ONE_PASS)
    assert not serves_add_rms_norm(5, weight, residual, norm_weight)  # (a CPU weight)


def test_rejects_bad_operands():
    weight = random_int_weight(16, 64, 4, 32, DEVICE, gen(1))
    with pytest.raises(ValueError, match="must be"):
        int_gemm(torch.randn(2, 32, device=DEVICE), weight)
    with pytest.raises(ValueError, match="bias"):
        int_gemm(torch.randn(2, 64, device=DEVICE), weight, torch.randn(8, device=DEVICE))
    with pytest.raises(ValueError, match="multiple"):
        pack(torch.zeros(4, 64, dtype=torch.int32), None, torch.ones(4, 64 // 12 + 1), 4, 12)


# ---- the GPU: bf16 and the real shapes (-m gpu)

LLAMA_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096),
            "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 7, 16, 64, 300])
@pytest.mark.parametrize("bits,group_size,zero_points,act_order",
                         [(4, 128, True, False), (4, 32, False, True), (8, -1, False, False),
                          (8, 64, True, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_matches_torch_on_the_dequantized_weight(m, bits, group_size, zero_points,
                                                     act_order, dtype):
    """The worker's launches (decode to 16 rows, prefill past) on a real 8B shape each,
    against torch's matmul on the dequantized weight in the same dtype."""
    g = gen(m + bits)
    n, k = LLAMA_8B["o_proj"] if m != 7 else LLAMA_8B["down"]
    weight = random_int_weight(n, k, bits, group_size, DEVICE, g, zero_points, act_order)
    x = torch.randn(m, k, generator=g, device=DEVICE).to(dtype)
    out = int_gemm(x, weight)
    expected = F.linear(x, dequantize(weight, dtype))
    assert rel_err(out, exact(x, weight)) < (1e-2 if dtype == torch.bfloat16 else 2e-3)
    assert rel_err(out, exact(x, weight)) <= 1.5 * rel_err(expected, exact(x, weight)) + 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", LLAMA_8B)
def test_gpu_shapes_in_a_cuda_graph(name):
    """Each 8B projection at 1 and 16 rows (decode) and 512 (prefill), captured in a CUDA graph
    and replayed on new inputs: the replay equals an eager call."""
    n, k = LLAMA_8B[name]
    g = gen(len(name))
    weight = random_int_weight(n, k, 4, 128, DEVICE, g)
    for m in (1, 16, 512):
        x = torch.randn(m, k, generator=g, device=DEVICE).bfloat16()
        int_gemm(x, weight)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = int_gemm(x, weight)
        x.copy_(torch.randn(m, k, generator=g, device=DEVICE))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, int_gemm(x, weight)), (name, m)
        assert rel_err(out, exact(x, weight)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", ["o_proj", "down"])
@pytest.mark.parametrize("m", [1, 16])
def test_gpu_add_rms_norm_in_the_reduce(name, m):
    """o_proj and down at decode rows: the worker takes the norm-in-reduce launch, bitwise
    int_gemm then rms_norm in bf16."""
    n, k = LLAMA_8B[name]
    g = gen(m)
    weight = random_int_weight(n, k, 4, 128, DEVICE, g)
    x = torch.randn(m, k, generator=g, device=DEVICE).bfloat16()
    residual = torch.randn(m, n, generator=g, device=DEVICE).bfloat16()
    norm_weight = torch.rand(n, generator=g, device=DEVICE).bfloat16() + 0.5
    assert serves_add_rms_norm(m, weight, residual, norm_weight)
    expected, expected_residual = rms_norm(int_gemm(x, weight), norm_weight, 1e-5,
                                           residual.clone())
    normed, stream = int_gemm_add_rms_norm(x, weight, None, residual.clone(), norm_weight, 1e-5)
    assert torch.equal(stream, expected_residual) and torch.equal(normed, expected)
