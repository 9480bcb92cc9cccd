"""logprobs: chat (logprobs + top_logprobs, streaming too) and completions (logprobs=k,
echo)."""

from __future__ import annotations

import math

import pytest

pytestmark = pytest.mark.integration

STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
SUMMER = "The best thing about summer is"
TOLERANCE = 1e-4


def check_bytes(entry) -> None:
    """``bytes`` are the token's UTF-8 bytes; a token that is part of a character may show
    them in its text some other way."""
    assert isinstance(entry.bytes, list)
    try:
        text = bytes(entry.bytes).decode("utf-8")
    except UnicodeDecodeError:
        return
    assert text == entry.token


def check_chat_entry(entry, num_top: int, greedy: bool) -> None:
    assert isinstance(entry.token, str)
    assert entry.logprob <= 0.0 and math.isfinite(entry.logprob)
    check_bytes(entry)
    assert len(entry.top_logprobs) == num_top
    top = [alt.logprob for alt in entry.top_logprobs]
    assert top == sorted(top, reverse=True)
    assert all(value <= 0.0 for value in top)
    for alt in entry.top_logprobs:
        check_bytes(alt)
    if greedy and num_top:
        assert entry.top_logprobs[0].token == entry.token
        assert abs(entry.top_logprobs[0].logprob - entry.logprob) < TOLERANCE
    if num_top:
        assert entry.logprob <= entry.top_logprobs[0].logprob + TOLERANCE


def test_chat_logprobs_with_top_logprobs(client, model_name):
    response = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                              max_tokens=12, logprobs=True, top_logprobs=3)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 12
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        check_chat_entry(entry, 3, greedy=True)
    # logprobs alone: the chosen tokens, no alternatives; same tokens and values
    plain = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                           max_tokens=12, logprobs=True)
    assert [e.token for e in plain.choices[0].logprobs.content] == [e.token for e in content]
    for entry, reference in zip(plain.choices[0].logprobs.content, content):
        assert entry.top_logprobs == []
        assert abs(entry.logprob - reference.logprob) < TOLERANCE
    # without logprobs, none come back
    without = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                             max_tokens=4)
    assert without.choices[0].logprobs is None


def test_chat_logprobs_when_sampling(client, model_name):
    response = client.chat.completions.create(model=model_name, messages=STORY, temperature=1.0,
                                              top_p=0.9, seed=4, max_tokens=12, logprobs=True,
                                              top_logprobs=20, n=2)
    for choice in response.choices:
        content = choice.logprobs.content
        assert "".join(entry.token for entry in content) == choice.message.content
        for entry in content:
            check_chat_entry(entry, 20, greedy=False)
    assert sum(len(c.logprobs.content) for c in response.choices) == \
        response.usage.completion_tokens


def test_chat_streaming_logprobs(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                          max_tokens=12, logprobs=True, top_logprobs=2)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=STORY, temperature=0, max_tokens=12, logprobs=True,
        top_logprobs=2, stream=True))
    streamed = []
    for chunk in chunks:
        choice = chunk.choices[0]
        if choice.logprobs is None or not choice.logprobs.content:
            assert not choice.delta.content  # text comes with the logprobs of its tokens
            continue
        assert "".join(e.token for e in choice.logprobs.content) == choice.delta.content
        streamed.extend(choice.logprobs.content)
    assert [e.token for e in streamed] == [e.token for e in full.choices[0].logprobs.content]
    for entry, reference in zip(streamed, full.choices[0].logprobs.content):
        check_chat_entry(entry, 2, greedy=True)
        assert abs(entry.logprob - reference.logprob) < TOLERANCE


def check_completion_logprobs(logprobs, text: str, k: int, greedy: bool, first: int = 0) -> None:
    """Entries from ``first`` on (the generated ones when echo put the prompt first)."""
    n = len(logprobs.tokens)
    assert len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == \
        len(logprobs.text_offset) == n
    assert "".join(logprobs.tokens) == text
    for i in range(n - 1):
        assert logprobs.text_offset[i + 1] - logprobs.text_offset[i] == len(logprobs.tokens[i])
    for i in range(first, n):
        token, value, top = logprobs.tokens[i], logprobs.token_logprobs[i], logprobs.top_logprobs[i]
        assert value <= 0.0
        # OpenAI gives k alternatives and may add the chosen token (k + 1)
        assert k <= len(top) <= k + 1, top
        assert all(v <= 0.0 for v in top.values())
        if token in top:
            assert abs(top[token] - value) < TOLERANCE
        if greedy and k:
            assert max(top.values()) == pytest.approx(value, abs=TOLERANCE)
            assert token in top


def test_completions_logprobs(client, model_name):
    response = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                         max_tokens=10, logprobs=3)
    choice = response.choices[0]
    assert len(choice.logprobs.tokens) == response.usage.completion_tokens == 10
    check_completion_logprobs(choice.logprobs, choice.text, 3, greedy=True)
    assert choice.logprobs.text_offset[0] in (0, len(SUMMER))
    sampled = client.completions.create(model=model_name, prompt=SUMMER, temperature=1.0, seed=8,
                                        max_tokens=10, logprobs=5)
    check_completion_logprobs(sampled.choices[0].logprobs, sampled.choices[0].text, 5,
                              greedy=False)
    chosen_only = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                            max_tokens=10, logprobs=0)
    logprobs = chosen_only.choices[0].logprobs
    assert logprobs.tokens == choice.logprobs.tokens
    assert logprobs.token_logprobs == pytest.approx(choice.logprobs.token_logprobs, abs=TOLERANCE)


def test_completions_streaming_logprobs(client, model_name):
    full = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                     max_tokens=10, logprobs=2)
    tokens, values = [], []
    for chunk in client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                           max_tokens=10, logprobs=2, stream=True):
        choice = chunk.choices[0]
        if choice.logprobs is not None and choice.logprobs.tokens:
            assert "".join(choice.logprobs.tokens) == choice.text
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs
    assert tokens == full.choices[0].logprobs.tokens
    assert values == pytest.approx(full.choices[0].logprobs.token_logprobs, abs=TOLERANCE)


def test_completions_echo(client, model_name, tokenize):
    plain = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                      max_tokens=6)
    echoed = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                       max_tokens=6, echo=True)
    assert echoed.choices[0].text == SUMMER + plain.choices[0].text
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    with_logprobs = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                              max_tokens=6, echo=True, logprobs=1)
    choice = with_logprobs.choices[0]
    num_prompt = len(tokenize(prompt=SUMMER))
    assert with_logprobs.usage.prompt_tokens == num_prompt
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == num_prompt + 6
    assert choice.text == SUMMER + plain.choices[0].text
    assert "".join(logprobs.tokens[:num_prompt]) == SUMMER
    assert logprobs.text_offset[0] == 0
    assert logprobs.token_logprobs[0] is None  # nothing predicts the first prompt token
    assert not logprobs.top_logprobs[0]
    assert all(value <= 0.0 for value in logprobs.token_logprobs[1:])
    check_completion_logprobs(logprobs, choice.text, 1, greedy=True, first=num_prompt)
    for i in range(1, num_prompt):  # prompt tokens: k alternatives (+ the actual token)
        assert 1 <= len(logprobs.top_logprobs[i]) <= 2
