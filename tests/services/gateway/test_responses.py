"""/v1/responses without a stack: request validation and its plan over the chat path
(messages, tools, text.format, refusals)."""

from __future__ import annotations

import json

import pytest

from services.gateway.responses import chat_messages, echo_fields, plan_response, sampling_params
from services.gateway.responses_schema import ResponsesRequest, parse_request
from shared.errors import InvalidRequest
from shared.messages import GenerationDefaults

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"], "additionalProperties": False},
           "strict": True}


def request(**fields) -> ResponsesRequest:
    return parse_request({"model": "m", "input": "Hi", **fields})


def refusal(**fields) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        plan_response(request(**fields))
    return caught.value


def test_text_input_is_one_user_message_after_the_instructions():
    plan = plan_response(request(instructions="Be brief."))
    assert [(m.role, m.content) for m in plan.messages] == [("system", "Be brief."),
                                                            ("user", "Hi")]
    assert plan.tool_plan.mode == "none" and plan.structured is None
    assert plan.num_logprobs is None


def test_agents_sdk_second_turn_becomes_a_tool_conversation():
    """The items an agent sends after running a tool: the user's message, the model's call
    (echoed with its id and status) and the tool's output."""
    req = request(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city":"Paris"}', "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather",
         "arguments": '{"city":"Rome"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "call_2",
         "output": [{"type": "input_text", "text": "Rain"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
    ], tools=[WEATHER])
    messages = chat_messages(req)
    assert [m.role for m in messages] == ["user", "assistant", "tool", "tool"]
    assistant = messages[1]
    assert assistant.content == "Let me look."
    assert [(c.id, c.function.name, c.function.arguments) for c in assistant.tool_calls] == [
        ("call_1", "get_weather", '{"city":"Paris"}'), ("call_2", "get_weather", '{"city":"Rome"}')]
    assert [(m.tool_call_id, m.content) for m in messages[2:]] == [("call_1", "Sunny"),
                                                                   ("call_2", "Rain")]


def test_a_call_with_no_assistant_text_is_its_own_turn():
    messages = chat_messages(request(input=[
        {"role": "user", "content": "x"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}]))
    assert messages[1].role == "assistant" and messages[1].content is None
    assert messages[1].tool_calls[0].id == "c"


def test_flat_function_tools_plan_like_chat_tools():
    plan = plan_response(request(tools=[WEATHER], tool_choice="required"))
    assert plan.tool_plan.mode == "required"
    assert plan.tool_plan.tools_for_prompt == [{"type": "function", "function": {
        key: WEATHER[key] for key in ("name", "description", "parameters", "strict")}}]
    assert json.loads(plan.structured.json_schema)["type"] == "array"
    named = plan_response(request(tools=[WEATHER],
                                  tool_choice={"type": "function", "name": "get_weather"}))
    assert named.tool_plan.mode == "named" and named.tool_plan.named == "get_weather"
    assert json.loads(named.structured.json_schema) == WEATHER["parameters"]
    assert plan_response(request(tools=[WEATHER])).tool_plan.mode == "auto"


def test_allowed_tools_keep_the_named_tools_in_their_mode():
    other = {**WEATHER, "name": "get_time"}
    plan = plan_response(request(tools=[WEATHER, other], tool_choice={
        "type": "allowed_tools", "mode": "required",
        "tools": [{"type": "function", "name": "get_time"}]}))
    assert plan.tool_plan.mode == "required"
    assert [t["function"]["name"] for t in plan.tool_plan.tools_for_prompt] == ["get_time"]
    assert set(plan.tool_plan.parameters) == {"get_time"}


def test_text_format_json_schema_constrains_the_output():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    plan = plan_response(request(text={"format": {"type": "json_schema", "name": "count",
                                                  "schema": schema, "strict": True}}))
    assert plan.structured.kind == "json_schema"
    assert json.loads(plan.structured.json_schema) == schema
    assert plan_response(request(text={"format": {"type": "json_object"}})).structured.kind \
        == "json_object"
    assert plan_response(request(text={"format": {"type": "text"}})).structured is None


def test_logprobs_come_with_include():
    assert plan_response(request(top_logprobs=3)).num_logprobs is None
    assert plan_response(request(include=["message.output_text.logprobs"], top_logprobs=3)
                         ).num_logprobs == 3
    assert plan_response(request(include=["message.output_text.logprobs"])).num_logprobs == 0


@pytest.mark.parametrize("fields", [
    {"store": False}, {"store": None}, {"metadata": {"k": "v"}}, {"user": "u"},
    {"safety_identifier": "s"}, {"prompt_cache_key": "k"}, {"service_tier": "auto"},
    {"reasoning": {"effort": "low"}}, {"truncation": "disabled"}, {"background": False},
    {"include": ["reasoning.encrypted_content"]},
    {"stream_options": {"include_obfuscation": False}},
    {"text": {"verbosity": "low"}}, {"parallel_tool_calls": False},
])
def test_no_op_parameters_are_accepted(fields):
    plan_response(request(**fields))


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"background": True}, "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_file", "file_id": "f"}]}]},
     "input[0].content[1]"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "a"},
                                             {"type": "input_image", "file_id": "f"}]}]},
     "input[0].content[1]"),
    ({"input": [{"type": "web_search_call", "id": "ws"}]}, "input[0]"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": []}, "input"),
    ({"instructions": "only this", "input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "name": "no spaces"}]}, "tools[0].name"),
    ({"tools": [{**WEATHER, "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto",
                                          "tools": [{"type": "function", "name": "nope"}]}},
     "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "none",
                                          "tools": [{"type": "function", "name": "nope"}]}},
     "tool_choice.mode"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "bad name", "schema": {}}}},
     "text.format"),
    ({"text": {"format": {"type": "xml"}}}, "text.format"),
    ({"temperature": 3}, "temperature"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"include": ["everything"]}, "include[0]"),
    ({"stream": "yes"}, "stream"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
])
def test_refused_with_the_parameter_named(fields, param):
    error = refusal(**fields)
    assert error.status == 400 and error.param == param, error.message
    if param == "previous_response_id":
        assert "keeps no responses" in error.message
    if param in ("store", "background"):  # (a gateway without the response store)
        assert "needs the response store" in error.message


@pytest.mark.parametrize("fields", [{"store": True}, {"background": True},
                                    {"store": True, "background": True, "stream": True}])
def test_store_and_background_are_honoured_with_the_response_store(fields):
    req = request(**fields)
    plan_response(req, store_available=True)
    echo = echo_fields(req, sampling_params(req, plan_response(req, store_available=True), 8))
    assert echo["store"] is (fields.get("store") is True)
    assert echo["background"] is (fields.get("background") is True)


def test_sampling_takes_the_model_defaults_where_the_request_is_silent():
    defaults = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=50, min_p=0.05,
                                  repetition_penalty=1.1)
    req = request(temperature=0.2)
    sampling = sampling_params(req, plan_response(req), 8, defaults)
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p,
            sampling.repetition_penalty, sampling.max_tokens) == (0.2, 0.9, 50, 0.05, 1.1, 8)
    req = request()
    bare = sampling_params(req, plan_response(req), 8)
    assert (bare.temperature, bare.top_p, bare.top_k) == (1.0, 1.0, 0)
    req = request(temperature=1e-9)
    assert sampling_params(req, plan_response(req), 8).temperature == 0.0


def test_echo_repeats_the_settings():
    req = request(tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
                  temperature=0, text={"format": {"type": "json_schema", "name": "n",
                                                  "schema": {}}})
    echo = echo_fields(req, sampling_params(req, plan_response(req), 8))
    assert echo["tools"] == [WEATHER]
    assert echo["tool_choice"] == {"type": "function", "name": "get_weather"}
    assert echo["temperature"] == 0 and echo["store"] is False
    assert echo["text"]["format"] == {"type": "json_schema", "name": "n", "schema": {}}


def test_unknown_parameters_are_refused_unless_the_gateway_accepts_them():
    with pytest.raises(InvalidRequest) as caught:
        parse_request({"model": "m", "input": "Hi", "vendor_extension": 1})
    assert caught.value.param == "vendor_extension"
    assert parse_request({"model": "m", "input": "Hi", "vendor_extension": 1},
                         accept_unknown_fields=True).input == "Hi"


def test_input_images_become_image_parts_in_order():
    plan = plan_response(request(input=[{"role": "user", "content": [
        {"type": "input_text", "text": "compare"},
        {"type": "input_image", "image_url": "data:image/png;base64,AAAA", "detail": "low"},
        {"type": "input_image", "image_url": "https://example.com/b.png"}]}]))
    assert plan.image_urls == ["data:image/png;base64,AAAA", "https://example.com/b.png"]
    (message,) = [m for m in plan.messages if m.role == "user"]
    assert [(p.type, p.text) for p in message.parts] == [("text", "compare"), ("image", ""),
                                                          ("image", "")]
    assert message.content == "compare"
