"""Sampling parameters on both endpoints: OpenAI's (temperature, top_p, penalties,
logit_bias, seed, stop, max_tokens / max_completion_tokens) and the extensions sent
through ``extra_body`` (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids)."""

from __future__ import annotations

import asyncio

import pytest

pytestmark = pytest.mark.integration

COUNTING = "1, 2, 3, 4,"  # greedy: " 5, 6, 7, 8, 9, 10, 11, ..." (" ", "5", "," per number)
SUMMER = "The best thing about summer is"
SHORT_ANSWER = [{"role": "user", "content": "What color is the sky? One word."}]  # ends in ~10
COUNT_CHAT = [{"role": "user", "content": "Count from 1 to 10, separated by commas."}]
STORY = [{"role": "user", "content": "Write a long story about a dragon."}]


def complete(client, model_name, prompt, **kwargs):
    return client.completions.create(model=model_name, prompt=prompt, **kwargs)


def chat(client, model_name, messages, **kwargs):
    return client.chat.completions.create(model=model_name, messages=messages, **kwargs)


def single_token_id(tokenize, text: str) -> int:
    ids = tokenize(prompt=text, add_special_tokens=False)
    assert len(ids) == 1, (text, ids)
    return ids[0]


def test_truncation_at_its_limit_equals_greedy(client, model_name):
    """top_k=1, min_p=1 and a tiny top_p keep only the most likely token: at temperature 1
    they must give exactly the greedy text, on both endpoints."""
    greedy = complete(client, model_name, SUMMER, max_tokens=12, temperature=0)
    assert greedy.choices[0].finish_reason == "length"
    assert greedy.usage.completion_tokens == 12
    for kwargs in ({"extra_body": {"top_k": 1}}, {"extra_body": {"min_p": 1.0}},
                   {"top_p": 0.001}):
        sampled = complete(client, model_name, SUMMER, max_tokens=12, temperature=1.0, seed=5,
                           **kwargs)
        assert sampled.choices[0].text == greedy.choices[0].text, kwargs
    greedy_chat = chat(client, model_name, STORY, max_tokens=10, temperature=0)
    top_k_chat = chat(client, model_name, STORY, max_tokens=10, temperature=1.0,
                      extra_body={"top_k": 1})
    assert top_k_chat.choices[0].message.content == greedy_chat.choices[0].message.content


def test_seed_makes_sampling_reproducible(client, model_name):
    texts = {seed: complete(client, model_name, SUMMER, max_tokens=16, temperature=1.0,
                            seed=seed).choices[0].text for seed in (11, 12, 13)}
    again = complete(client, model_name, SUMMER, max_tokens=16, temperature=1.0, seed=11)
    assert again.choices[0].text == texts[11]
    assert len(set(texts.values())) > 1, texts  # the seed matters
    first = chat(client, model_name, STORY, max_tokens=16, temperature=1.0, top_p=0.95, seed=99)
    second = chat(client, model_name, STORY, max_tokens=16, temperature=1.0, top_p=0.95, seed=99)
    assert first.choices[0].message.content == second.choices[0].message.content


def test_seeded_requests_in_one_batch_match_sequential_ones(client, model_name,
                                                            make_async_client):
    seeds = (21, 22, 23)
    sequential = [complete(client, model_name, SUMMER, max_tokens=12, temperature=1.0,
                           seed=seed).choices[0].text for seed in seeds]

    async def concurrent() -> list[str]:
        async with make_async_client() as aclient:
            responses = await asyncio.gather(*(aclient.completions.create(
                model=model_name, prompt=SUMMER, max_tokens=12, temperature=1.0, seed=seed)
                for seed in seeds))
        return [response.choices[0].text for response in responses]

    assert asyncio.run(concurrent()) == sequential


def test_logit_bias(client, model_name, tokenize):
    hello = single_token_id(tokenize, " hello")
    forced = complete(client, model_name, "The weather today is", max_tokens=4, temperature=0,
                      logit_bias={str(hello): 100})
    assert forced.choices[0].text == " hello" * 4
    assert forced.choices[0].finish_reason == "length"
    assert forced.usage.completion_tokens == 4
    forced_chat = chat(client, model_name, SHORT_ANSWER, max_tokens=4, temperature=0,
                       logit_bias={str(hello): 100})
    assert forced_chat.choices[0].message.content == " hello" * 4
    # -100 bans a token: the counting prompt's greedy continuation starts with " " (alone)
    space = single_token_id(tokenize, " ")
    greedy = complete(client, model_name, COUNTING, max_tokens=6, temperature=0).choices[0].text
    assert greedy.startswith(" 5,")
    banned = complete(client, model_name, COUNTING, max_tokens=6, temperature=0,
                      logit_bias={str(space): -100}).choices[0].text
    assert banned != greedy and not banned.startswith(" 5,"), banned


def test_penalties_change_greedy_output(client, model_name):
    """Greedy counting repeats " ", "," and digits: each penalty must break the pattern
    within 24 tokens (checked against a transformers reference of these semantics)."""
    greedy = complete(client, model_name, COUNTING, max_tokens=24, temperature=0).choices[0].text
    assert greedy.startswith(" 5, 6, 7, 8, 9, 10,")
    for kwargs in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0},
                   {"extra_body": {"repetition_penalty": 1.5}}):
        penalized = complete(client, model_name, COUNTING, max_tokens=24, temperature=0, **kwargs)
        assert penalized.choices[0].text != greedy, kwargs
        assert penalized.usage.completion_tokens <= 24
    # negative penalties (encourage repetition) are valid, on chat too
    encouraged = chat(client, model_name, COUNT_CHAT, max_tokens=8, temperature=0,
                      presence_penalty=-1.0, frequency_penalty=-0.5)
    assert encouraged.choices[0].finish_reason in ("length", "stop")


def test_stop_strings_end_the_text(client, model_name):
    full = chat(client, model_name, COUNT_CHAT, max_tokens=24, temperature=0)
    text = full.choices[0].message.content
    assert len(text) >= 10, text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    expected = text[:text.index(stop)]
    stopped = chat(client, model_name, COUNT_CHAT, max_tokens=24, temperature=0, stop=stop)
    assert stopped.choices[0].message.content == expected
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < full.usage.completion_tokens
    chunks = list(chat(client, model_name, COUNT_CHAT, max_tokens=24, temperature=0,
                       stop=["never appears", stop], stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == expected
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["stop"]
    completion = complete(client, model_name, COUNTING, max_tokens=16, temperature=0,
                          stop=["xyz", " 8"])
    assert completion.choices[0].text == " 5, 6, 7,"
    assert completion.choices[0].finish_reason == "stop"


def test_max_tokens_and_max_completion_tokens(client, model_name):
    by_max_tokens = chat(client, model_name, STORY, max_tokens=6, temperature=0)
    by_max_completion = chat(client, model_name, STORY, max_completion_tokens=6, temperature=0)
    for response in (by_max_tokens, by_max_completion):
        assert response.choices[0].finish_reason == "length"
        assert response.usage.completion_tokens == 6
    assert by_max_tokens.choices[0].message.content == by_max_completion.choices[0].message.content
    chunks = list(chat(client, model_name, STORY, max_completion_tokens=6, temperature=0,
                       stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 6
    assert [c.choices[0].finish_reason for c in chunks
            if c.choices and c.choices[0].finish_reason] == ["length"]


def test_min_tokens_and_ignore_eos_go_past_eos(client, model_name):
    natural = chat(client, model_name, SHORT_ANSWER, max_tokens=24, temperature=0)
    assert natural.choices[0].finish_reason == "stop"
    num_natural = natural.usage.completion_tokens
    assert num_natural < 16, natural
    answer = natural.choices[0].message.content
    exact = chat(client, model_name, SHORT_ANSWER, max_tokens=16, temperature=0,
                 extra_body={"min_tokens": 16})
    assert exact.usage.completion_tokens == 16
    assert exact.choices[0].finish_reason == "length"
    assert exact.choices[0].message.content.startswith(answer)
    at_least = chat(client, model_name, SHORT_ANSWER, max_tokens=24, temperature=0,
                    extra_body={"min_tokens": num_natural + 3})
    assert at_least.usage.completion_tokens >= num_natural + 3
    ignoring = chat(client, model_name, SHORT_ANSWER, max_tokens=16, temperature=0,
                    extra_body={"ignore_eos": True})
    assert ignoring.usage.completion_tokens == 16
    assert ignoring.choices[0].finish_reason == "length"
    assert ignoring.choices[0].message.content.startswith(answer)
    on_completions = complete(client, model_name, COUNTING, max_tokens=5, temperature=0,
                              extra_body={"min_tokens": 5, "ignore_eos": True})
    assert on_completions.usage.completion_tokens == 5


def test_stop_token_ids(client, model_name, tokenize):
    """A stop token ends the sequence with "stop". Whether its own text is shown differs
    between engines (vLLM drops it, like a stop string): either is accepted, nothing after."""
    comma = single_token_id(tokenize, ",")
    stopped = complete(client, model_name, COUNTING, max_tokens=12, temperature=0,
                       extra_body={"stop_token_ids": [comma]})
    assert stopped.choices[0].text in (" 5", " 5,")
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens == 3
    greedy = chat(client, model_name, COUNT_CHAT, max_tokens=8, temperature=0)
    text = greedy.choices[0].message.content
    assert "," in text, text
    on_chat = chat(client, model_name, COUNT_CHAT, max_tokens=8, temperature=0,
                   extra_body={"stop_token_ids": [comma]})
    assert on_chat.choices[0].finish_reason == "stop"
    before = text[:text.index(",")]
    assert on_chat.choices[0].message.content in (before, before + ",")
