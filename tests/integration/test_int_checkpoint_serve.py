"""An integer weight-only checkpoint through the whole stack: ``flotilla serve --model DIR`` on
SmolLM2 written as AWQ (4-bit, group 64, round to nearest: int_packing.py) gives, on concurrent
requests, the greedy text of transformers running the dequantized fp32 copy of the same
weights."""

from __future__ import annotations

import asyncio

import openai
import pytest
import torch

from cli.stack import Stack, StackOptions, free_port
from tests.services.worker.int_packing import write_int_checkpoint, write_plain

pytestmark = pytest.mark.integration
NUM_NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "def add(a, b):",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


@pytest.fixture(scope="module")
def awq_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    plain = write_int_checkpoint(root / "smollm2-awq", "awq", bits=4, group_size=64)
    return root / "smollm2-awq", write_plain(root / "plain", plain, root / "smollm2-awq")


def test_awq_checkpoint_served_gives_transformers_greedy_text(tmp_path, awq_dirs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    awq_dir, plain_dir = awq_dirs
    tokenizer = AutoTokenizer.from_pretrained(str(plain_dir))
    hf_model = AutoModelForCausalLM.from_pretrained(str(plain_dir), dtype=torch.float32).eval()
    expected = []
    for text in PROMPTS:
        ids = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            out = hf_model.generate(torch.tensor([ids]), do_sample=False,
                                    max_new_tokens=NUM_NEW_TOKENS)
        expected.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    stack = Stack(StackOptions(model=str(awq_dir), host="127.0.0.1", port=free_port(),
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
        assert "Paris" in expected[0]
        worker_log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*worker*"))
        assert "int_checkpoint_dequantized" in worker_log  # said once, with method and bits
    finally:
        stack.stop()
