"""Many concurrent streams: each one's greedy text equals what it gets alone."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

pytestmark = pytest.mark.integration

NUM_REQUESTS = 16  # solo runs are one at a time: the 1,024-stream test below is the large one
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


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
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
    # the shared stack's worker overlaps steps (conftest): these streams went through that path
    worker = httpx.get(stack.base_url + "/health", timeout=30).json()["services"]["worker"]
    assert worker["num_overlapped_steps"] > 0


NUM_STREAMS = 1024
NUM_DISTINCT = 16


async def sse_text(client, body: dict) -> tuple[str, str | None, int]:
    """A streamed completion's text, finish reason and usage tokens, read with plain httpx."""
    import json

    parts, finish, num_tokens = [], None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            payload = json.loads(line[6:])
            assert "error" not in payload, payload
            if payload["choices"]:
                parts.append(payload["choices"][0]["text"])
                finish = payload["choices"][0]["finish_reason"] or finish
            if payload.get("usage"):
                num_tokens = payload["usage"]["completion_tokens"]
    return "".join(parts), finish, num_tokens


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_a_thousand_streams_equal_their_solo_runs(stack, model_name):
    """1,024 streams at once (far more than --max-num-seqs: most queue), up to 16 tokens
    each (the suite's time goes into tokens, not streams); every text equals the prompt's
    solo greedy run. Half stop at a stop string (most of those within 4 tokens)."""
    import httpx

    def body(i: int) -> dict:
        distinct = i % NUM_DISTINCT
        return {"model": model_name, "max_tokens": 16, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
                "prompt": f"Here are {distinct // 8 + 2} facts about {TOPICS[distinct % 8]}:",
                **({"stop": ["."]} if distinct % 2 else {})}

    async def run():
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(base_url=stack.base_url, timeout=600, limits=limits) as client:
            solo = [await sse_text(client, body(i)) for i in range(NUM_DISTINCT)]
            together = await asyncio.gather(*(sse_text(client, body(i))
                                              for i in range(NUM_STREAMS)))
        return solo, together

    solo, together = asyncio.run(run())
    assert all(text and finish in ("stop", "length") for text, finish, _ in solo)
    assert any(finish == "stop" for _, finish, _ in solo)  # the stop strings were met
    mismatched = [i for i, result in enumerate(together) if result != solo[i % NUM_DISTINCT]]
    assert not mismatched, f"{len(mismatched)} streams differ, e.g. {mismatched[:5]}"
