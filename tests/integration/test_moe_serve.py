"""A Mixture-of-Experts checkpoint through the whole stack: ``flotilla serve --model DIR`` on a
Qwen3-MoE built in the Hub's layout from SmolLM2's real weights (one dense layer among sparse
ones), concurrent requests of mixed prompt sizes, each one's greedy text equal to transformers'
on the same files; /metrics shows the experts' load."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from cli.stack import Stack, StackOptions, free_port
from tests.integration.conftest import wait_for
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
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(moe_dir))
    hf_model = AutoModelForCausalLM.from_pretrained(str(moe_dir), dtype=torch.float32).eval()
    expected = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), do_sample=False,
                                    max_new_tokens=NUM_NEW_TOKENS)
        expected.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    stack = Stack(StackOptions(model=str(moe_dir), host="127.0.0.1", port=free_port(),
                               log_dir=tmp_path / "logs",
                               service_args={"worker": ["--kv-cache-memory", "64MiB"]}))
    stack.start(timeout_s=300)
    try:
        client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x",
                                    max_retries=0)

        async def all_at_once():
            name = (await client.models.list()).data[0].id
            return await asyncio.gather(*(client.completions.create(
                model=name, prompt=text, temperature=0, max_tokens=NUM_NEW_TOKENS)
                for text in PROMPTS))

        responses = asyncio.run(all_at_once())
        assert [r.choices[0].text for r in responses] == expected

        def expert_load_shown() -> bool:
            text = httpx.get(stack.base_url + "/metrics", timeout=5).text
            return "flotilla_moe_routed_tokens_total" in text and "flotilla_moe_expert_load_bucket" in text

        assert wait_for(expert_load_shown, timeout_s=10)
    finally:
        stack.stop()
