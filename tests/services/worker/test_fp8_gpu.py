"""``--quantization fp8`` on a real GPU (run on the device machine: pytest -m gpu): the FP8
model's teacher-forced logits follow bf16's, and its steps in CUDA graphs give the tokens its
eager steps give."""

from __future__ import annotations

import pytest
import torch

from cli.engine import Engine
from kernels import skinny_gemm as skinny_module
from kernels.paged_attention_ref import allocate_kv_cache
from kernels.skinny_gemm import SkinnyConfig
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.weights import load_model
from shared.messages import SamplingParams
from tests.services.worker.conftest import dummy_preset
from tests.services.worker.model_checks import BLOCK_SIZE, run_chunks

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
CUDA = torch.device("cuda")
# Qwen3-0.6B's projections (qkv, o_proj, gate_up, down) on the skinny GEMM; o_proj and down
# split K, so the residual add and norm run in their reduce
QWEN3_SKINNY = {(4096, 1024): SkinnyConfig(32, 256, max_m=16),
                (1024, 2048): SkinnyConfig(32, 256, split_k=2, max_m=16),
                (6144, 1024): SkinnyConfig(32, 256, max_m=16),
                (1024, 3072): SkinnyConfig(32, 256, split_k=2, max_m=16)}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return dummy_preset(tmp_path_factory, "qwen3-0.6b")


@torch.inference_mode()
def test_fp8_logits_follow_bf16_at_prefill_and_decode_sizes(qwen3):
    """Qwen3-0.6B's shapes (scaled FP8 GEMMs at every size): a 40-token prompt chunk, then
    one decode; cosine of every position's logits with bf16's."""
    path = qwen3.path
    seq = torch.randint(100, 40_000, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    steps, block_tables = [[(seq[:40], 0)], [(seq[40:], 40)]], [list(range(15, 4, -1))]
    logits = {}
    for quantization in ("none", "fp8"):
        model = load_model(path, CUDA, torch.bfloat16, quantization=quantization)
        config = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 16, BLOCK_SIZE,
                                              config.num_kv_heads, config.head_dim,
                                              torch.bfloat16, CUDA))
        logits[quantization] = torch.cat(run_chunks(model, steps, block_tables, CUDA)).float()
        del model
    cosine = torch.nn.functional.cosine_similarity(logits["fp8"], logits["none"], dim=-1)
    assert cosine.min() > 0.98, cosine


def test_fp8_graph_decode_equals_eager(qwen3, monkeypatch):
    """Qwen3-0.6B through the engine in fp32 with FP8 weights, its projections on the skinny
    FP8 GEMM at decode sizes (batch invariant, so a graph's padded batch computes what the eager
    batch does) and prompts eager in both runs: decode steps replayed from CUDA graphs give the
    eager steps' tokens. fp32, as test_runner_gpu.py's graph test: graph and eager steps may
    split attention differently, which a bf16 rounding can turn into another token of this
    near-flat random model. (The scaled FP8 GEMM's capture is tests/kernels/test_fp8.py's.)"""
    for shape, config in QWEN3_SKINNY.items():
        monkeypatch.setitem(skinny_module.FP8_CONFIGS, shape, config)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 40_000, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 90, (8,), generator=generator)]
    greedy = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(prompts)
    outputs = {}
    for eager in (False, True):
        engine = Engine(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                        WorkerConfig(device="cuda", dtype="float32", quantization="fp8",
                                     kv_cache_memory="256MiB", max_model_len=512,
                                     max_num_seqs=16, max_num_batched_tokens=256,
                                     enforce_eager=eager, max_graph_tokens=0), qwen3)
        completions, _ = engine.generate(prompts, greedy)
        outputs[eager] = [c.output_token_ids for c in completions]
        assert eager or engine.runner._graphs is not None
        del engine
        torch.cuda.empty_cache()
    assert outputs[False] == outputs[True]


@torch.inference_mode()
def test_fp8_kv_cache_logits_follow_bf16(qwen3):
    """--kv-cache-dtype fp8 on Qwen3-0.6B's shapes: scales calibrated as the worker does, a
    40-token prompt chunk then a decode through the Triton KV write and attention; every
    position's logits against the bf16 cache's."""
    from kernels.paged_attention_ref import FP8_KV_DTYPE
    from services.worker.kv_quant import set_fp8_kv_scales

    seq = torch.randint(100, 40_000, (41,), generator=torch.Generator().manual_seed(4)).tolist()
    steps, block_tables = [[(seq[:40], 0)], [(seq[40:], 40)]], [list(range(15, 4, -1))]
    logits = {}
    for kv_dtype in (torch.bfloat16, FP8_KV_DTYPE):
        model = load_model(qwen3.path, CUDA, torch.bfloat16)
        if kv_dtype == FP8_KV_DTYPE:
            set_fp8_kv_scales(model, BLOCK_SIZE, CUDA, torch.bfloat16)
        config = model.config
        model.bind_kv_cache(allocate_kv_cache(config.num_layers, 16, BLOCK_SIZE,
                                              config.num_kv_heads, config.head_dim, kv_dtype,
                                              CUDA))
        logits[kv_dtype] = torch.cat(run_chunks(model, steps, block_tables, CUDA)).float()
        del model
    cosine = torch.nn.functional.cosine_similarity(logits[FP8_KV_DTYPE], logits[torch.bfloat16],
                                                   dim=-1)
    assert cosine.min() > 0.98, cosine


def test_fp8_kv_cache_engine_holds_more_blocks_and_graphs_equal_eager(qwen3):
    """An engine with an FP8 cache: four times the blocks of fp32 in the same memory, and
    decode steps replayed from CUDA graphs give the eager steps' tokens (fp32 model, as
    test_fp8_graph_decode_equals_eager) but where the two split attention differently: a
    difference of an fp32 rounding in a key can round it to a neighbouring e4m3 value (6%
    apart), which this near-flat random model may turn into another token (seen: 1 of 128)."""
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 40_000, (int(n),), generator=generator).tolist()
               for n in torch.randint(3, 90, (8,), generator=generator)]
    greedy = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(prompts)
    outputs, num_blocks = {}, {}
    for kv_cache_dtype, eager in (("auto", True), ("fp8", False), ("fp8", True)):
        engine = Engine(SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                        WorkerConfig(device="cuda", dtype="float32", kv_cache_dtype=kv_cache_dtype,
                                     kv_cache_memory="256MiB", max_model_len=512,
                                     max_num_seqs=16, max_num_batched_tokens=256,
                                     enforce_eager=eager, max_graph_tokens=0), qwen3)
        completions, _ = engine.generate(prompts, greedy)
        outputs[kv_cache_dtype, eager] = [c.output_token_ids for c in completions]
        num_blocks[kv_cache_dtype] = engine.runner.num_blocks
        assert engine.runner.kv_cache.dtype == (torch.float32 if kv_cache_dtype == "auto"
                                                else torch.float8_e4m3fn)
        del engine
        torch.cuda.empty_cache()
    assert num_blocks["fp8"] // 4 == num_blocks["auto"]  # e4m3: a quarter of fp32's bytes
    graph, eager = outputs["fp8", False], outputs["fp8", True]
    assert [tokens[0] for tokens in graph] == [tokens[0] for tokens in eager]  # the prompts'
    same = sum(a == b for g, e in zip(graph, eager) for a, b in zip(g, e, strict=True))
    assert same >= 0.95 * sum(map(len, eager)), (graph, eager)
