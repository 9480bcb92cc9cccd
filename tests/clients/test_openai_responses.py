"""/v1/responses through the official openai SDK, as current OpenAI clients call it."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.clients.conftest import QUESTION, WEATHER_PARAMETERS

pytestmark = pytest.mark.integration

WEATHER_TOOL = {"type": "function", "name": "get_weather", "strict": True,
                "description": "Get the current weather in a city.",
                "parameters": WEATHER_PARAMETERS}


@pytest.fixture(scope="module")
def client(base_url):
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)


def test_create_answers_paris(client, model_name):
    response = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                       max_output_tokens=24, instructions="Answer in one sentence.")
    assert response.status == "completed"
    assert "Paris" in response.output_text
    assert [item.type for item in response.output] == ["message"]
    assert response.instructions == "Answer in one sentence." and response.store is False
    usage = response.usage
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens


def test_stream_events_build_the_same_text(client, model_name):
    gathered = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                       max_output_tokens=24)
    with client.responses.stream(model=model_name, input=QUESTION, temperature=0,
                                 max_output_tokens=24) as stream:
        events = list(stream)
        final = stream.get_final_response()
    types = [event.type for event in events]
    assert types[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == gathered.output_text
    assert final.usage.output_tokens == gathered.usage.output_tokens


def test_function_tool_round_trip(client, model_name, base_url):
    """Turn 1 must call the tool (tool_choice required); turn 2 sends the call and its
    output back as input items, as the Agents SDK does, and gets a message."""
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.responses.create(model=model_name, input=question, tools=[WEATHER_TOOL],
                                    tool_choice="required", temperature=0,
                                    max_output_tokens=32)
    assert [item.type for item in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and call.call_id
    assert isinstance(json.loads(call.arguments)["city"], str)
    second = client.responses.create(
        model=model_name, tools=[WEATHER_TOOL], temperature=0, max_output_tokens=16,
        input=[*question, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 22 degrees"}], tool_choice="none")
    assert [item.type for item in second.output] == ["message"]
    assert second.output_text
    # the prompt holds the call and its output, not just the question
    question_only = httpx.post(base_url.removesuffix("/v1") + "/tokenize",
                               json={"messages": question}).json()["count"]
    assert second.usage.input_tokens > question_only + 10


def test_named_tool_streams_its_arguments(client, model_name):
    events = list(client.responses.create(
        model=model_name, input="Weather in Rome?", tools=[WEATHER_TOOL], temperature=0,
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=32,
        stream=True))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].name == "get_weather"
    deltas = "".join(e.delta for e in events
                     if e.type == "response.function_call_arguments.delta")
    assert json.loads(deltas) == json.loads(done[0].arguments)
    final = events[-1]
    assert final.type == "response.completed"
    assert final.response.output[0].arguments == done[0].arguments


def test_text_format_json_schema(client, model_name):
    schema = {"type": "object", "properties": {"capital": {"type": "string"}},
              "required": ["capital"], "additionalProperties": False}
    response = client.responses.create(
        model=model_name, input=QUESTION, temperature=0, max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "capital", "schema": schema,
                         "strict": True}})
    assert response.status == "completed"
    assert set(json.loads(response.output_text)) == {"capital"}
    assert response.text.format.type == "json_schema"


def test_stored_and_background_responses_through_the_sdk(client, model_name):
    """store: retrieve gives it back; background: answered at once, then read (and its
    stream resumed after an event number) with the SDK's own calls; cancel of a finished
    one is a 400 (the stack runs NATS with JetStream: docs/openai-api.md)."""
    stored = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                     max_output_tokens=24, store=True)
    assert stored.store is True and stored.status == "completed"
    assert client.responses.retrieve(stored.id).output_text == stored.output_text
    queued = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                     max_output_tokens=24, background=True)
    assert queued.background is True and queued.status == "queued"
    events = list(client.responses.retrieve(queued.id, stream=True, starting_after=2))
    assert events[0].sequence_number == 3 and events[-1].type == "response.completed"
    assert events[-1].response.output_text == stored.output_text  # (greedy, same prompt)
    assert client.responses.retrieve(queued.id).status == "completed"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(queued.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_" + "0" * 32)


@pytest.mark.parametrize(("fields", "param"), [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
])
def test_what_needs_stored_responses_is_a_400_naming_it(client, model_name, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=model_name, input="Hi", max_output_tokens=4, **fields)
    assert caught.value.body["param"] == param
