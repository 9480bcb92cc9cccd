"""The decoder with the residual add and RMSNorm in o_proj's and down's split-K reduce
(``ops.linear_add_rms_norm`` taking ``skinny_gemm_add_rms_norm``) against the same decoder with
the GEMM then the norm kernel.

On CPU under TRITON_INTERPRET=1 the Triton GEMM and norm are forced onto the CPU model (the
worker's CPU path is the torch reference), so that both sides run the kernels: the same greedy
tokens, and bitwise the same residual stream after every add and the same logits. On the GPU
(-m gpu), bf16 eager steps with the switch on and off, and decode steps replayed from CUDA
graphs captured with it on."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import rms_norm as rms_norm_kernels
from kernels import skinny_gemm as skinny_module
from kernels.paged_attention_ref import allocate_kv_cache
from kernels.rotary import build_cos_sin_cache
from kernels.skinny_gemm import MAX_M, SkinnyConfig, skinny_gemm
from services.worker import ops
from services.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from services.worker.model import ModelConfig, Transformer, compute_inv_freq
from services.worker.weights import random_weights
from services.worker.runner import SequenceChunk, build_step_inputs

BLOCK_SIZE = 4
CONFIG = dict(architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64,
              intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
VARIANTS = {"plain": {}, "biases": dict(attention_bias=True, mlp_bias=True)}
# o_proj [hidden, q_size] and down [hidden, intermediate] split in two, as the 8B's are in four
SPLIT = SkinnyConfig(block_n=16, block_k=32, split_k=2, max_m=MAX_M)
SPLIT_SHAPES = [(64, 64), (64, 96)]
PROMPTS = [[5, 17, 33, 2, 90, 41, 7, 8, 60], [64, 3, 3, 12], list(range(20, 40))]
TABLES = [[3, 7, 1, 9, 14], [12, 2, 17, 18], [5, 0, 20, 6, 11, 13, 15, 16]]


def make_model(variant: str, device: str = "cpu", dtype=torch.float32) -> Transformer:
    """Random weights, the norms' included (not all ones)."""
    config = ModelConfig.from_dict({**CONFIG, **VARIANTS[variant]})
    with torch.device("meta"):
        model = Transformer(config)
    weights = random_weights(model, torch.device(device), dtype, seed=3, std=0.2)
    gen = torch.Generator(device=device).manual_seed(4)
    for name, tensor in weights.items():
        if name.endswith("norm.weight"):
            tensor.add_(0.3 * torch.randn(tensor.shape, generator=gen, device=device))
    model.load_state_dict(weights, strict=True, assign=True)
    model.inv_freq = compute_inv_freq(config).to(device)
    model.cos_sin_cache = build_cos_sin_cache(model.inv_freq, config.max_position_embeddings)
    return model.eval()


def bind_cache(model: Transformer, device: str = "cpu") -> None:
    config = model.config
    model.bind_kv_cache(allocate_kv_cache(
        config.num_layers, 24, BLOCK_SIZE, config.num_kv_heads, config.head_dim,
        model.embed_tokens.weight.dtype, device))


def steps():
    """(chunks as (sequence, start, end)) per step, then decodes: 13 prompt tokens (the norm in
    the reduce, two of the rows sampled), 22 tokens (over MAX_M: the two kernels), then decodes
    of all three."""
    return [[(0, 0, 9), (1, 0, 4)], [(0, 9, 10), (1, 4, 5), (2, 0, 20)]]


def run_greedy(model: Transformer, run, num_decodes: int, device: str = "cpu"):
    """The scripted steps, each sampled token fed back -> (tokens, logits per step, indices
    per step)."""
    seqs = [list(prompt) for prompt in PROMPTS]
    all_logits, all_indices = [], []

    def step(parts):
        chunks = [SequenceChunk(token_ids=seqs[seq][start:end], start=start,
                                block_table=TABLES[seq], sample=end == len(seqs[seq]))
                  for seq, start, end in parts]
        input_ids, positions, metadata = build_step_inputs(chunks, BLOCK_SIZE,
                                                           torch.device(device))
        logits = run(input_ids, positions, metadata)
        all_logits.append(logits.cpu())
        all_indices.append(metadata.logits_indices.cpu())
        sampled = [seq for (seq, _, _), chunk in zip(parts, chunks) if chunk.sample]
        for seq, token in zip(sampled, logits.argmax(-1).tolist(), strict=True):
            seqs[seq].append(token)

    with torch.inference_mode():
        for parts in steps():
            step(parts)
        for _ in range(num_decodes):
            step([(seq, len(seqs[seq]) - 1, len(seqs[seq])) for seq in range(3)])
    return [seq[len(prompt):] for seq, prompt in zip(seqs, PROMPTS)], all_logits, all_indices


def force_kernels(monkeypatch, fused: bool) -> dict:
    """The CPU model on the Triton kernels: the skinny GEMM for up to MAX_M rows (o_proj and
    down split in two), the norm kernel, and the norm in the reduce where ``fused``. Returns
    the record: the residual after every add, per step, and the launches of each path."""
    for shape in SPLIT_SHAPES:
        monkeypatch.setitem(skinny_module.CONFIGS, shape, SPLIT)
    record = {"residuals": [], "norm_launches": 0, "reduce_norms": 0}

    def linear(x, weight, bias=None, weight_scale=None, batch_invariant=False, lora=None):
        assert weight_scale is None and not batch_invariant and lora is None  # (no adapters)
        if x.dim() == 2 and x.shape[0] <= MAX_M:
            return skinny_gemm(x, weight, bias)
        return F.linear(x, weight, bias)

    def rms_norm(x, weight, eps, residual=None):
        record["norm_launches"] += 1
        result = rms_norm_kernels.rms_norm(x, weight, eps, residual)
        if residual is not None:
            record["residuals"].append(residual.clone())
        return result

    original = skinny_module.skinny_gemm_add_rms_norm

    def add_rms_norm(*args, **kwargs):
        record["reduce_norms"] += 1
        normed, residual = original(*args, **kwargs)
        record["residuals"].append(residual.clone())
        return normed, residual

    monkeypatch.setattr(ops, "linear", linear)
    monkeypatch.setattr(ops, "rms_norm", rms_norm)
    monkeypatch.setattr(skinny_module, "skinny_gemm_add_rms_norm", add_rms_norm)
    monkeypatch.setattr(ops, "norm_in_reduce", lambda num_tokens, weight, residual, norm_weight:
                        fused and num_tokens <= MAX_M and tuple(weight.shape) in SPLIT_SHAPES)
    return record


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_decode_with_the_norm_in_the_reduce_is_bitwise_the_two_kernels(monkeypatch, variant):
    model = make_model(variant)
    results = {}
    for fused in (False, True):
        with monkeypatch.context() as patch:
            record = force_kernels(patch, fused)
            bind_cache(model)
            tokens, logits, indices = run_greedy(model, model, num_decodes=4)
            results[fused] = tokens, logits, indices, record
    (tokens, logits, indices, two), (fused_tokens, fused_logits, _, fused) = (
        results[False], results[True])
    assert fused_tokens == tokens and [len(t) for t in tokens] == [6, 6, 5]
    for got, expected in zip(fused_logits, logits, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        assert torch.equal(got, expected)
    # the residual stream after every add: 2 per layer a step, the last one of a step being
    # the final norm's (only its sampled rows, where ``logits`` adds them)
    num_layers, num_steps = model.config.num_layers, len(logits)
    assert len(two["residuals"]) == len(fused["residuals"]) == 2 * num_layers * num_steps
    for i, (got, expected) in enumerate(zip(fused["residuals"], two["residuals"])):
        if got.shape != expected.shape:
            assert (i + 1) % (2 * num_layers) == 0  # a step's final norm
            got = got[indices[i // (2 * num_layers)]]
        assert torch.equal(got, expected), i
    # every step but the 22-token one had its adds in the reduce: only the first input norm
    # launched on its own there
    fused_steps = num_steps - 1
    assert two["reduce_norms"] == 0 and fused["reduce_norms"] == 2 * num_layers * fused_steps
    assert two["norm_launches"] == (1 + 2 * num_layers) * num_steps
    assert fused["norm_launches"] == num_steps + 2 * num_layers


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
def test_piecewise_pieces_with_the_norm_in_the_reduce_equal_the_eager_forward(monkeypatch):
    """The piecewise graphs' pieces (run uncaptured, padded to 16 rows) take o_proj's reduce
    with the norm, down's without (they call ``after_attention`` without a next norm): the
    same logits as the eager forward."""
    model = make_model("plain")
    record = force_kernels(monkeypatch, fused=True)
    bind_cache(model)
    _, eager_logits, _ = run_greedy(model, model, num_decodes=2)
    reduce_norms = record["reduce_norms"]
    bind_cache(model)
    pieces = PiecewiseGraphs(model, 32, torch.device("cpu"), use_graphs=False)
    _, piece_logits, _ = run_greedy(model, pieces.run, num_decodes=2)
    assert record["reduce_norms"] > reduce_norms
    for got, expected in zip(piece_logits, eager_logits, strict=True):
        assert torch.equal(got, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_eager_and_graph_decodes_with_the_norm_in_the_reduce(monkeypatch, variant):
    """bf16 on the GPU, the tiny shapes given split configs: with the norm in the reduce (the
    path), eager steps give bitwise the logits of the two kernels, and so do decode steps replayed from CUDA
    graphs captured with it on against graphs captured with it off (graphs and eager steps
    are not compared: their attention launches are bounded differently)."""
    for shape in SPLIT_SHAPES:
        monkeypatch.setitem(skinny_module.CONFIGS, shape, SPLIT)
    model = make_model(variant, "cuda", torch.bfloat16)
    launches = []
    original = skinny_module.skinny_gemm_add_rms_norm
    monkeypatch.setattr(skinny_module, "skinny_gemm_add_rms_norm",
                        lambda *args, **kwargs: launches.append(1) or original(*args, **kwargs))
    results = {}
    takes_the_reduce = ops.norm_in_reduce
    for switch in (False, True):
        # off: the two kernels, the path wherever the reduce cannot hold the norm
        monkeypatch.setattr(ops, "norm_in_reduce",
                            takes_the_reduce if switch else lambda *args: False)
        bind_cache(model, "cuda")
        results["eager", switch] = run_greedy(model, model, num_decodes=4, device="cuda")
        bind_cache(model, "cuda")
        graphs = DecodeGraphs(model, max_batch_size=4, max_blocks_per_seq=8, max_model_len=32,
                              device=torch.device("cuda"))
        graphs.capture()

        def run(input_ids, positions, metadata, graphs=graphs):
            if metadata.max_query_len == 1:
                return graphs.run(input_ids, positions, metadata).clone()
            return model(input_ids, positions, metadata)

        results["graphs", switch] = run_greedy(model, run, num_decodes=4, device="cuda")
        assert bool(launches) == switch
    for mode in ("eager", "graphs"):
        (tokens, logits, _), (on_tokens, on_logits, _) = results[mode, False], results[mode, True]
        assert on_tokens == tokens, mode
        for got, expected in zip(on_logits, logits, strict=True):
            assert torch.equal(got, expected), mode
