"""A Mixture-of-Experts checkpoint through the whole stack: ``flotilla serve --model DIR`` on a
Qwen3-MoE built in the Hub's layout from SmolLM2's real weights (one dense layer among sparse
ones), concurrent requests of mixed prompt sizes, each one's greedy text equal to transformers'
on the same files; /metrics shows the experts' load."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.conftest import wait_for
from tests.integration.model_dirs import (served_greedy_texts, start_stack_on,
                                          transformers_greedy_texts)
from tests.services.worker.moe_checkpoints import build_moe_checkpoint

pytestmark = pytest.mark.integration
NUM_NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "def add(a, b):",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    return build_moe_checkpoint(tmp_path_factory.mktemp("qwen3-moe"), "qwen3_moe",
                                num_experts=4, top_k=2, num_layers=6, dense_layers=(2,))


def test_moe_checkpoint_served_gives_transformers_greedy_text(tmp_path, moe_dir):
    expected = transformers_greedy_texts(moe_dir, PROMPTS, NUM_NEW_TOKENS)
    stack = start_stack_on(moe_dir, tmp_path / "logs")
    try:
        assert served_greedy_texts(stack, PROMPTS, NUM_NEW_TOKENS) == expected

        def expert_load_shown() -> bool:
            text = httpx.get(stack.base_url + "/metrics", timeout=5).text
            return ("flotilla_moe_routed_tokens_total" in text
                    and "flotilla_moe_expert_load_bucket" in text)

        assert wait_for(expert_load_shown, timeout_s=30)  # (stats: slower in the full suite)
    finally:
        stack.stop()
