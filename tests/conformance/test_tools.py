"""Tool calling on chat: tool_choice required / named / none / auto, streaming fragments,
and a follow-up turn that carries the tool's result."""

from __future__ import annotations

import json
from collections import defaultdict

import jsonschema
import pytest

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string"},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}},
                   "required": ["timezone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
MAX_TOKENS = 100


def check_calls(tool_calls, names=tuple(PARAMETERS)) -> list[tuple[str, dict]]:
    """Every call well-formed; returns (name, arguments) per call."""
    assert tool_calls, "no tool calls"
    calls = []
    for call in tool_calls:
        assert call.id.startswith("call_") and len(call.id) > len("call_"), call.id
        assert call.type == "function"
        assert call.function.name in names, call.function.name
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, PARAMETERS[call.function.name])
        calls.append((call.function.name, arguments))
    assert len({call.id for call in tool_calls}) == len(tool_calls)
    return calls


@pytest.fixture(scope="module")
def required(client, model_name):
    """tool_choice "required", greedy: one response two tests check."""
    return client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                          tool_choice="required", temperature=0,
                                          max_tokens=MAX_TOKENS)


def test_required_tool_choice(client, model_name, required):
    choice = required.choices[0]
    check_calls(choice.message.tool_calls)
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    assert choice.message.role == "assistant"
    single = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                            tool_choice="required", parallel_tool_calls=False,
                                            temperature=0, max_tokens=MAX_TOKENS)
    assert len(check_calls(single.choices[0].message.tool_calls)) == 1
    assert single.choices[0].finish_reason == "tool_calls"


def test_named_tool_choice(client, model_name):
    """Forcing the tool the question does not call for shows the choice is honoured."""
    response = client.chat.completions.create(
        model=model_name, messages=QUESTION, tools=TOOLS, temperature=0, max_tokens=MAX_TOKENS,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    choice = response.choices[0]
    calls = check_calls(choice.message.tool_calls, names=("get_time",))
    assert len(calls) == 1
    assert choice.finish_reason == "stop"  # as OpenAI answers a named tool_choice
    assert not choice.message.content


def test_streamed_tool_calls_reassemble(client, model_name, required):
    expected = check_calls(required.choices[0].message.tool_calls)
    chunks = list(client.chat.completions.create(
        model=model_name, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0,
        max_tokens=MAX_TOKENS, stream=True))
    calls: dict[int, dict] = {}
    arguments: dict[int, str] = defaultdict(str)
    finishes = []
    for chunk in chunks:
        for choice in chunk.choices:
            if choice.finish_reason:
                finishes.append(choice.finish_reason)
            assert not choice.delta.content
            for fragment in choice.delta.tool_calls or []:
                if fragment.index not in calls:  # the first fragment names the call
                    assert fragment.id and fragment.id.startswith("call_")
                    assert fragment.type == "function"
                    assert fragment.function.name in PARAMETERS
                    calls[fragment.index] = {"id": fragment.id, "name": fragment.function.name}
                else:  # later ones only carry argument text
                    assert fragment.id is None
                    assert fragment.function.name is None
                arguments[fragment.index] += fragment.function.arguments or ""
    assert finishes == ["tool_calls"]
    assert sorted(calls) == list(range(len(calls)))
    streamed = [(calls[i]["name"], json.loads(arguments[i])) for i in sorted(calls)]
    assert streamed == expected
    for (name, args) in streamed:
        jsonschema.validate(args, PARAMETERS[name])


def test_tool_choice_none_answers_in_text(client, model_name):
    response = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                              tool_choice="none", temperature=0, max_tokens=16)
    choice = response.choices[0]
    assert not choice.message.tool_calls
    assert isinstance(choice.message.content, str) and choice.message.content
    assert choice.finish_reason in ("stop", "length")


def test_auto_tool_choice_is_well_formed(client, model_name):
    """A small model may or may not call a tool; either way the answer is well-formed."""
    response = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                              tool_choice="auto", temperature=0,
                                              max_tokens=MAX_TOKENS)
    choice = response.choices[0]
    if choice.message.tool_calls:
        check_calls(choice.message.tool_calls)
        assert choice.finish_reason == "tool_calls"
    else:
        assert isinstance(choice.message.content, str)
        assert choice.finish_reason in ("stop", "length")


def test_follow_up_with_the_tool_result(client, model_name):
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    messages = QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_abc123", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_abc123",
         "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    response = client.chat.completions.create(model=model_name, messages=messages, tools=TOOLS,
                                              tool_choice="none", temperature=0, max_tokens=24)
    choice = response.choices[0]
    assert isinstance(choice.message.content, str) and choice.message.content
    assert not choice.message.tool_calls
    # the conversation with the tool turn is longer than the question alone
    alone = client.chat.completions.create(model=model_name, messages=QUESTION, tools=TOOLS,
                                           tool_choice="none", temperature=0, max_tokens=1)
    assert response.usage.prompt_tokens > alone.usage.prompt_tokens
