"""The decoder with programmatic dependent launch on (kernels/pdl.py) against the same decoder
with it off: the same greedy tokens and bitwise the same logits.

On CPU under TRITON_INTERPRET=1 the skinny GEMM and the norm kernel are forced onto the CPU
model (as test_model_norm_in_reduce.py does) and the griddepcontrol instructions, which the
interpreter lacks, are recorded instead (tests/kernels/test_pdl.py). On the GPU (-m gpu), bf16
with every projection of up to 16 rows on the skinny GEMM: eager steps, decode steps replayed
from CUDA graphs captured with PDL on (split-KV attention included) and mixed steps through
the piecewise graphs, each against the same mode with PDL off."""

from __future__ import annotations

import pytest
import torch

from kernels import pdl
from kernels import skinny_gemm as skinny_module
from kernels.skinny_gemm import MAX_M
from services.worker import ops
from services.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from tests.kernels.test_pdl import interpret_pdl_on
from tests.services.worker import test_model_norm_in_reduce as norm_tests
from tests.services.worker.test_model_norm_in_reduce import (SPLIT, SPLIT_SHAPES, bind_cache,
                                                              force_kernels, make_model,
                                                              run_greedy)

# Qwen3: the per-head q/k norms (the norm kernel on strided views) and tied embeddings
QWEN3 = dict(architectures=["Qwen3ForCausalLM"], head_dim=16, tie_word_embeddings=True)
MAX_MODEL_LEN = 256  # decode graphs bounded at 256 tokens: their attention splits the context


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
@pytest.mark.parametrize("fused", [False, True], ids=["two_kernels", "norm_in_reduce"])
def test_cpu_decode_with_pdl_is_bitwise_pdl_off(monkeypatch, fused):
    model = make_model("biases")
    record = force_kernels(monkeypatch, fused)
    bind_cache(model)
    tokens, logits, _ = run_greedy(model, model, num_decodes=3)
    with monkeypatch.context() as patch:
        launches = interpret_pdl_on(patch)
        bind_cache(model)
        on_tokens, on_logits, _ = run_greedy(model, model, num_decodes=3)
    assert on_tokens == tokens
    for got, expected in zip(on_logits, logits, strict=True):
        assert torch.equal(got, expected)
    assert (record["reduce_norms"] > 0) == fused
    assert {name for name, *_ in launches.launches} >= {"_skinny_gemm_kernel",
                                                        "_rms_norm_kernel"}
    programs = sum(num for _, num, _, _ in launches.launches)
    assert launches.events == ["wait", "trigger"] * programs


def all_projections_skinny(monkeypatch) -> None:
    """Every CUDA projection of up to MAX_M rows on the skinny GEMM (gate_up with its SwiGLU
    epilogue; o_proj and down split in two, so their reduces run): the tiny shapes have no
    entry in its measured tables."""
    for shape in SPLIT_SHAPES:
        monkeypatch.setitem(skinny_module.CONFIGS, shape, SPLIT)
    monkeypatch.setattr(skinny_module, "serves",
                        lambda rows, weight: weight.is_cuda and 0 < rows <= MAX_M)
    monkeypatch.setattr(skinny_module, "serves_gated",
                        lambda rows, weight: weight.is_cuda and 0 < rows <= MAX_M)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", ["plain", "biases", "qwen3"])
@pytest.mark.parametrize("norm_in_reduce", [False, True])
def test_gpu_eager_and_graph_steps_with_pdl(monkeypatch, variant, norm_in_reduce):
    monkeypatch.setitem(norm_tests.VARIANTS, "qwen3", QWEN3)
    all_projections_skinny(monkeypatch)
    if not norm_in_reduce:  # the two kernels, the path wherever the reduce cannot hold the norm
        monkeypatch.setattr(ops, "norm_in_reduce", lambda *args: False)
    model = make_model(variant, "cuda", torch.bfloat16)
    device = torch.device("cuda")
    pdl_launches = []
    options = pdl.launch_options
    monkeypatch.setattr(pdl, "launch_options",
                        lambda: pdl_launches.append(pdl.PDL) or options())
    results = {}
    for switch in (False, True):
        monkeypatch.setattr(pdl, "PDL", switch)
        bind_cache(model, "cuda")
        results["eager", switch] = run_greedy(model, model, num_decodes=4, device="cuda")
        bind_cache(model, "cuda")
        graphs = DecodeGraphs(model, max_batch_size=4, max_blocks_per_seq=MAX_MODEL_LEN // 4,
                              max_model_len=MAX_MODEL_LEN, device=device)
        graphs.capture()
        pieces = PiecewiseGraphs(model, 32, device)
        pieces.capture()

        def run(input_ids, positions, metadata, graphs=graphs, pieces=pieces):
            if metadata.max_query_len == 1:
                return graphs.run(input_ids, positions, metadata).clone()
            if pieces.bucket_for(input_ids.shape[0]) is not None:
                return pieces.run(input_ids, positions, metadata)
            return model(input_ids, positions, metadata)

        results["graphs", switch] = run_greedy(model, run, num_decodes=6, device="cuda")
        assert pieces.num_steps > 0
    assert any(pdl_launches) and not all(pdl_launches)
    for mode in ("eager", "graphs"):
        (tokens, logits, _), (on_tokens, on_logits, _) = results[mode, False], results[mode, True]
        assert on_tokens == tokens, mode
        for got, expected in zip(on_logits, logits, strict=True):
            assert torch.equal(got, expected), mode
