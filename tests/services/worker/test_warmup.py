"""The attention warm-up runs every launch shape on the model's own cache layout (here under
Triton's interpreter) and leaves the cache as it found it."""

from __future__ import annotations

import torch

from kernels.paged_attention_ref import allocate_kv_cache
from services.worker.weights import load_model
from services.worker.warmup import warm_up_attention
from shared.models import resolve_model


def test_warm_up_attention_leaves_the_cache_untouched():
    model = load_model(resolve_model("dummy:tiny-llama").path, torch.device("cpu"), torch.float32)
    config = model.config
    kv_cache = allocate_kv_cache(config.num_layers, 32, 16, config.num_kv_heads, config.head_dim,
                                 torch.float32, "cpu").normal_()
    before = kv_cache.clone()
    model.bind_kv_cache(kv_cache)
    warm_up_attention(model, block_size=16)
    assert torch.equal(kv_cache, before)
