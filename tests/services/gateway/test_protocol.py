"""Request validation: OpenAI's parameters and ranges, turned into SamplingParams or a 400
that names the parameter."""

from __future__ import annotations

import pytest

from services.gateway.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from shared.errors import InvalidRequest

VOCAB_SIZE = 1000
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
COMPLETION = {"model": "m", "prompt": "hi"}


def test_every_sampling_parameter_reaches_sampling_params():
    req = parse_request(ChatCompletionRequest, {
        **CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3,
        "presence_penalty": 0.5, "frequency_penalty": -1.0, "repetition_penalty": 1.1,
        "logit_bias": {"5": 10, "7": -100}, "min_tokens": 2, "ignore_eos": True,
        "stop_token_ids": [9], "logprobs": True, "top_logprobs": 4, "n": 3,
        "speculative": False})
    params = req.sampling_params(8, VOCAB_SIZE, logprobs=req.num_logprobs)
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.seed) == \
        (0.5, 0.9, 7, 0.1, 3)
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == \
        (0.5, -1.0, 1.1)
    assert params.logit_bias == {5: 10.0, 7: -100.0}
    assert (params.min_tokens, params.ignore_eos, params.stop_token_ids) == (2, True, [9])
    assert params.logprobs == 4 and req.n == 3 and params.speculative is False


def test_defaults_are_no_ops():
    params = parse_request(CompletionRequest, COMPLETION).sampling_params(16, VOCAB_SIZE)
    assert not params.has_penalties and params.logit_bias == {} and params.min_p == 0.0
    assert params.logprobs is None and params.prompt_logprobs is None and params.speculative


@pytest.mark.parametrize("model, extra, param", [
    (ChatCompletionRequest, {"top_logprobs": 2}, "top_logprobs"),
    (ChatCompletionRequest, {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    (CompletionRequest, {"logprobs": 6}, "logprobs"),
    (CompletionRequest, {"n": 0}, "n"),
    (CompletionRequest, {"n": 3, "best_of": 2}, "best_of"),
    (CompletionRequest, {"best_of": 2, "stream": True}, "best_of"),
    (ChatCompletionRequest, {"min_p": 1.5}, "min_p"),
    (ChatCompletionRequest, {"repetition_penalty": 0}, "repetition_penalty"),
    (ChatCompletionRequest, {"logit_bias": {"x": 1}}, "logit_bias"),
    (ChatCompletionRequest, {"stop_token_ids": [-1]}, "stop_token_ids.0"),
    (ChatCompletionRequest, {"logit_bias": {"1": 101}}, "logit_bias"),
    (ChatCompletionRequest, {"messages": [{"role": "tool", "content": "1"}]},
     "messages.0.tool.tool_call_id"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]},
     "messages.0.user"),
])
def test_invalid_combinations_name_the_parameter(model, extra, param):
    base = CHAT if model is ChatCompletionRequest else COMPLETION
    with pytest.raises(InvalidRequest) as error:
        parse_request(model, {**base, **extra})
    assert error.value.param == param


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {str(VOCAB_SIZE): 1}}, "logit_bias"),
    ({"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids"),
    ({"min_tokens": 9}, "min_tokens"),
])
def test_values_checked_against_the_model(extra, param):
    req = parse_request(ChatCompletionRequest, {**CHAT, **extra})
    with pytest.raises(InvalidRequest) as error:
        req.sampling_params(8, VOCAB_SIZE)
    assert error.value.param == param


def test_best_of_sequences_and_assistant_tool_calls():
    assert parse_request(CompletionRequest, {**COMPLETION, "n": 2, "best_of": 5}).num_sequences == 5
    req = parse_request(ChatCompletionRequest, {**CHAT, "messages": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]})
    assistant, tool = req.messages[1].to_message(), req.messages[2].to_message()
    assert assistant.tool_calls[0].function.name == "get_weather" and assistant.content is None
    assert tool.tool_call_id == "call_1"


# A token-id prompt is checked in C when every id is valid; anything else takes pydantic's
# union, so its value and its error read exactly as they did before.
@pytest.mark.parametrize("prompt, expected", [
    ([1, 2, 3], [1, 2, 3]),
    ([0, 2**31 - 1], [0, 2**31 - 1]),
    ([1, 2.0], [1, 2]),  # an integral float is an integer
    ([[1, 2.0], [3]], [[1, 2], [3]]),  # a batch of token-id prompts
    (["a", "b"], ["a", "b"]),
    (list(range(20_000)), list(range(20_000))),
])
def test_token_id_prompts_take_their_values(prompt, expected):
    req = parse_request(CompletionRequest, {**COMPLETION, "prompt": prompt})
    assert req.prompt == expected and all(type(t) is int for t in req.prompts[0]
                                          if not isinstance(t, (str, list)))


@pytest.mark.parametrize("prompt", [
    [2**31], [-1], [1, True], [True], [1, 2.5], [1, "2"], [1, None], [1, [2]], [1, {"a": 1}],
    [2**63], [[1, -1]], [3] * 16_000 + [-5], [1, "a", 2],
])
def test_invalid_token_id_prompts_keep_the_unions_error(prompt):
    with pytest.raises(InvalidRequest) as error:
        parse_request(CompletionRequest, {**COMPLETION, "prompt": prompt})
    assert (error.value.message, error.value.param) == \
        ("prompt.str: Input should be a valid string", "prompt.str")
