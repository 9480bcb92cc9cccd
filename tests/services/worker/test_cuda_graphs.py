"""The CUDA graph helpers' host-side logic, on CPU: the bucket choices, and the piecewise
pieces (run uncaptured) against the eager forward, padding included. The captured graphs
themselves are checked on the GPU (test_runner_gpu.py)."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch

from kernels.paged_attention_ref import allocate_kv_cache
from kernels.rotary import build_cos_sin_cache
from services.worker.cuda_graphs import (
    PiecewiseGraphs, collector_paused, smallest_bucket, token_buckets,
)
from services.worker.model import ModelConfig, Transformer, compute_inv_freq
from services.worker.weights import random_weights
from services.worker.runner import SequenceChunk, build_step_inputs

BLOCK_SIZE = 4
CONFIGS = {
    "llama": dict(architectures=["LlamaForCausalLM"], vocab_size=96, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], vocab_size=96, hidden_size=64,
                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=128,
                  tie_word_embeddings=True),
}


def test_token_buckets():
    assert token_buckets(512) == [16, 24, 32, 48, 64, 96, 128, 192, 256, 288, 320, 352, 384,
                                  416, 448, 480, 512]
    assert token_buckets(2048)[-9:] == [1024, 1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]
    assert token_buckets(300)[-3:] == [256, 288, 300]
    assert token_buckets(100) == [16, 24, 32, 48, 64, 96, 100]
    assert token_buckets(16) == [16]
    assert token_buckets(8) == [8]
    assert [smallest_bucket([16, 24, 32], n) for n in (1, 16, 17, 32, 33)] == [16, 16, 24, 32,
                                                                               None]


def _model(family: str) -> Transformer:
    """Random weights, larger than the dummies' so the logits are far apart."""
    config = ModelConfig.from_dict(CONFIGS[family])
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict(random_weights(model, torch.device("cpu"), torch.float32, seed=3,
                                         std=0.2), strict=True, assign=True)
    model.inv_freq = compute_inv_freq(config)  # the meta-built buffers are empty
    model.cos_sin_cache = build_cos_sin_cache(model.inv_freq, config.max_position_embeddings)
    return model.eval()


def _cache(model: Transformer) -> torch.Tensor:
    config = model.config
    return allocate_kv_cache(config.num_layers, 24, BLOCK_SIZE, config.num_kv_heads,
                             config.head_dim, torch.float32, "cpu")


@pytest.mark.parametrize("family", list(CONFIGS))
@torch.inference_mode()
def test_piecewise_pieces_equal_the_eager_forward(family):
    """Two steps (prompt chunks, then decodes beside a chunk after context), 13 and 7 tokens
    padded to buckets of 16: the same logits and the same cache as the eager forward; the
    padding rows write nothing."""
    model = _model(family)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=gen).tolist() for n in (9, 4, 11)]
    tables = [[3, 7, 1], [12], [5, 0, 20]]
    # per step, (sequence, start, end): decodes first, as the scheduler orders them
    steps = [[(0, 0, 6), (1, 0, 3), (2, 0, 4)], [(1, 3, 4), (0, 6, 9), (2, 4, 7)]]
    results = {}
    for mode in ("eager", "pieces"):
        cache = _cache(model)
        model.bind_kv_cache(cache)
        pieces = PiecewiseGraphs(model, 32, torch.device("cpu"), use_graphs=False)
        logits = []
        for step in steps:
            chunks = [SequenceChunk(token_ids=seqs[seq][start:end], start=start,
                                    block_table=tables[seq], sample=True)
                      for seq, start, end in step]
            input_ids, positions, metadata = build_step_inputs(chunks, BLOCK_SIZE,
                                                               torch.device("cpu"))
            metadata = dataclasses.replace(metadata, logits_indices=torch.arange(len(input_ids)))
            run = model if mode == "eager" else pieces.run
            logits.append(run(input_ids, positions, metadata))
        results[mode] = (torch.cat(logits), cache.clone())
        model.bind_kv_cache(None)
    (eager_logits, eager_cache), (piece_logits, piece_cache) = results["eager"], results["pieces"]
    assert piece_logits.shape == (20, 96)
    torch.testing.assert_close(piece_logits, eager_logits, atol=1e-5, rtol=1e-5)
    assert piece_logits.argmax(-1).tolist() == eager_logits.argmax(-1).tolist()
    torch.testing.assert_close(piece_cache, eager_cache, atol=1e-5, rtol=1e-5)
    used = sorted({block for table in tables for block in table})
    unused = [block for block in range(24) if block not in used]
    assert not piece_cache[:, :, unused].any()  # padding rows (slot -1) wrote nowhere


def test_captures_run_with_the_collector_paused_after_a_collection():
    """Garbage is collected before the captures and none during them (an object collected
    mid-capture can invalidate it); the collector's state is restored after, even when a
    capture fails."""

    class Cycle:
        pass

    dead = Cycle()
    dead.self = dead
    alive = weakref.ref(dead)
    del dead
    assert gc.isenabled()
    with collector_paused():
        assert alive() is None and not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
