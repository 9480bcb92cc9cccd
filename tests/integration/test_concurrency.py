"""Many concurrent streams: each one's greedy text equals what it gets alone."""

from __future__ import annotations

import asyncio

import openai
import pytest

pytestmark = pytest.mark.integration

NUM_REQUESTS = 32
TOPICS = ["cats", "the moon", "rivers", "bread", "music", "trains", "winter", "bees"]


def prompt(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Write {i // 8 + 1} short sentences about {TOPICS[i % 8]}."}]


async def stream_text(client, model_name, messages, max_tokens) -> tuple[str, str | None]:
    parts, finish = [], None
    async for chunk in await client.chat.completions.create(
            model=model_name, messages=messages, temperature=0, max_tokens=max_tokens, stream=True):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    return "".join(parts), finish


def test_concurrent_streams_equal_their_solo_runs(stack, model_name):
    client = openai.AsyncOpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0,
                                timeout=300)
    max_tokens = [16 + (i * 7) % 24 for i in range(NUM_REQUESTS)]  # they leave at different steps

    async def run():
        solo = [await stream_text(client, model_name, prompt(i), max_tokens[i])
                for i in range(NUM_REQUESTS)]
        together = await asyncio.gather(*(stream_text(client, model_name, prompt(i), max_tokens[i])
                                          for i in range(NUM_REQUESTS)))
        return solo, together

    solo, together = asyncio.run(run())
    for i, (text, finish) in enumerate(together):
        assert finish in ("stop", "length")
        assert text, i
        assert (text, finish) == solo[i], i
