"""/v1/responses output without a stack: the response object and stream events built from
deltas, checked against the official openai SDK's own types and against each other."""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent

from services.gateway.choices import ChatChoice
from services.gateway.generation import Generation
from services.gateway.responses import echo_fields, plan_response, sampling_params
from services.gateway.responses_output import responses_shape
from services.gateway.responses_schema import ResponseObject, parse_request
from services.gateway.streams import Delta, RequestStream, TokenLogprob, TokenText
from shared.messages import ErrorInfo

WEATHER = {"type": "function", "name": "get_weather",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)


def run(deltas: list[Delta], stream: bool, **fields):
    """The gathered body, or the parsed stream events, for ``deltas`` of one request."""
    req = parse_request({"model": "m", "input": "Hi", **fields})
    plan = plan_response(req)
    ids = iter(f"call_{i}" for i in range(10))
    choice = ChatChoice(0, plan.num_logprobs, plan.tool_plan, lambda: next(ids))
    generation = Generation("responses", "resp_1", "m", [choice], [RequestStream("r", None)],
                            num_prompt_tokens=7, num_returned=1)
    shape = responses_shape(echo_fields(req, sampling_params(req, plan, 16)))

    async def source():
        for delta in deltas:
            yield 0, delta

    async def collect():
        if not stream:
            return await shape.gather(generation, source())
        return [chunk async for chunk in shape.events(generation, source())]

    result = asyncio.run(collect())
    return result if not stream else parse_events(b"".join(result))


def parse_events(raw: bytes) -> list[dict]:
    events = []
    for block in raw.decode().removesuffix("\n\n").split("\n\n"):
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == "event: " + data["type"]
        EVENTS.validate_python(data)  # the SDK's own event types
        events.append(data)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def check_body(body: dict) -> Response:
    ResponseObject.model_validate(body)  # what /openapi.json publishes
    return Response.model_validate(body)


TEXT = [Delta("The capital", 2), Delta(" is Paris.", 3, "stop")]


def test_text_response():
    body = run(TEXT, stream=False)
    response = check_body(body)
    assert response.status == "completed" and response.output_text == "The capital is Paris."
    assert body["usage"] == {"input_tokens": 7, "output_tokens": 5, "total_tokens": 12,
                             "input_tokens_details": {"cached_tokens": 0,
                                                      "cache_write_tokens": 0},
                             "output_tokens_details": {"reasoning_tokens": 0}}
    assert body["store"] is False and body["id"] == "resp_1"


def test_text_stream_events_in_openai_order():
    events = run(TEXT, stream=True)
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert events[0]["response"]["status"] == "in_progress"
    assert events[0]["response"]["output"] == []
    assert events[2]["item"]["content"] == [] and events[2]["item"]["status"] == "in_progress"
    assert "".join(e["delta"] for e in events if e["type"].endswith(".delta")) == \
        "The capital is Paris."
    final = events[-1]["response"]
    check_body(final)
    gathered = run(TEXT, stream=False)
    assert final["output"][0]["content"] == gathered["output"][0]["content"]
    assert final["usage"] == gathered["usage"]


def test_length_is_incomplete():
    body = run([Delta("The", 1, "length")], stream=False, max_output_tokens=1)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"][0]["status"] == "incomplete"
    assert body["max_output_tokens"] == 1
    events = run([Delta("The", 1, "length")], stream=True, max_output_tokens=1)
    assert events[-1]["type"] == "response.incomplete"


def test_empty_output_is_an_empty_message():
    body = run([Delta("", 1, "stop")], stream=False)
    assert check_body(body).output_text == ""
    events = run([Delta("", 1, "stop")], stream=True)
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]


CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'


def test_required_tool_call_is_a_function_call_item():
    deltas = [Delta(CALL[:20], 5), Delta(CALL[20:], 9, "stop")]
    body = run(deltas, stream=False, tools=[WEATHER], tool_choice="required")
    check_body(body)
    assert [item["type"] for item in body["output"]] == ["function_call"]
    call = body["output"][0]
    assert (call["name"], json.loads(call["arguments"]), call["call_id"], call["status"]) == \
        ("get_weather", {"city": "Paris"}, "call_0", "completed")
    assert call["id"].startswith("fc_")
    events = run(deltas, stream=True, tools=[WEATHER], tool_choice="required")
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert events[4]["name"] == "get_weather"
    assert json.loads(events[4]["arguments"]) == {"city": "Paris"}
    assert events[-1]["response"]["output"][0]["arguments"] == call["arguments"]


def test_auto_mode_text_then_a_call():
    text = 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n' \
           '</tool_call>'
    body = run([Delta(text, 20, "stop")], stream=False, tools=[WEATHER])
    check_body(body)
    assert [item["type"] for item in body["output"]] == ["message", "function_call"]
    assert body["output"][0]["content"][0]["text"] == "Checking."
    events = run([Delta(text[:12], 4), Delta(text[12:], 16, "stop")], stream=True,
                 tools=[WEATHER])
    types = [e["type"] for e in events]
    # the message closes before the call's item opens
    assert types.index("response.output_item.done") < types.index("response.output_item.added",
                                                                  3)
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == \
        [0, 1]


def test_logprobs_on_the_text():
    def logprob(token: str) -> TokenLogprob:
        return TokenLogprob(TokenText(token, token.encode(), -0.5),
                            (TokenText(token, token.encode(), -0.5),))

    deltas = [Delta("Hi", 1, None, None, (logprob("Hi"),)),
              Delta("!", 1, "stop", None, (logprob("!"),))]
    fields = {"include": ["message.output_text.logprobs"], "top_logprobs": 1}
    body = run(deltas, stream=False, **fields)
    logprobs = check_body(body).output[0].content[0].logprobs
    assert [(lp.token, lp.logprob, lp.bytes) for lp in logprobs] == [("Hi", -0.5, [72, 105]),
                                                                      ("!", -0.5, [33])]
    assert logprobs[0].top_logprobs[0].token == "Hi"
    events = run(deltas, stream=True, **fields)
    assert [len(e["logprobs"]) for e in events if e["type"] == "response.output_text.delta"] \
        == [1, 1]


def test_an_error_fails_the_stream():
    error = ErrorInfo(status=503, message="worker died", type="service_unavailable")
    events = run([Delta("Hi", 1), Delta("", 0, "error", error)], stream=True)
    assert [e["type"] for e in events][-2:] == ["error", "response.failed"]
    assert events[-2]["message"] == "worker died"
    assert events[-1]["response"]["status"] == "failed"
    assert events[-1]["response"]["error"]["message"] == "worker died"
    with pytest.raises(Exception, match="worker died"):
        run([Delta("Hi", 1), Delta("", 0, "error", error)], stream=False)
