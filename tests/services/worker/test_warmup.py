"""The attention warm-up runs every launch shape on the model's own cache layout (here under
Triton's interpreter) and leaves the cache as it found it."""

from __future__ import annotations

import pytest
import torch

from kernels.paged_attention_ref import allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from services.worker.runner_build import build_runner
from services.worker.warmup import warm_up_attention, warm_up_steps
from services.worker.weights import load_model
from shared.models import resolve_model
from tests.services.worker.model_checks import greedy_tokens


@pytest.mark.slow  # (make test-slow: half a minute or more on 2 cores)
def test_warm_up_attention_leaves_the_cache_untouched():
    model = load_model(resolve_model("dummy:tiny-llama").path, torch.device("cpu"), torch.float32)
    config = model.config
    kv_cache = allocate_kv_cache(config.num_layers, 32, 16, config.num_kv_heads, config.head_dim,
                                 torch.float32, "cpu").normal_()
    before = kv_cache.clone()
    model.bind_kv_cache(kv_cache)
    warm_up_attention(model, block_size=16)
    assert torch.equal(kv_cache, before)



def test_warm_up_steps_leave_the_runner_as_they_found_it(dummy_model):
    """Its two requests are forgotten, and a request given the very blocks they wrote gets
    the greedy text it gets on a runner that never warmed up (it writes before it reads)."""
    def runner() -> ModelRunner:
        return build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="1MiB",
                                        block_size=4), dummy_model)

    def greedy_text(runner: ModelRunner) -> list[int]:
        last = runner.num_blocks  # the warm-up's requests took the cache's last blocks
        # 32 slots: the prompt and its outputs
        return greedy_tokens(runner, list(range(5, 30)), 6, list(range(last - 8, last)))

    warmed, fresh = runner(), runner()
    warm_up_steps(warmed)
    assert warmed.num_requests == 0 and not warmed.has_in_flight
    assert greedy_text(warmed) == greedy_text(fresh)
