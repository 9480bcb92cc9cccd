"""Usage (token counts, cached tokens, the streamed usage chunk) and OpenAI-shaped errors.
The last test checks the server still serves after every bad request before it."""

from __future__ import annotations

import uuid

import openai
import pytest

from tests.conformance.helpers import error_body, expect_400

pytestmark = pytest.mark.integration

STORY = [{"role": "user", "content": "Write a long story about a dragon."}]
SUMMER = "The best thing about summer is"
BLOCK_SIZE = 16


def test_usage_counts_match_the_tokenizer(client, model_name, tokenize):
    response = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                              max_tokens=5)
    usage = response.usage
    assert usage.prompt_tokens == len(tokenize(messages=STORY))
    assert usage.completion_tokens == 5
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert usage.prompt_tokens_details.cached_tokens >= 0
    completion = client.completions.create(model=model_name, prompt=SUMMER, temperature=0,
                                           max_tokens=5)
    usage = completion.usage
    assert usage.prompt_tokens == len(tokenize(prompt=SUMMER))
    assert (usage.completion_tokens, usage.total_tokens) == (5, usage.prompt_tokens + 5)
    system = [{"role": "system", "content": "You are terse."}] + STORY
    with_system = client.chat.completions.create(model=model_name, messages=system,
                                                 temperature=0, max_tokens=1)
    assert with_system.usage.prompt_tokens == len(tokenize(messages=system))


def _long_prompt() -> str:
    words = " ".join(f"item{i}" for i in range(80))
    return f"Session {uuid.uuid4().hex}. Read this list and say which item is last: {words}."


def test_prefix_cache_reports_cached_tokens(client, model_name):
    prompt = _long_prompt()
    first = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                      max_tokens=1)
    second = client.completions.create(model=model_name, prompt=prompt, temperature=0,
                                       max_tokens=1)
    num_prompt = first.usage.prompt_tokens
    assert num_prompt >= 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0  # a fresh prompt
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached < num_prompt and cached % BLOCK_SIZE == 0
    assert cached >= num_prompt - 2 * BLOCK_SIZE  # all its full blocks but the last token's
    messages = [{"role": "user", "content": _long_prompt()}]
    chat_first = client.chat.completions.create(model=model_name, messages=messages,
                                                temperature=0, max_tokens=1)
    chat_second = client.chat.completions.create(model=model_name, messages=messages,
                                                 temperature=0, max_tokens=1)
    assert chat_second.usage.prompt_tokens_details.cached_tokens > \
        chat_first.usage.prompt_tokens_details.cached_tokens
    chunks = list(client.chat.completions.create(
        model=model_name, messages=messages, temperature=0, max_tokens=1, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == \
        chat_second.usage.prompt_tokens_details.cached_tokens


def test_streamed_usage_chunk(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                          max_tokens=6)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=STORY, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens,
            chunks[-1].usage.total_tokens) == (full.usage.prompt_tokens, 6,
                                               full.usage.prompt_tokens + 6)
    assert all(chunk.usage is None for chunk in chunks[:-1])
    assert all(chunk.choices for chunk in chunks[:-1])
    assert all(chunk.id == chunks[0].id for chunk in chunks)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    no_usage = list(client.chat.completions.create(model=model_name, messages=STORY,
                                                   temperature=0, max_tokens=6, stream=True))
    assert all(chunk.usage is None and chunk.choices for chunk in no_usage)
    completion_chunks = list(client.completions.create(
        model=model_name, prompt=SUMMER, temperature=0, max_tokens=6, stream=True,
        stream_options={"include_usage": True}))
    assert completion_chunks[-1].choices == []
    assert completion_chunks[-1].usage.completion_tokens == 6
    assert all(chunk.usage is None for chunk in completion_chunks[:-1])


def test_finish_reasons(client, model_name):
    natural = client.chat.completions.create(
        model=model_name, temperature=0, max_tokens=32,
        messages=[{"role": "user", "content": "What color is the sky? One word."}])
    assert natural.choices[0].finish_reason == "stop"
    assert natural.usage.completion_tokens < 32
    cut = client.completions.create(model=model_name, prompt=SUMMER, temperature=0, max_tokens=3)
    assert cut.choices[0].finish_reason == "length"


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list()
    assert [model.id for model in models.data] == [model_name]
    assert models.data[0].object == "model"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]

CHAT_ERRORS = [  # (id, request arguments, the param named, the code if it is pinned)
    ("unknown-parameter", {"extra_body": {"foo_bar": 1}}, "foo_bar", None),
    ("temperature-3", {"temperature": 3}, "temperature", None),
    ("top-p-over-1", {"top_p": 1.5}, "top_p", None),
    ("presence-penalty-over-2", {"presence_penalty": 2.5}, "presence_penalty", None),
    ("top-logprobs-without-logprobs", {"top_logprobs": 2}, "top_logprobs", None),
    ("top-logprobs-21", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", None),
    ("n-0", {"n": 0}, "n", None),
    ("logit-bias-key-not-int", {"logit_bias": {"abc": 1}}, "logit_bias", None),
    ("logit-bias-key-out-of-vocab", {"logit_bias": {"100000000": 1}}, "logit_bias", None),
    ("logit-bias-value-over-100", {"logit_bias": {"5": 150}}, "logit_bias", None),
    ("tool-choice-unknown-tool", {"tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "no_such_tool"}}}, "tool_choice", None),
    ("tool-choice-required-without-tools", {"tool_choice": "required"},
     ("tool_choice", "tools"), None),
    ("tool-without-function", {"tools": [{"type": "function"}]}, "tools", None),
    ("bad-response-format", {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": 5}}}}, "response_format", None),
    ("max-tokens-over-context", {"max_tokens": 100_000}, "max_tokens", "context_length_exceeded"),
    ("min-tokens-over-max-tokens", {"max_tokens": 4, "extra_body": {"min_tokens": 8}},
     "min_tokens", None),
    ("stop-token-id-out-of-vocab", {"extra_body": {"stop_token_ids": [10**8]}},
     "stop_token_ids", None),
    ("stream-options-without-stream", {"stream_options": {"include_usage": True}},
     "stream_options", None),
]
COMPLETION_ERRORS = [
    ("logprobs-6", {"logprobs": 6}, "logprobs", None),
    ("n-0", {"n": 0}, "n", None),
    ("best-of-under-n", {"best_of": 1, "n": 2}, ("best_of", "n"), None),
    ("best-of-with-stream", {"best_of": 2, "stream": True}, ("best_of", "stream"), None),
    ("temperature-negative", {"temperature": -1}, "temperature", None),
    ("logit-bias-key-not-int", {"logit_bias": {"abc": 1}}, "logit_bias", None),
    ("max-tokens-over-context", {"max_tokens": 100_000}, "max_tokens", "context_length_exceeded"),
]


@pytest.mark.parametrize("arguments, param, code", [case[1:] for case in CHAT_ERRORS],
                         ids=[case[0] for case in CHAT_ERRORS])
def test_chat_errors_are_400(client, model_name, arguments, param, code):
    arguments = {"max_tokens": 4, **arguments}
    expect_400(lambda: client.chat.completions.create(model=model_name, messages=STORY,
                                                      **arguments), param, code)


@pytest.mark.parametrize("arguments, param, code", [case[1:] for case in COMPLETION_ERRORS],
                         ids=[case[0] for case in COMPLETION_ERRORS])
def test_completion_errors_are_400(client, model_name, arguments, param, code):
    arguments = {"max_tokens": 4, **arguments}
    expect_400(lambda: client.completions.create(model=model_name, prompt=SUMMER, **arguments),
               param, code)


def test_unknown_model_is_404(client):
    for call in (lambda: client.chat.completions.create(model="no-such-model", messages=STORY,
                                                        max_tokens=4),
                 lambda: client.completions.create(model="no-such-model", prompt=SUMMER,
                                                   max_tokens=4)):
        with pytest.raises(openai.NotFoundError) as caught:
            call()
        assert caught.value.status_code == 404
        error = error_body(caught.value)
        assert error["param"] == "model"
        assert error["code"] == "model_not_found"


def test_the_server_still_serves_after_the_errors(client, model_name):
    response = client.chat.completions.create(model=model_name, messages=STORY, temperature=0,
                                              max_tokens=4)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 4
