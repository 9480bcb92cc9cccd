"""Choices and generations: OpenAI's shapes for text, logprobs, echo, n and best_of, built
from deltas without a stack."""

from __future__ import annotations

import asyncio
import json

from services.gateway.choices import ChatChoice, CompletionChoice
from services.gateway.generation import Generation, gather, merge_deltas, stream_events
from services.gateway.streams import Delta, RequestStream, TokenLogprob, TokenText


def logprob(token: str, value: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(TokenText(token, token.encode(), value),
                        tuple(TokenText(t, t.encode(), v) for t, v in top))


def streams(num: int) -> list[RequestStream]:
    return [RequestStream(f"r-{i}", None) for i in range(num)]


async def from_list(items):
    for item in items:
        yield item


def sse_events(writes: list[bytes]) -> list[str]:
    """The server-sent events in a response's writes (one write may carry several)."""
    text = b"".join(writes).decode()
    assert text.endswith("\n\n")
    return text.removesuffix("\n\n").split("\n\n")


def collect(agen) -> list:
    async def run():
        return [item async for item in agen]
    return asyncio.run(run())


def test_completion_logprobs_with_echo_in_the_legacy_shape():
    choice = CompletionChoice(0, 1, echo_text="Hi there")
    choice.record(Delta(" you", 1, None, None, (logprob(" you", -0.5, (" you", -0.5)),)))
    choice.record(Delta("!", 1, "length", None, (logprob("!", -1.0, ("?", -0.7)),)))
    prompt = [None, logprob(" there", -2.0, (" there", -2.0))]
    final = choice.final(prompt)
    assert final["text"] == "Hi there you!" and final["finish_reason"] == "length"
    assert final["logprobs"] == {
        "tokens": ["Hi", " there", " you", "!"],
        "token_logprobs": [None, -2.0, -0.5, -1.0],
        "top_logprobs": [None, {" there": -2.0}, {" you": -0.5}, {"?": -0.7}],
        "text_offset": [0, 2, 8, 12]}


def test_completion_without_logprobs_has_none():
    choice = CompletionChoice(2, None)
    choice.record(Delta("ok", 1, "stop", None, (logprob("ok", -0.1),)))
    assert choice.final(None) == {"index": 2, "text": "ok", "logprobs": None,
                                  "finish_reason": "stop"}


def test_chat_stream_entries_carry_their_tokens_logprobs():
    choice = ChatChoice(1, 2, None, lambda: "call_x")
    entries = choice.on_delta(Delta("Hel", 1, None, None, (logprob("Hel", -0.2, ("Hel", -0.2)),)))
    assert entries == [{"index": 1, "delta": {"content": "Hel"}, "finish_reason": None,
                        "logprobs": {"refusal": None, "content": [
                            {"token": "Hel", "logprob": -0.2, "bytes": [72, 101, 108],
                             "top_logprobs": [{"token": "Hel", "logprob": -0.2,
                                               "bytes": [72, 101, 108]}]}]}}]
    last = choice.on_delta(Delta("", 1, "stop", None, (logprob("\ufffd", -3.0),)))
    # a token whose text is held back still makes a chunk (empty content)
    assert last[0]["delta"] == {"content": ""}
    assert last[0]["logprobs"]["content"][0]["logprob"] == -3.0
    assert last[-1] == {"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    final = choice.final()
    assert final["message"] == {"role": "assistant", "content": "Hel"}
    assert [e["token"] for e in final["logprobs"]["content"]] == ["Hel", "\ufffd"]


def test_best_of_returns_the_sequences_of_highest_cumulative_logprob():
    choices = [CompletionChoice(i, None) for i in range(3)]
    generation = Generation("completions", "cmpl-1", "m", choices, streams(3), 4, num_returned=2)
    deltas = from_list([(0, Delta("a", 1, "length", None, (logprob("a", -3.0),))),
                        (1, Delta("b", 1, "length", None, (logprob("b", -0.5),))),
                        (2, Delta("c", 1, "length", None, (logprob("c", -1.0),)))])
    response = asyncio.run(gather(generation, deltas))
    assert [(c["index"], c["text"]) for c in response["choices"]] == [(0, "b"), (1, "c")]
    assert response["usage"]["completion_tokens"] == 3 and response["usage"]["prompt_tokens"] == 4


def test_merged_deltas_keep_each_sequence_in_order():
    sources = [from_list([Delta(f"{i}{j}", 1) for j in range(3)]) for i in range(3)]
    merged = collect(merge_deltas(sources))
    for i in range(3):
        assert [d.text for index, d in merged if index == i] == [f"{i}{j}" for j in range(3)]


def test_streamed_chat_with_n_and_usage():
    choices = [ChatChoice(i, None, None, lambda: "call_x") for i in range(2)]
    generation = Generation("chat", "chatcmpl-1", "m", choices, streams(2), 5, 2,
                            include_usage=True)
    deltas = from_list([(1, Delta("b", 1, "stop")), (0, Delta("a", 1)), (0, Delta("", 1, "length"))])
    events = sse_events(collect(stream_events(generation, deltas)))
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [{"role": "assistant", "content": ""}] * 2
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"]
                for c in chunks[:-1] if c["choices"][0]["finish_reason"]}
    assert finishes == {0: "length", 1: "stop"}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_best_of_picks_within_each_prompt_of_a_batch():
    choices = [CompletionChoice(i, None) for i in range(4)]  # 2 prompts x best_of 2
    generation = Generation("completions", "cmpl-1", "m", choices, streams(4), 9, num_returned=1,
                            num_per_prompt=2)
    streams_of = generation.streams
    streams_of[0].num_cached_tokens, streams_of[2].num_cached_tokens = 16, 32
    values = [-2.0, -1.0, -0.5, -3.0]
    deltas = from_list([(i, Delta(f"t{i}", 1, "length", None, (logprob(f"t{i}", v),)))
                        for i, v in enumerate(values)])
    response = asyncio.run(gather(generation, deltas))
    assert [(c["index"], c["text"]) for c in response["choices"]] == [(0, "t1"), (1, "t2")]
    assert response["usage"]["prompt_tokens_details"]["cached_tokens"] == 48


def test_tokens_without_text_still_make_a_chunk():
    """A step's tokens whose text is empty (held back, or decoding to nothing) are one
    chunk, as vLLM streams them: clients time chunks as tokens. A delta with no tokens and
    no text makes none."""
    chat = ChatChoice(0, None, None, lambda: "call_x")
    assert chat.on_delta(Delta("", 1)) == [
        {"index": 0, "delta": {"content": ""}, "logprobs": None, "finish_reason": None}]
    assert chat.on_delta(Delta("", 0)) == []
    completion = CompletionChoice(0, None)
    assert completion.on_delta(Delta("", 2)) == [
        {"index": 0, "text": "", "logprobs": None, "finish_reason": None}]
    assert completion.on_delta(Delta("", 0)) == []
