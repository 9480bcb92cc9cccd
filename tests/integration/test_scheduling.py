"""Scheduler features through the running stack: prefix caching leaves greedy output
unchanged, preemption under a tiny KV cache loses nothing, and replicas share load."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.integration.conftest import start_stack, wait_for
from tests.integration.test_correctness import hf_greedy

pytestmark = pytest.mark.integration

SYSTEM = ("You are a meticulous assistant for a shipping company. Answer briefly, cite the "
          "relevant rule number, and never invent rules. Rule 1: parcels over 30 kg need a "
          "freight label. Rule 2: batteries ship by ground only. Rule 3: liquids must be "
          "double-bagged. Rule 4: international parcels need a customs form. ")


def conversation(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM * 3}, {"role": "user", "content": question}]


def test_prefix_cache_hits_give_the_reference_text_first_time_and_every_time(
        stack, model_name, hf_model, hf_tokenizer):
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0)
    questions = ["Can I ship a laptop battery by air?", "Can I ship a laptop battery by air?",
                 "Do I need a form to send olive oil to Spain?"]
    cached, num_prompt = [], []
    for question in questions:
        messages = conversation(question)
        response = client.chat.completions.create(model=model_name, messages=messages,
                                                  temperature=0, max_tokens=24)
        _, ref_ids = hf_greedy(hf_model, hf_tokenizer, messages, 24)
        assert response.choices[0].message.content == hf_tokenizer.decode(
            ref_ids, skip_special_tokens=True)
        cached.append(response.usage.prompt_tokens_details.cached_tokens)
        num_prompt.append(response.usage.prompt_tokens)
    # The repeat hits every full block but the last (its last token must be computed);
    # the third shares the long system prompt.
    assert cached[1] == 16 * ((num_prompt[1] - 1) // 16)
    assert 200 < cached[2] < num_prompt[2]
    metrics = httpx.get(stack.base_url + "/metrics").text
    assert "flotilla_prefix_cache_hits_total" in metrics


@pytest.fixture(scope="module")
def tiny_kv_stack(tmp_path_factory):
    """Room for about a quarter of the test's tokens, no prefix cache and no room kept for
    growth at admission, so requests are preempted and recomputed from scratch."""
    stack = start_stack(tmp_path_factory.mktemp("tiny-kv-logs"), service_args={
        "worker": ["--kv-cache-memory", "13MiB"],
        "scheduler": ["--no-prefix-caching", "--max-num-seqs", "16",
                      "--no-admission-reserve"]})
    yield stack
    stack.stop()


def distinct_prompts(num_prompts: int, length: int) -> list[list[int]]:
    return [[1000 + 37 * i + 5 * j for j in range(length)] for i in range(num_prompts)]


async def complete_all(base_url: str, model: str, prompts, max_tokens: int) -> list[str]:
    async with httpx.AsyncClient(base_url=base_url, timeout=300) as client:
        async def one(prompt):
            response = await client.post("/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]
        return await asyncio.gather(*(one(p) for p in prompts))


@pytest.mark.slow  # (make test-slow: CI runs it after make test)
def test_preemption_under_a_tiny_kv_cache_loses_nothing(tiny_kv_stack, model_name):
    # 12 requests x 64 tokens; the cache holds 288 tokens (13 MiB, 46 KiB a token)
    prompts = distinct_prompts(12, 40)
    alone = [asyncio.run(complete_all(tiny_kv_stack.base_url, model_name, [p], 24))[0]
             for p in prompts]
    together = asyncio.run(complete_all(tiny_kv_stack.base_url, model_name, prompts, 24))
    assert together == alone

    def preemptions() -> float:
        metrics = httpx.get(tiny_kv_stack.base_url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("flotilla_preemptions_total{"))

    # counted from the scheduler's stats events (every 0.5 s)
    assert wait_for(lambda: preemptions() > 0, 30.0)


@pytest.mark.slow  # (make test-slow: a stack of its own, half a minute or more)
def test_two_replicas_share_the_load_and_agree(stack, model_name, tmp_path):
    prompts = distinct_prompts(32, 24)
    expected = asyncio.run(complete_all(stack.base_url, model_name, prompts, 12))
    two = start_stack(tmp_path, replicas=2, service_args={"worker": ["--kv-cache-memory", "256MiB"]})
    try:
        assert asyncio.run(complete_all(two.base_url, model_name, prompts, 12)) == expected

        def busy_seconds() -> dict[str, float]:
            metrics = httpx.get(two.base_url + "/metrics").text
            return {line.split('replica_id="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
                    for line in metrics.splitlines()
                    if line.startswith("flotilla_worker_busy_seconds_total{")}

        assert wait_for(lambda: len(busy_seconds()) == 2 and min(busy_seconds().values()) > 0,
                        30.0), busy_seconds()
    finally:
        two.stop()
