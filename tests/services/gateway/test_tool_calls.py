import itertools
import json

import pytest

from shared.grammar import grammar_for
from services.gateway.tool_calls import (
    ToolCallParser, ToolPlan, empty_parameters, finish_reason, new_call_id, plan_tools,
)
from shared.errors import InvalidRequest

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
TOOLS = [WEATHER, TIME]
PARIS = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ZURICH = '<tool_call>{"name":"get_weather","arguments":{"city":"Zürich"}}</tool_call>'


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


def counter_ids():
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def run(plan: ToolPlan, pieces: list[str], make_call_id=None):
    parser = ToolCallParser(plan, make_call_id or counter_ids())
    deltas = [d for piece in pieces for d in parser.feed(piece)] + parser.finish()
    return parser, deltas


def reassemble(deltas: list[dict]) -> tuple[str, list[dict]]:
    """Content and tool calls as a streaming client builds them from the deltas."""
    content, calls = "", {}
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"})
        content += delta.get("content", "")
        for fragment in delta.get("tool_calls", []):
            index = fragment["index"]
            if index not in calls:
                assert fragment["id"].startswith("call_") and fragment["type"] == "function"
                calls[index] = {"id": fragment["id"], "type": "function",
                                "function": {"name": fragment["function"]["name"],
                                             "arguments": ""}}
            else:
                assert set(fragment) == {"index", "function"}
                assert set(fragment["function"]) == {"arguments"}
            calls[index]["function"]["arguments"] += fragment["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)]


def check_consistent(parser: ToolCallParser, deltas: list[dict]) -> None:
    content, calls = reassemble(deltas)
    assert calls == parser.tool_calls
    assert parser.content == (None if calls and not content else content)
    assert parser.has_tool_calls == bool(calls)


# ----------------------------------------------------------------- plan_tools
def test_default_choice_is_auto_with_tools_and_none_without():
    plan = plan_tools(TOOLS, None, None)
    assert plan.mode == "auto" and plan.tools_for_prompt == TOOLS and plan.structured is None
    assert plan.parameters == {"get_weather": WEATHER["function"]["parameters"],
                               "get_time": empty_parameters()}
    assert plan.parallel_tool_calls
    for choice in (None, "none", "auto"):
        assert plan_tools(None, choice, None) == ToolPlan("none")


def test_none_hides_the_tools_from_the_prompt():
    plan = plan_tools(TOOLS, "none", None)
    assert plan.mode == "none" and plan.tools_for_prompt is None and plan.structured is None


@pytest.mark.parametrize("parallel", [None, True, False])
def test_required_constrains_to_an_array_of_calls(parallel):
    plan = plan_tools(TOOLS, "required", parallel)
    assert plan.mode == "required" and plan.tools_for_prompt == TOOLS
    assert plan.structured.kind == "json_schema"
    schema = json.loads(plan.structured.json_schema)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert schema.get("maxItems") == (1 if parallel is False else None)
    weather, time = schema["items"]["anyOf"]
    assert weather["properties"] == {"name": {"const": "get_weather"},
                                     "arguments": WEATHER["function"]["parameters"]}
    assert time["properties"]["arguments"] == empty_parameters()
    assert weather["required"] == ["name", "arguments"]
    assert not weather["additionalProperties"]


def test_required_with_one_tool_needs_no_any_of():
    schema = json.loads(plan_tools([TIME], "required", None).structured.json_schema)
    assert schema["items"]["properties"]["name"] == {"const": "get_time"}


def test_named_constrains_to_the_arguments_object():
    plan = plan_tools(TOOLS, named("get_weather"), None)
    assert plan.mode == "named" and plan.named == "get_weather"
    assert plan.tools_for_prompt == [WEATHER]
    assert json.loads(plan.structured.json_schema) == WEATHER["function"]["parameters"]
    no_parameters = plan_tools(TOOLS, named("get_time"), None)
    assert json.loads(no_parameters.structured.json_schema) == empty_parameters()


def fn(**function) -> dict:
    return {"type": "function", "function": function}


@pytest.mark.parametrize("tools, choice, param", [
    ({"type": "function"}, None, "tools"),
    ([], None, "tools"),
    (["get_weather"], None, "tools[0]"),
    ([{"type": "function", "function": {"name": "f"}, "extra": 1}], None, "tools[0]"),
    ([{"type": "code_interpreter", "function": {"name": "f"}}], None, "tools[0].type"),
    ([{"type": "function"}], None, "tools[0].function"),
    ([fn(name="f", color="red")], None, "tools[0].function"),
    ([fn(description="no name")], None, "tools[0].function.name"),
    ([fn(name="")], None, "tools[0].function.name"),
    ([fn(name="has space")], None, "tools[0].function.name"),
    ([fn(name="a" * 65)], None, "tools[0].function.name"),
    ([fn(name="dé")], None, "tools[0].function.name"),
    ([fn(name=7)], None, "tools[0].function.name"),
    ([WEATHER, TIME, WEATHER], None, "tools[2].function.name"),
    ([fn(name="f", description=3)], None, "tools[0].function.description"),
    ([fn(name="f", parameters="{}")], None, "tools[0].function.parameters"),
    ([fn(name="f", parameters={"type": "string"})], None, "tools[0].function.parameters"),
    ([fn(name="f", strict="yes")], None, "tools[0].function.strict"),
    (TOOLS, "any", "tool_choice"),
    (TOOLS, 1, "tool_choice"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (TOOLS, {"type": "function", "function": {"name": 1}}, "tool_choice"),
    (TOOLS, {"type": "tool", "function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS, {"function": {"name": "get_time"}}, "tool_choice"),
    (TOOLS, named("get_date"), "tool_choice"),
    (None, "required", "tool_choice"),
    (None, named("get_time"), "tool_choice"),
])
def test_plan_errors_name_the_parameter(tools, choice, param):
    with pytest.raises(InvalidRequest) as info:
        plan_tools(tools, choice, None)
    assert info.value.param == param and info.value.status == 400 and info.value.message


BAD_SCHEMA = fn(name="bad", parameters={"type": "object",
                                       "properties": {"a": {"type": "strin"}}})


@pytest.mark.parametrize("choice", ["required", named("bad")])
def test_constrained_modes_refuse_a_schema_the_mask_cannot_enforce(choice):
    with pytest.raises(InvalidRequest) as info:
        plan_tools([TIME, BAD_SCHEMA], choice, None)
    assert info.value.param == "tools[1].function.parameters"
    assert "strin" in info.value.message
    assert plan_tools([TIME, BAD_SCHEMA], "auto", None).mode == "auto"  # auto is unconstrained
    assert plan_tools([TIME, BAD_SCHEMA], named("get_time"), None).mode == "named"


def test_planned_specs_compile_to_grammars():
    for choice in ("required", named("get_weather"), named("get_time")):
        for parallel in (None, False):
            assert grammar_for(plan_tools(TOOLS, choice, parallel).structured)


def test_parallel_tool_calls_must_be_a_boolean():
    with pytest.raises(InvalidRequest) as info:
        plan_tools(TOOLS, None, "yes")
    assert info.value.param == "parallel_tool_calls"


def test_valid_function_fields_are_accepted():
    plan = plan_tools([fn(name="A-z_09", description="d", parameters={}, strict=True),
                       fn(name="b" * 64, parameters={"type": "object"})], "auto", False)
    assert plan.parameters == {"A-z_09": {}, "b" * 64: {"type": "object"}}
    assert not plan.parallel_tool_calls


# ----------------------------------------------------------------- auto mode
AUTO = plan_tools(TOOLS, "auto", None)


@pytest.mark.parametrize("text", ["", "Hello", "Hello, world!\n\n", "a < b <tool and <tool_call",
                                  "  spaces  ", "Ünïcödé 😀 <tool_cal"])
def test_plain_text_passes_through_exactly(text):
    for pieces in ([text], list(text)):
        parser, deltas = run(AUTO, pieces)
        assert parser.content == text and not parser.has_tool_calls
        check_consistent(parser, deltas)


def test_text_that_may_start_the_tag_is_held_back():
    parser = ToolCallParser(AUTO, counter_ids())
    assert parser.feed("Hi <tool") == [{"content": "Hi"}]
    assert parser.feed("box>") == [{"content": " <toolbox>"}]
    assert parser.feed("<") == []
    assert parser.finish() == [{"content": "<"}]


def test_a_call_split_at_every_character_boundary():
    text = f"Let me check.\n{PARIS}\nOne moment."
    whole_parser, whole = run(AUTO, [text])
    expected = [{"id": "call_0", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]
    assert whole_parser.tool_calls == expected
    assert whole_parser.content == "Let me check.\nOne moment."
    for i, j in itertools.combinations(range(1, len(text)), 2):
        parser, deltas = run(AUTO, [text[:i], text[i:j], text[j:]])
        assert parser.tool_calls == expected and parser.content == whole_parser.content
        check_consistent(parser, deltas)
    parser, deltas = run(AUTO, list(text))
    assert reassemble(deltas) == reassemble(whole)


def test_a_call_delta_carries_id_type_and_name_then_the_arguments():
    _, deltas = run(AUTO, [PARIS])
    assert deltas == [
        {"tool_calls": [{"index": 0, "id": "call_0", "type": "function",
                         "function": {"name": "get_weather", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city":"Paris"}'}}]}]


def test_only_calls_give_no_content_and_two_parallel_calls():
    for pieces in ([PARIS + "\n" + ZURICH + "\n"], list(PARIS + "\n\n" + ZURICH)):
        parser, deltas = run(AUTO, pieces)
        assert parser.content is None
        assert [c["function"]["arguments"] for c in parser.tool_calls] == \
            ['{"city":"Paris"}', '{"city":"Zürich"}']  # compact, not ASCII-escaped
        assert [c["id"] for c in parser.tool_calls] == ["call_0", "call_1"]
        check_consistent(parser, deltas)


def test_text_before_between_and_after_calls():
    parser, deltas = run(AUTO, [f"First: {PARIS} then {ZURICH}.\nDone"])
    assert parser.content == "First: then.\nDone"
    assert len(parser.tool_calls) == 2
    check_consistent(parser, deltas)


@pytest.mark.parametrize("block", [
    "<tool_call>{not json}</tool_call>",
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}</tool_call>',
    '<tool_call>{"name": "launch_rocket", "arguments": {}}</tool_call>',  # unknown tool
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',
    '<tool_call>["get_time"]</tool_call>',
    '<tool_call>{"name": "get_weather", "arguments": {"city": "Par',  # unterminated
    "<tool_call>",
])
def test_malformed_blocks_stay_content(block):
    text = f"Before {block} after"
    for pieces in ([text], list(text)):
        parser, deltas = run(AUTO, pieces)
        assert not parser.has_tool_calls and parser.content == text
        check_consistent(parser, deltas)


def test_a_malformed_block_next_to_a_good_call():
    text = f"{PARIS}\n<tool_call>oops</tool_call>"
    parser, deltas = run(AUTO, list(text))
    assert len(parser.tool_calls) == 1 and parser.content == "\n<tool_call>oops</tool_call>"
    check_consistent(parser, deltas)


def test_arguments_as_json_text_or_parameters_key_or_missing():
    for inner in ('{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}',
                  '{"name": "get_weather", "parameters": {"city": "Paris"}}'):
        parser, _ = run(AUTO, [f"<tool_call>{inner}</tool_call>"])
        assert parser.tool_calls[0]["function"]["arguments"] == '{"city":"Paris"}'
    parser, _ = run(AUTO, ['<tool_call>{"name": "get_time"}</tool_call>'])
    assert parser.tool_calls[0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_parallel_false_keeps_later_calls_as_content():
    plan = plan_tools(TOOLS, "auto", False)
    parser, deltas = run(plan, [PARIS + ZURICH])
    assert len(parser.tool_calls) == 1 and parser.content == ZURICH
    check_consistent(parser, deltas)


def test_default_call_ids_are_unique_and_prefixed():
    ids = {new_call_id() for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("call_") and len(i) > 20 for i in ids)
    parser, deltas = run(AUTO, [PARIS, ZURICH, PARIS], make_call_id=new_call_id)
    assert len({c["id"] for c in parser.tool_calls}) == 3
    check_consistent(parser, deltas)


def test_tool_calls_property_is_a_copy():
    parser, _ = run(AUTO, [PARIS])
    parser.tool_calls[0]["function"]["name"] = "x"
    assert parser.tool_calls[0]["function"]["name"] == "get_weather"


# ----------------------------------------------------------------- required / named
REQUIRED = plan_tools(TOOLS, "required", None)
NAMED = plan_tools(TOOLS, named("get_weather"), None)


def test_required_array_parsed_at_every_split():
    text = '[{"name": "get_weather", "arguments": {"city": "P]a}r\\"is{"}}, ' \
           '{"name": "get_time", "arguments": {}}]'
    expected = [("get_weather", '{"city":"P]a}r\\"is{"}'), ("get_time", "{}")]
    for i in range(len(text) + 1):
        parser, deltas = run(REQUIRED, [text[:i], text[i:]])
        assert [(c["function"]["name"], c["function"]["arguments"])
                for c in parser.tool_calls] == expected
        assert parser.content is None
        check_consistent(parser, deltas)


def test_required_emits_each_call_once_it_completes():
    parser = ToolCallParser(REQUIRED, counter_ids())
    assert parser.feed('[{"name": "get_time", "arguments": {}') == []
    first = parser.feed("}, ")
    assert [d["tool_calls"][0]["index"] for d in first] == [0, 0]
    assert parser.feed('{"name": "get_time", "arguments": {}}]')[0]["tool_calls"][0]["index"] == 1
    assert parser.finish() == []


def test_required_truncated_output_keeps_the_rest_as_content():
    text = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "argu'
    parser, deltas = run(REQUIRED, list(text))
    assert len(parser.tool_calls) == 1
    assert parser.content == '{"name": "get_weather", "argu'
    check_consistent(parser, deltas)


@pytest.mark.parametrize("text", ['{"name": "get_time", "arguments": {}}', "Sure!", "[1, 2]",
                                  '[{"name": "nope", "arguments": {}}]', ""])
def test_required_output_that_is_not_calls_is_content(text):
    parser, deltas = run(REQUIRED, [text])
    assert not parser.has_tool_calls
    assert parser.content == text
    check_consistent(parser, deltas)


def test_named_output_is_the_arguments_object():
    text = ' {"city" : "Zürich"}\n'
    for pieces in ([text], list(text)):
        parser, deltas = run(NAMED, pieces)
        assert parser.tool_calls == [{"id": "call_0", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city":"Zürich"}'}}]
        assert parser.content is None
        check_consistent(parser, deltas)


@pytest.mark.parametrize("text", ['{"city": "Par', "Paris", '"Paris"', ""])
def test_named_output_that_is_not_an_object_is_content(text):
    parser, deltas = run(NAMED, [text])
    assert not parser.has_tool_calls and parser.content == text
    check_consistent(parser, deltas)


# ----------------------------------------------------------------- finish_reason
@pytest.mark.parametrize("plan, text, engine, expected", [
    (AUTO, PARIS, "stop", "tool_calls"),
    (AUTO, "plain", "stop", "stop"),
    (AUTO, PARIS, "length", "length"),
    (REQUIRED, '[{"name": "get_time", "arguments": {}}]', "stop", "tool_calls"),
    (REQUIRED, '[{"name": "get_time", "arguments": {', "length", "length"),
    (NAMED, '{"city": "Paris"}', "stop", "stop"),
    (NAMED, '{"city": "Paris"}', "length", "length"),
    (AUTO, PARIS, "abort", "abort"),
])
def test_finish_reason(plan, text, engine, expected):
    parser, _ = run(plan, [text])
    assert finish_reason(plan, parser, engine) == expected


def test_finish_reason_without_a_parser_is_the_engines():
    assert finish_reason(None, None, "stop") == "stop"
    assert finish_reason(plan_tools(None, None, None), None, "length") == "length"


def test_required_stops_at_an_invalid_element_and_keeps_it_as_content():
    text = '[{"name": "get_time", "arguments": {}}, {"name": "nope", "arguments": {}}, ' \
           '{"name": "get_time", "arguments": {}}]'
    parser, deltas = run(REQUIRED, list(text))
    assert len(parser.tool_calls) == 1
    assert parser.content == text[text.index('{"name": "nope"'):]
    check_consistent(parser, deltas)
