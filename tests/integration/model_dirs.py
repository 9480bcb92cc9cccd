"""Serving a model directory built by a test (an MoE or an integer checkpoint) through the whole
stack, against transformers on the same (or equivalent) files: the expected greedy texts, the
stack on that directory, and its texts for prompts sent all at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import torch

from cli.stack import Stack, StackOptions, free_port


def transformers_greedy_texts(model_dir: Path, prompts: list[str], num_new_tokens: int
                              ) -> list[str]:
    """Each prompt's greedy continuation by transformers on ``model_dir`` (fp32, CPU)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    texts = []
    for text in prompts:
        ids = tokenizer(text)["input_ids"]
        with torch.inference_mode():
            out = model.generate(torch.tensor([ids]), do_sample=False,
                                 max_new_tokens=num_new_tokens)
        texts.append(tokenizer.decode(out[0, len(ids):], skip_special_tokens=True))
    return texts


def start_stack_on(model_dir: Path, log_dir: Path,
                   service_args: dict[str, list[str]] | None = None,
                   tokenizers: int = 1) -> Stack:
    """``flotilla serve --model model_dir`` (a 64 MiB worker cache unless ``service_args``
    say otherwise; ``tokenizers`` processes), started and healthy."""
    stack = Stack(StackOptions(model=str(model_dir), host="127.0.0.1", port=free_port(),
                               tokenizers=tokenizers,
                               log_dir=log_dir, service_args=service_args or {
                                   "worker": ["--kv-cache-memory", "64MiB"]}))
    stack.start(timeout_s=300)
    return stack


def served_greedy_texts(stack: Stack, prompts: list[str], num_new_tokens: int) -> list[str]:
    """The stack's greedy completions of every prompt, sent at once (one batch of mixed
    sizes), under the model name it serves."""
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0)

    async def all_at_once():
        name = (await client.models.list()).data[0].id
        return await asyncio.gather(*(client.completions.create(
            model=name, prompt=text, temperature=0, max_tokens=num_new_tokens)
            for text in prompts))

    return [r.choices[0].text for r in asyncio.run(all_at_once())]
