"""Programmatic dependent launch (kernels/pdl.py): the decode kernels with ``PDL`` on give
bitwise what they give with it off, and wait before touching what an earlier kernel wrote.

- CPU, TRITON_INTERPRET=1: the interpreter has no griddepcontrol, so the on path runs with the
  wait and the trigger swapped for recorders: the same results as off, every program of every
  launch waits once and then triggers (spare programs that return early included), and every
  launch passes the constexpr and Triton's ``launch_pdl`` together.
- compiled for sm_90 without a GPU (tests/kernels/pdl_check.py in a subprocess, no
  interpreter): the wait is at each kernel's top level with the trigger after it; nothing is
  stored before it (TTIR, PTX, SASS); only the skinny GEMM loads before it, and only from its
  weights. Off, no instruction of either kind.
- GPU (-m gpu): bf16 at the Llama-3.1-8B decode shapes, each op alone and a CUDA graph of
  several decode layers' kernels replayed many times, bitwise against PDL off.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import (activation, kv_cache, lora, lora_delta, paged_attention, pdl, rms_norm, rotary,
                     skinny_gemm)
from kernels.lora_configs import LoraPlan, default_plan
from kernels.paged_attention_ref import allocate_kv_cache
from kernels.rotary import build_cos_sin_cache
from kernels.skinny_gemm import SkinnyConfig

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[2]
DOT = SkinnyConfig(block_n=16, block_k=32)
SPLIT3 = SkinnyConfig(block_n=16, block_k=32, split_k=3)
WIDE_SPLIT2 = SkinnyConfig(block_n=32, block_k=16, split_k=2)
CONVERTED = {"_skinny_gemm_kernel", "_reduce_splits_kernel", "_reduce_splits_add_rms_norm_kernel",
             "_rms_norm_kernel", "_rotary_write_kv_cache_kernel", "_write_kv_cache_kernel",
             "_apply_rotary_kernel", "_silu_and_mul_kernel", "_paged_attention_kernel",
             "_combine_segments_kernel", "_all_reduce_add_rms_norm_kernel", "_shrink_kernel",
             "_expand_kernel", "_expand_silu_kernel"}


# the on path runs with the instructions recorded: only the interpreter can call Python there
interpreted = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                 reason="needs TRITON_INTERPRET=1")


def randn(*shape, gen, dtype=torch.float32, device=DEVICE) -> torch.Tensor:
    return torch.randn(*shape, generator=gen, device=device).to(dtype)


# ---------------------------------------------------------------------------------------------
# CPU, under the interpreter
# ---------------------------------------------------------------------------------------------

class Recorded:
    def __init__(self) -> None:
        self.events: list[str] = []  # "wait" / "trigger", in program order
        self.launches: list[tuple] = []  # (kernel, programs, PDL, launch_pdl)


def interpret_pdl_on(monkeypatch) -> Recorded:
    """PDL on under the interpreter: the griddepcontrol instructions recorded, every launch's
    kernel, grid and PDL arguments too."""
    from triton.runtime.interpreter import InterpretedFunction

    record = Recorded()
    monkeypatch.setattr(pdl, "PDL", True)
    monkeypatch.setattr(pdl, "gdc_wait", lambda: record.events.append("wait"))
    monkeypatch.setattr(pdl, "gdc_launch_dependents", lambda: record.events.append("trigger"))
    original = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        record.launches.append((self.fn.__name__, math.prod(grid), kwargs.get("PDL"),
                                kwargs.get("launch_pdl")))
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    return record


def assert_on_equals_off(monkeypatch, op) -> Recorded:
    """op() builds its inputs afresh (seeded) and returns the tensors to compare (outputs and
    anything written in place): with PDL on they equal the off run's bitwise, and every
    program waited once, then triggered."""
    off = op()
    with monkeypatch.context() as patch:
        record = interpret_pdl_on(patch)
        on = op()
    for got, expected in zip(on, off, strict=True):
        assert torch.equal(got.nan_to_num(7.0), expected.nan_to_num(7.0))
        assert torch.equal(got.isnan(), expected.isnan())
    assert record.launches and all(launch[2] is True and launch[3] is True
                                   for launch in record.launches), record.launches
    programs = sum(launch[1] for launch in record.launches)
    assert record.events == ["wait", "trigger"] * programs
    return record


def test_launch_options_follow_the_device_unless_forced(monkeypatch):
    assert pdl.PDL is None  # the device decides
    supported = torch.cuda.is_available() and \
        torch.cuda.get_device_capability() >= pdl.MIN_CAPABILITY
    assert pdl.launch_options() == {"PDL": supported, "launch_pdl": supported}
    for forced in (True, False):
        monkeypatch.setattr(pdl, "PDL", forced)
        assert pdl.launch_options() == {"PDL": forced, "launch_pdl": forced}


def test_a_pre_hopper_gpu_launches_without_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    for capability, expected in (((8, 0), False), ((8, 9), False), ((9, 0), True),
                                 ((10, 0), True)):
        pdl.device_supports_pdl.cache_clear()
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
        assert pdl.enabled() is expected
    pdl.device_supports_pdl.cache_clear()


@interpreted
def test_off_never_reaches_the_instructions(monkeypatch):
    """Off, the kernels never call the griddepcontrol functions (the interpreter could not run
    them): the real ones stay in place and the launch runs."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    x, weight = randn(2, 64, gen=gen), randn(40, 64, gen=gen)
    out = skinny_gemm.skinny_gemm(x, weight, config=SPLIT3)
    assert torch.allclose(out, x @ weight.T, rtol=1e-5, atol=1e-5)


@interpreted
@pytest.mark.parametrize("config", [DOT, SPLIT3, WIDE_SPLIT2], ids=["one_pass", "split3",
                                                                   "wide_split2"])
@pytest.mark.parametrize("m,n,k,with_bias", [(1, 64, 128, False), (3, 40, 100, True),
                                             (16, 37, 96, False)])
def test_skinny_gemm(monkeypatch, config, m, n, k, with_bias):
    """The first tile peeled off the loop (loaded before the wait) with even and ragged K,
    one and several splits (the reduce launched with PDL too)."""
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(m * n + k)
        bias = randn(n, gen=gen) if with_bias else None
        x, weight = randn(m, k, gen=gen), randn(n, k, gen=gen)
        return (skinny_gemm.skinny_gemm(x, weight, bias, config=config),)

    record = assert_on_equals_off(monkeypatch, op)
    assert [launch[0] for launch in record.launches] == (
        ["_skinny_gemm_kernel"] + ["_reduce_splits_kernel"] * (config.split_k > 1))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_skinny_gemm_silu_and_mul(monkeypatch, dtype):
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(5)
        x, weight, bias = randn(3, 72, gen=gen, dtype=dtype), randn(48, 72, gen=gen, dtype=dtype), \
            randn(48, gen=gen, dtype=dtype)
        return (skinny_gemm.skinny_gemm_silu_and_mul(x, weight, bias, config=DOT),)

    assert_on_equals_off(monkeypatch, op)


@interpreted
def test_skinny_gemm_add_rms_norm(monkeypatch):
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(6)
        x, weight = randn(5, 96, gen=gen), randn(40, 96, gen=gen) / 10
        residual, norm_weight = randn(5, 40, gen=gen), 1 + randn(40, gen=gen) / 2
        normed, residual = skinny_gemm.skinny_gemm_add_rms_norm(
            x, weight, None, residual, norm_weight, 1e-5, config=WIDE_SPLIT2)
        return normed, residual

    record = assert_on_equals_off(monkeypatch, op)
    assert [launch[0] for launch in record.launches] == [
        "_skinny_gemm_kernel", "_reduce_splits_add_rms_norm_kernel"]


@interpreted
@pytest.mark.parametrize("norm", [False, True], ids=["plain", "add_rms_norm"])
def test_skinny_gemm_with_the_lora_shrink_beside(monkeypatch, norm):
    """Shrink programs in the GEMM's launch (past the step's rows too) wait and trigger once
    each, like the GEMM's; the expand then goes into out or the residual."""
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(8)
        x, weight = randn(5, 96, gen=gen), randn(40, 96, gen=gen) / 10
        token_slots = torch.tensor([1, -1, 0, 1, -1], dtype=torch.int32, device=DEVICE)
        plan = default_plan(5, 16)
        delta = lora_delta.LoraDelta(randn(2, 16, 96, gen=gen) / 8, randn(2, 40, 16, gen=gen) / 4,
                               lora.lora_rows_of(token_slots),
                               LoraPlan(plan.shrink, plan.expand, beside=True))
        if not norm:
            return (skinny_gemm.skinny_gemm(x, weight, config=WIDE_SPLIT2, lora=delta),)
        residual, norm_weight = randn(5, 40, gen=gen), 1 + randn(40, gen=gen) / 2
        return skinny_gemm.skinny_gemm_add_rms_norm(x, weight, None, residual, norm_weight,
                                                    1e-5, config=WIDE_SPLIT2, lora=delta)

    record = assert_on_equals_off(monkeypatch, op)
    reduce = "_reduce_splits_add_rms_norm_kernel" if norm else "_reduce_splits_kernel"
    assert [launch[0] for launch in record.launches] == (
        ["_skinny_gemm_kernel", "_expand_kernel", reduce] if norm
        else ["_skinny_gemm_kernel", reduce, "_expand_kernel"])


@interpreted
def test_lora_gate_up_swiglu_expand(monkeypatch):
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(9)
        x, a = randn(5, 64, gen=gen), randn(2, 16, 64, gen=gen) / 8
        b, gate_up = randn(2, 80, 16, gen=gen) / 4, randn(5, 80, gen=gen)
        token_slots = torch.tensor([1, -1, 0, 1, -1], dtype=torch.int32, device=DEVICE)
        lora_rows = lora.lora_rows_of(token_slots)
        y = lora.lora_shrink(x, a, lora_rows)
        return (lora.lora_expand_silu_and_mul(y, b, lora_rows, gate_up),)

    record = assert_on_equals_off(monkeypatch, op)
    assert [launch[0] for launch in record.launches] == ["_shrink_kernel",
                                                         "_expand_silu_kernel"]


@interpreted
@pytest.mark.parametrize("hidden", [64, 9000], ids=["single_pass", "two_pass"])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(monkeypatch, hidden, with_residual):
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(hidden)
        x, weight = randn(3, hidden, gen=gen), 1 + randn(hidden, gen=gen) / 2
        residual = randn(3, hidden, gen=gen) if with_residual else None
        result = rms_norm.rms_norm(x, weight, 1e-5, residual)
        return result if with_residual else (result,)

    assert_on_equals_off(monkeypatch, op)


def _rotary_inputs(seed: int, num_tokens: int = 3):
    """q, k, v as views of one fused row per token (as the model splits them), positions,
    the cos/sin cache, a NaN-poisoned KV cache and slots (the last token padding: -1)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    qkv = randn(num_tokens, (4 + 2 + 2) * 16, gen=gen)
    q, k, v = qkv.split([64, 32, 32], dim=-1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2, device=DEVICE).float() / 16))
    cache = allocate_kv_cache(1, 6, 4, 2, 16, torch.float32, DEVICE)[0]
    cache.fill_(float("nan"))
    slots = torch.tensor([5, 17, -1][:num_tokens], device=DEVICE)
    return (q.view(num_tokens, 4, 16), k.view(num_tokens, 2, 16), v.view(num_tokens, 2, 16),
            torch.tensor([0, 9, 30][:num_tokens], device=DEVICE),
            build_cos_sin_cache(inv_freq, 64), cache[0], cache[1], slots, qkv)


@interpreted
def test_rotary_and_write_kv_cache(monkeypatch):
    def op():
        q, k, v, positions, cos_sin, key_cache, value_cache, slots, qkv = _rotary_inputs(7)
        kv_cache.rotary_and_write_kv_cache(q, k, v, positions, cos_sin, key_cache, value_cache,
                                           slots)
        return qkv, key_cache, value_cache

    assert_on_equals_off(monkeypatch, op)


@interpreted
def test_write_kv_cache_and_apply_rotary(monkeypatch):
    def op():
        q, k, v, positions, cos_sin, key_cache, value_cache, slots, qkv = _rotary_inputs(8)
        rotary.apply_rotary(q, k, positions, cos_sin)
        kv_cache.write_kv_cache(k, v, key_cache, value_cache, slots)
        return qkv, key_cache, value_cache

    record = assert_on_equals_off(monkeypatch, op)
    assert [launch[0] for launch in record.launches] == ["_apply_rotary_kernel",
                                                         "_write_kv_cache_kernel"]


@interpreted
@pytest.mark.parametrize("num_tokens", [3, 300], ids=["decode_tile", "prefill_tiles"])
def test_lora_shrink_and_expand(monkeypatch, num_tokens):
    """Rows of three slots and base rows between them, splits of in_features summed; the
    tiles past the adapter rows wait and trigger too."""
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(num_tokens)
        x, a = randn(num_tokens, 512, gen=gen), randn(3, 16, 512, gen=gen) / 8
        b, out = randn(3, 40, 16, gen=gen) / 4, randn(num_tokens, 40, gen=gen)
        token_slots = (torch.arange(num_tokens, device=DEVICE) % 5 - 2).clamp(min=-1)
        lora_rows = lora.lora_rows_of(token_slots.to(torch.int32))  # (-1: a base row)
        y = lora.lora_shrink(x, a, lora_rows)  # (unwritten at base rows: compared without)
        return y[:, token_slots >= 0], lora.lora_expand(y, b, lora_rows, out)

    record = assert_on_equals_off(monkeypatch, op)
    assert [launch[0] for launch in record.launches] == ["_shrink_kernel", "_expand_kernel"]


@interpreted
def test_silu_and_mul(monkeypatch):
    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(9)
        return (activation.silu_and_mul(randn(5, 2 * 1500, gen=gen)),)

    assert_on_equals_off(monkeypatch, op)


@interpreted
@pytest.mark.parametrize("seqs,num_segments", [
    ([(40, 1), (7, 1), (1, 1)], 4),  # decodes split along the context, then combined
    ([(40, 1), (50, 40), (9, 9), (1, 1)], 1),  # a decode, chunks in 5 tiles, one spare
    ([(30, 1), (23, 5)], 2),  # both split; the chunks' combine has a padding row
], ids=["decodes_split", "mixed", "mixed_split"])
def test_paged_attention(monkeypatch, seqs, num_segments):
    """seqs: (context length, query length) per sequence."""
    block_size, num_heads, num_kv_heads, head_dim = 4, 4, 2, 16

    def op():
        gen = torch.Generator(device=DEVICE).manual_seed(len(seqs) + num_segments)
        num_tokens = sum(q_len for _, q_len in seqs)
        cache = randn(2, 64, block_size, num_kv_heads, head_dim, gen=gen)
        # [num_seqs, 16]: 64 tokens of context at most
        tables = torch.randperm(64, generator=gen, device=DEVICE)[:16 * len(seqs)].view(
            len(seqs), 16)
        query = randn(num_tokens, num_heads, head_dim, gen=gen)
        num_decodes = next((i for i, (_, q) in enumerate(seqs) if q > 1), len(seqs))
        out = paged_attention.paged_attention(
            query, cache[0], cache[1], tables.int(),
            torch.tensor([s for s, _ in seqs], dtype=torch.int32, device=DEVICE),
            torch.tensor([0] + [q for _, q in seqs], device=DEVICE).cumsum(0).int(), 0.25,
            max_query_len=max(q for _, q in seqs), max_seq_len=max(s for s, _ in seqs),
            num_decodes=num_decodes, num_segments=num_segments)
        return (out,)

    record = assert_on_equals_off(monkeypatch, op)
    names = [launch[0] for launch in record.launches]
    assert names.count("_combine_segments_kernel") == names.count("_paged_attention_kernel") * (
        num_segments > 1)


# ---------------------------------------------------------------------------------------------
# Compiled for sm_90 (no GPU needed)
# ---------------------------------------------------------------------------------------------

def compiled(*args: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-m", "tests.kernels.pdl_check", *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
def test_compiled_kernels_wait_before_touching_what_a_kernel_wrote():
    assert_waits_in_place(compiled("--pdl", "on"))


@pytest.mark.gpu
def test_gpu_machine_triton_compiles_the_waits_in_place():
    """The same check with the device machine's Triton (3.6 there, where the instructions are
    inline assembly), still compiled for sm_90 from the launchers' arguments."""
    assert_waits_in_place(compiled("--pdl", "on"))


def assert_waits_in_place(results: dict) -> None:
    from tests.kernels.pdl_check import CASES

    assert {key.split("/")[0] for key in results} == set(CASES)
    assert {r["kernel"] for r in results.values()} == CONVERTED  # every kernel converted
    for key, r in results.items():
        ttir, ptx, sass = r["ttir"], r["ptx"], r["sass"]
        assert r["PDL"] and r["launch_pdl"], key
        # one wait a program: at the top level, or one in each branch of the skinny GEMM with
        # LoRA shrink programs (the interpreted tests count each program's waits)
        waits = r["branch_waits"]
        assert (ttir["waits"], ttir["triggers"], ptx["waits"], ptx["triggers"]) == (waits,) * 4, key
        assert (ttir["wait_top_level"] or waits > 1) and ttir["trigger_after_wait"], key
        assert ttir["stores_before_wait"] == ptx["global_stores_before_wait"] == 0, key
        # before the wait: the weights only, where the kernel has any (the skinny GEMM's
        # first tile, which the PTX keeps there)
        assert ttir["loads_before_wait"] == r["weight_args"], key
        assert (ptx["global_loads_before_wait"] > 0) == bool(r["weight_args"]), key
        if sass is not None:  # what ptxas scheduled
            assert (sass["waits"], sass["triggers"]) == (waits, waits), key
            assert sass["global_stores_before_wait"] == 0, key
            assert (sass["global_loads_before_wait"] > 0) == bool(r["weight_args"]), key


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
def test_compiled_kernels_off_have_no_grid_dependency_control():
    results = compiled("--pdl", "off", "--cases", "qkv,o_proj_split,rms_norm,"
                       "rotary_and_write_kv_cache,attention_decode_split")
    for key, r in results.items():
        assert not r["PDL"] and not r["launch_pdl"], key
        assert r["ttir"]["waits"] == r["ttir"]["triggers"] == r["ptx"]["waits"] == 0, key
        assert r["ptx"]["triggers"] == 0, key


# ---------------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HIDDEN, INTERMEDIATE, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4096, 14336, 32, 8, 128
BLOCK_SIZE, CONTEXT = 16, 1024


class Layer:
    """One Llama-3.1-8B decoder layer's weights (bf16, random) and KV cache."""

    def __init__(self, gen: torch.Generator, num_blocks: int) -> None:
        def weight(*shape):
            return randn(*shape, gen=gen, dtype=torch.bfloat16) * 0.02

        self.qkv = weight((NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, HIDDEN)
        self.o_proj = weight(HIDDEN, NUM_HEADS * HEAD_DIM)
        self.gate_up = weight(2 * INTERMEDIATE, HIDDEN)
        self.down = weight(HIDDEN, INTERMEDIATE)
        self.input_norm = 1 + weight(HIDDEN)
        self.post_norm = 1 + weight(HIDDEN)
        self.cache = randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, gen=gen,
                           dtype=torch.bfloat16)


def decode_layers(layers: list[Layer], hidden: torch.Tensor, residual: torch.Tensor,
                  position: torch.Tensor, slot: torch.Tensor, tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  cos_sin: torch.Tensor) -> torch.Tensor:
    """Batch-1 decode through the layers with the worker's kernels, as services/worker/model.py
    orders them: [1, HIDDEN] in, the last normed hidden state out (residual updated in place)."""
    x, _ = rms_norm.rms_norm(hidden, layers[0].input_norm, 1e-5, residual)
    for index, layer in enumerate(layers):
        qkv = skinny_gemm.skinny_gemm(x, layer.qkv)
        q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM,
                             NUM_KV_HEADS * HEAD_DIM], dim=-1)
        q = q.view(1, NUM_HEADS, HEAD_DIM)
        kv_cache.rotary_and_write_kv_cache(
            q, k.view(1, NUM_KV_HEADS, HEAD_DIM), v.view(1, NUM_KV_HEADS, HEAD_DIM), position,
            cos_sin, layer.cache[0], layer.cache[1], slot)
        attended = paged_attention.paged_attention(
            q, layer.cache[0], layer.cache[1], tables, seq_lens, query_start_loc,
            HEAD_DIM ** -0.5, max_query_len=1, max_seq_len=CONTEXT)
        h, _ = rms_norm.rms_norm(skinny_gemm.skinny_gemm(attended.view(1, -1), layer.o_proj),
                                 layer.post_norm, 1e-5, residual)
        h = skinny_gemm.skinny_gemm_silu_and_mul(h, layer.gate_up)
        next_norm = layers[index + 1].input_norm if index + 1 < len(layers) else layer.post_norm
        x, _ = skinny_gemm.skinny_gemm_add_rms_norm(h, layer.down, None, residual, next_norm,
                                                    1e-5)
    return x


def llama3_cos_sin() -> torch.Tensor:
    """[2048, HEAD_DIM] fp32 (rope theta 500,000, unscaled: any fixed angles do)."""
    exponents = torch.arange(0, HEAD_DIM, 2, device="cuda").float() / HEAD_DIM
    return build_cos_sin_cache(1.0 / 500000.0 ** exponents, 2048)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("case", ["qkv", "o_proj", "gate_up", "down_norm", "norm",
                                  "rotary_kv", "attention"])
def test_gpu_ops_at_decode_shapes(monkeypatch, case):
    """Each op of a decode layer alone, launched with PDL three times: bitwise the off run."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    layer = Layer(gen, num_blocks=CONTEXT // BLOCK_SIZE)
    x = randn(1, HIDDEN, gen=gen, dtype=torch.bfloat16)
    residual = randn(1, HIDDEN, gen=gen, dtype=torch.bfloat16)
    tables = torch.randperm(CONTEXT // BLOCK_SIZE, generator=gen, device="cuda")[None].int()

    def op():
        res, cache = residual.clone(), layer.cache.clone()
        if case == "qkv":
            return (skinny_gemm.skinny_gemm(x, layer.qkv),)
        if case == "o_proj":
            return (skinny_gemm.skinny_gemm(x, layer.o_proj),)
        if case == "gate_up":
            return (skinny_gemm.skinny_gemm_silu_and_mul(x, layer.gate_up),)
        if case == "down_norm":
            h = randn(1, INTERMEDIATE, gen=torch.Generator("cuda").manual_seed(2),
                      dtype=torch.bfloat16)
            return skinny_gemm.skinny_gemm_add_rms_norm(h, layer.down, None, res,
                                                        layer.post_norm, 1e-5)
        if case == "norm":
            return rms_norm.rms_norm(x, layer.input_norm, 1e-5, res)
        qkv = skinny_gemm.skinny_gemm(x, layer.qkv)
        q, k, v = qkv.split([4096, 1024, 1024], dim=-1)
        cos_sin = llama3_cos_sin()
        kv_cache.rotary_and_write_kv_cache(
            q.view(1, 32, 128), k.view(1, 8, 128), v.view(1, 8, 128),
            torch.tensor([CONTEXT - 1], device="cuda"), cos_sin, cache[0], cache[1],
            torch.tensor([int(tables[0, -1]) * BLOCK_SIZE + 15], device="cuda"))
        if case == "rotary_kv":
            return qkv, cache
        return (paged_attention.paged_attention(
            q.view(1, 32, 128), cache[0], cache[1], tables,
            torch.tensor([CONTEXT], dtype=torch.int32, device="cuda"),
            torch.tensor([0, 1], dtype=torch.int32, device="cuda"), HEAD_DIM ** -0.5,
            max_query_len=1, max_seq_len=CONTEXT),)

    off = op()
    torch.cuda.synchronize()
    monkeypatch.setattr(pdl, "PDL", True)
    for _ in range(3):
        on = op()
        torch.cuda.synchronize()
        for got, expected in zip(on, off, strict=True):
            assert torch.equal(got, expected), case


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_of_decode_layers_replays_bitwise(monkeypatch):
    """Four 8B-shaped decode layers (~2 GB of weights, each kernel reading what the one before
    it wrote) captured in a CUDA graph with PDL on and one with it off: 20 replays of each from
    the same state give bitwise the same hidden state, residual and KV caches. A missing or
    misplaced wait would show as a race here, at the real kernels' timings."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    num_blocks = CONTEXT // BLOCK_SIZE
    layers = [Layer(gen, num_blocks) for _ in range(4)]
    caches = [layer.cache.clone() for layer in layers]
    hidden = randn(1, HIDDEN, gen=gen, dtype=torch.bfloat16)
    residual0 = randn(1, HIDDEN, gen=gen, dtype=torch.bfloat16)
    residual = residual0.clone()
    tables = torch.randperm(num_blocks, generator=gen, device="cuda")[None].int()
    inputs = dict(position=torch.tensor([CONTEXT - 1], device="cuda"),
                  slot=tables[0, -1:].long() * BLOCK_SIZE + BLOCK_SIZE - 1, tables=tables,
                  seq_lens=torch.tensor([CONTEXT], dtype=torch.int32, device="cuda"),
                  query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                  cos_sin=llama3_cos_sin())

    def reset():
        residual.copy_(residual0)
        for layer, cache in zip(layers, caches):
            layer.cache.copy_(cache)

    def capture(switch: bool):
        monkeypatch.setattr(pdl, "PDL", switch)
        reset()
        decode_layers(layers, hidden, residual, **inputs)  # compile outside the capture
        torch.cuda.synchronize()
        reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = decode_layers(layers, hidden, residual, **inputs)
        return graph, out

    def replay(graph, out):
        reset()
        graph.replay()
        torch.cuda.synchronize()
        return out.clone(), residual.clone(), [layer.cache.clone() for layer in layers]

    graph_off, out_off = capture(False)
    expected = replay(graph_off, out_off)
    graph_on, out_on = capture(True)
    for i in range(20):
        got = replay(graph_on, out_on)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), i
        assert all(torch.equal(a, b) for a, b in zip(got[2], expected[2])), i
    assert torch.equal(replay(graph_off, out_off)[0], expected[0])  # off replays the same too
