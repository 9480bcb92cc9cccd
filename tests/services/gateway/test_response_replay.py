"""A stored response rebuilt from its stored messages (response_replay.py), without a stack:
the same events, numbered alike, from any replay; resuming after any number gives the
rest; moves, failures and cancels as their records say. Events are checked against the
openai SDK's own types."""

from __future__ import annotations

import json

import msgspec
import pydantic
import pytest
from openai.types.responses import ResponseStreamEvent

from services.gateway.response_replay import ChatReplay, ResponseReplay
from services.gateway.responses import echo_fields, plan_response, sampling_params
from services.gateway.responses_schema import parse_request
from shared.detokenizer import TokenBytes, fast_decoder
from shared.messages import ErrorInfo, OutputBatch, RequestOutput, encode
from shared.models import resolve_model
from shared.response_messages import CANCELLED_CODE, ResponseMark, ResponseStart

EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
TEXT = "The lighthouse keeper climbed the stairs, and the lamp was lit at dusk."


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_model("smollm2").path))


def start(**body) -> ResponseStart:
    request = {"model": "m", "input": "Hi", "store": True, **body}
    req = parse_request(request)
    echo = echo_fields(req, sampling_params(req, plan_response(req, store_available=True), 64))
    return ResponseStart(kind="responses", response_id="resp_" + "a" * 32, request_id="a" * 32,
                         model="m", created=1, body=msgspec.json.encode(request),
                         echo=msgspec.json.encode(echo), prompt_tail=[1, 2],
                         num_prompt_tokens=2)


def outputs(request_id: str, token_ids: list[int], sizes=(1, 3, 2), finish="length"):
    """The scheduler's stored messages for these tokens, in steps of the given sizes."""
    messages, at = [], 0
    for size in (sizes * len(token_ids))[:len(token_ids)]:
        if at >= len(token_ids):
            break
        chunk, at = token_ids[at:at + size], at + size
        reason = finish if at >= len(token_ids) else None
        messages.append(("out", encode(OutputBatch([RequestOutput(
            request_id=request_id, new_token_ids=chunk, finish_reason=reason,
            num_prompt_tokens=2)]))))
    return messages


def replayed(tokenizer, messages, record=None) -> tuple[ResponseReplay, list[dict]]:
    replay = ResponseReplay(record or start(), fast_decoder(tokenizer), TokenBytes(tokenizer))
    raw = replay.opening()
    for kind, data in messages:
        raw += replay.feed(kind, data)
    events = [json.loads(event.split(b"data: ", 1)[1]) for event in raw]
    for event in events:
        EVENTS.validate_python(event)
    return replay, events


def text_of(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


def test_every_replay_gives_the_same_numbered_events_and_the_text(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    messages = outputs("a" * 32, token_ids)
    replay, events = replayed(tokenizer, messages)
    _, again = replayed(tokenizer, messages)
    assert events == again  # (item ids too: made from the response id)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert text_of(events) == tokenizer.decode(token_ids)
    assert events[-1]["type"] == "response.incomplete" and replay.status == "incomplete"
    assert replay.body()["output"][0]["content"][0]["text"] == tokenizer.decode(token_ids)
    assert replay.body()["usage"]["output_tokens"] == len(token_ids)


def test_a_replay_cut_anywhere_resumes_with_exactly_the_rest(tokenizer):
    """What a client that had events 0..n gets from starting_after=n: the rest, once."""
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    messages = outputs("a" * 32, token_ids, finish="stop")
    _, events = replayed(tokenizer, messages)
    for cut in range(-1, len(events)):
        replay = ResponseReplay(start(), fast_decoder(tokenizer), TokenBytes(tokenizer))
        sent = replay.after(replay.opening(), cut)
        for kind, data in messages:
            sent += replay.after(replay.feed(kind, data), cut)
        assert [json.loads(e.split(b"data: ", 1)[1]) for e in sent] == events[cut + 1:]


def test_a_move_counts_only_the_new_attempts_outputs(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    first, rest = token_ids[:5], token_ids[5:]
    old = "a" * 32
    lost = ErrorInfo(status=503, message="replica gone")
    messages = [*outputs(old, first, finish=None),
                ("out", encode(OutputBatch([RequestOutput.failure(old, 2, lost)]))),
                ("rec", encode(ResponseMark(event="migrated", request_id=old + "-m1",
                                            num_output_tokens=5))),
                ("out", encode(OutputBatch([RequestOutput(request_id=old, new_token_ids=[7])]))),
                *outputs(old + "-m1", rest, finish="stop")]
    replay, events = replayed(tokenizer, messages)
    assert replay.status == "completed"
    assert text_of(events) == tokenizer.decode(token_ids)  # the 503 and the stale 7 left out


def test_a_move_whose_mark_was_lost_follows_the_newer_attempt(tokenizer):
    """(A NATS outage: the gateway moved the request, its "migrated" record never got in.)"""
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    old = "a" * 32
    moved = outputs(old + "-m2", token_ids[5:], finish="stop")
    stale = [("out", encode(OutputBatch([RequestOutput(request_id=other, new_token_ids=[7])])))
             for other in (old, "b" * 32, old + "-m1")]  # (older attempts, another request)
    messages = [*outputs(old, token_ids[:5], finish=None), moved[0], *stale, *moved[1:]]
    replay, events = replayed(tokenizer, messages)
    assert replay.status == "completed" and text_of(events) == tokenizer.decode(token_ids)


def test_a_failure_or_a_cancel_ends_it_as_its_record_says(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)[:4]
    begun = outputs("a" * 32, token_ids, finish=None)
    refused = ErrorInfo(status=400, message="bad grammar", code="invalid_value")
    replay, events = replayed(tokenizer, [*begun, ("out", encode(OutputBatch(
        [RequestOutput.failure("a" * 32, 2, refused)])))])
    assert replay.status == "failed" and events[-1]["type"] == "response.failed"
    assert replay.body()["error"]["message"] == "bad grammar"
    replay, events = replayed(tokenizer, [*begun, ("rec", encode(ResponseMark(
        event="cancelled", request_id="a" * 32))), *outputs("a" * 32, [5, 6])])
    assert replay.status == "cancelled" and replay.body()["status"] == "cancelled"
    assert events[-1]["type"] == "error" and events[-1]["code"] == CANCELLED_CODE
    assert text_of(events) == tokenizer.decode(token_ids)  # nothing after the cancel


def chat_start(**body) -> ResponseStart:
    request = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "store": True,
               "stream": True, "stream_options": {"include_usage": True}, **body}
    return ResponseStart(kind="chat", response_id="chatcmpl-" + "a" * 32, request_id="a" * 32,
                         model="m", created=1, body=msgspec.json.encode(request), echo=b"{}",
                         prompt_tail=[1, 2], num_prompt_tokens=2)


def test_a_stored_chat_stream_numbers_its_chunks_and_resumes_after_any(tokenizer):
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    messages = outputs("a" * 32, token_ids, finish="stop")

    def sse(cut: int) -> list[bytes]:
        replay = ChatReplay(chat_start(), fast_decoder(tokenizer), TokenBytes(tokenizer))
        sent = replay.after(replay.opening(), cut)
        for kind, data in messages:
            sent += replay.after(replay.feed(kind, data), cut)
        return sent, replay

    events, replay = sse(-1)
    ids = [int(event.split(b"\n", 1)[0].removeprefix(b"id: ")) for event in events]
    assert ids == list(range(len(events)))
    assert events[-1].endswith(b"data: [DONE]\n\n")
    chunks = [json.loads(e.split(b"data: ", 1)[1]) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == tokenizer.decode(token_ids)
    assert chunks[-1]["usage"]["completion_tokens"] == len(token_ids)
    body = replay.body()
    assert body["choices"][0]["message"]["content"] == text and body["status"] == "completed"
    for cut in (0, 3, len(events) - 2):
        assert sse(cut)[0] == events[cut + 1:]
