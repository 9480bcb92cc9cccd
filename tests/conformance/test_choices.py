"""n > 1 on both endpoints (streaming too) and completions' best_of."""

from __future__ import annotations

from collections import defaultdict

import pytest

pytestmark = pytest.mark.integration

STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
SUMMER = "The best thing about summer is"
LONG = {"ignore_eos": True}  # every sequence runs to max_tokens, so counts are exact


def test_chat_n_choices(client, model_name, tokenize):
    response = client.chat.completions.create(model=model_name, messages=STORY, n=3,
                                              temperature=1.0, seed=7, max_tokens=8,
                                              extra_body=LONG)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    for choice in response.choices:
        assert choice.finish_reason == "length"
        assert choice.message.role == "assistant"
        assert isinstance(choice.message.content, str) and choice.message.content
    contents = [choice.message.content for choice in response.choices]
    assert len(set(contents)) > 1, contents  # n samples, not one sample n times
    assert response.usage.completion_tokens == 3 * 8
    assert response.usage.prompt_tokens == len(tokenize(messages=STORY))  # counted once
    assert response.usage.total_tokens == response.usage.prompt_tokens + 24
    again = client.chat.completions.create(model=model_name, messages=STORY, n=3,
                                           temperature=1.0, seed=7, max_tokens=8,
                                           extra_body=LONG)
    assert [choice.message.content for choice in again.choices] == contents


def test_n_with_temperature_zero_gives_identical_choices(client, model_name):
    single = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                            max_tokens=8)
    response = client.chat.completions.create(model=model_name, messages=STORY, n=2,
                                              temperature=0, max_tokens=8)
    assert [choice.index for choice in response.choices] == [0, 1]
    assert {choice.message.content for choice in response.choices} == \
        {single.choices[0].message.content}
    assert response.usage.completion_tokens == 2 * single.usage.completion_tokens


def test_completions_n_choices(client, model_name, tokenize):
    response = client.completions.create(model=model_name, prompt=SUMMER, n=3, temperature=1.0,
                                         max_tokens=6, extra_body=LONG)
    assert [choice.index for choice in response.choices] == [0, 1, 2]
    assert all(choice.finish_reason == "length" for choice in response.choices)
    assert len({choice.text for choice in response.choices}) > 1
    assert response.usage.completion_tokens == 3 * 6
    assert response.usage.prompt_tokens == len(tokenize(prompt=SUMMER))


def _gather_stream(chunks, text_of):
    texts, finishes, roles, usage_chunks = defaultdict(str), defaultdict(list), {}, []
    for chunk in chunks:
        if chunk.usage is not None:
            usage_chunks.append(chunk)
        for choice in chunk.choices:
            texts[choice.index] += text_of(choice) or ""
            if choice.finish_reason is not None:
                finishes[choice.index].append(choice.finish_reason)
            role = getattr(getattr(choice, "delta", None), "role", None)
            if role is not None:
                roles.setdefault(choice.index, role)
    return dict(texts), dict(finishes), roles, usage_chunks


def test_chat_streaming_n(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                          max_tokens=8)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=STORY, n=2, temperature=0, max_tokens=8, stream=True,
        stream_options={"include_usage": True}))
    texts, finishes, roles, usage_chunks = _gather_stream(chunks, lambda c: c.delta.content)
    assert texts == {0: full.choices[0].message.content, 1: full.choices[0].message.content}
    assert finishes == {0: ["length"], 1: ["length"]}
    assert roles == {0: "assistant", 1: "assistant"}
    assert usage_chunks == [chunks[-1]] and chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 16
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completions_streaming_n(client, model_name):
    chunks = list(client.completions.create(
        model=model_name, prompt=SUMMER, n=2, temperature=1.0, seed=3, max_tokens=6,
        stream=True, stream_options={"include_usage": True}, extra_body=LONG))
    texts, finishes, _, usage_chunks = _gather_stream(chunks, lambda c: c.text)
    assert set(texts) == {0, 1} and all(texts.values())
    assert finishes == {0: ["length"], 1: ["length"]}
    assert usage_chunks == [chunks[-1]] and chunks[-1].usage.completion_tokens == 12
    full = client.completions.create(model=model_name, prompt=SUMMER, n=2, temperature=1.0,
                                     seed=3, max_tokens=6, extra_body=LONG)
    assert [choice.text for choice in full.choices] == [texts[0], texts[1]]


def test_best_of(client, model_name):
    greedy = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                       max_tokens=6)
    best_greedy = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                            max_tokens=6, best_of=2)
    assert [c.text for c in best_greedy.choices] == [greedy.choices[0].text]
    one_of_three = client.completions.create(model=model_name, prompt=SUMMER, temperature=1.0,
                                             max_tokens=6, best_of=3, n=1, extra_body=LONG)
    assert [choice.index for choice in one_of_three.choices] == [0]
    assert one_of_three.choices[0].finish_reason == "length"
    assert one_of_three.usage.completion_tokens == 3 * 6  # every sequence, as OpenAI bills
    two_of_three = client.completions.create(model=model_name, prompt=SUMMER, temperature=1.0,
                                             max_tokens=6, best_of=3, n=2, logprobs=0,
                                             extra_body=LONG)
    assert [choice.index for choice in two_of_three.choices] == [0, 1]
    # returned best first: by cumulative logprob, descending
    totals = [sum(choice.logprobs.token_logprobs) for choice in two_of_three.choices]
    assert totals[0] >= totals[1]


def test_completions_batch_of_prompts(client, model_name, tokenize):
    """A list of prompts: choices grouped by prompt (prompt index x n + i), usage over all."""
    prompts = [SUMMER, "The capital of France is"]
    singles = [client.completions.create(model=model_name, prompt=p, temperature=0,
                                         max_tokens=6).choices[0].text for p in prompts]
    response = client.completions.create(model=model_name, prompt=prompts, n=2, temperature=0,
                                         max_tokens=6, extra_body=LONG)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.text for c in response.choices] == [singles[0]] * 2 + [singles[1]] * 2
    assert response.usage.prompt_tokens == sum(len(tokenize(prompt=p)) for p in prompts)
    assert response.usage.completion_tokens == 4 * 6
    streamed = defaultdict(str)
    for chunk in client.completions.create(model=model_name, prompt=prompts, temperature=0,
                                           max_tokens=6, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert dict(streamed) == {0: singles[0], 1: singles[1]}
    best = client.completions.create(model=model_name, prompt=prompts, best_of=2, temperature=0,
                                     max_tokens=6)
    assert [c.text for c in best.choices] == singles
