"""Streaming responses folded into request records, against a scripted HTTP server."""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest

from cli.bench.client import RequestSettings, request_body, send
from cli.bench.datasets import BenchRequest
from cli.bench import load as load_module
from cli.bench.load import DEADLINE_ERROR, LoadSettings, arrival_gaps, run_load, warm_up
from cli.bench.metrics import num_output_tokens, tpot_s, ttft_s

REQUEST = BenchRequest(prompt="hello there", prompt_ids=[1, 2], output_len=4)
SETTINGS = RequestSettings(model="m", ignore_eos=True)


def sse(*payloads) -> bytes:
    lines = [f"data: {p if isinstance(p, str) else json.dumps(p)}\n\n" for p in payloads]
    return "".join(lines).encode()


def text_chunk(text: str, usage=None) -> dict:
    return {"choices": [{"index": 0, "text": text, "finish_reason": None}], "usage": usage}


def client_for(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler), base_url="http://bench")


def run_send(handler, request=REQUEST, settings=SETTINGS):
    async def go():
        async with client_for(handler) as client:
            return await send(client, request, settings, run_started=0.0)
    return asyncio.run(go())


def test_request_body_for_both_endpoints():
    body = request_body(REQUEST, SETTINGS)
    assert body == {"model": "m", "max_tokens": 4, "temperature": 0.0, "stream": True,
                    "stream_options": {"include_usage": True}, "prompt": "hello there",
                    "ignore_eos": True}
    chat = request_body(REQUEST, RequestSettings(model="m", endpoint="chat",
                                                 extra_body={"top_k": 5}))
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert "ignore_eos" not in chat and chat["top_k"] == 5


def test_a_stream_gives_chunk_times_and_the_usage_counts():
    seen = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(json.loads(request.content))
        body = sse(text_chunk("Hel"), text_chunk("lo wor"), text_chunk("", None),
                   {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}, "[DONE]")
        return httpx.Response(200, content=body)

    record = run_send(handler)
    assert seen["prompt"] == "hello there" and seen["max_tokens"] == 4
    assert record.success and len(record.chunk_times_s) == 2  # the empty chunk is no token
    assert (record.num_prompt_tokens, record.num_output_tokens) == (2, 4)
    assert record.chunk_times_s[0] <= record.chunk_times_s[1] <= record.e2e_s
    assert record.chunk_num_tokens is None


def test_chat_deltas_and_continuous_usage_give_tokens_per_chunk():
    def chat_chunk(content, completion_tokens):
        return {"choices": [{"index": 0, "delta": {"content": content}}],
                "usage": {"prompt_tokens": 2, "completion_tokens": completion_tokens}}

    def handler(request: httpx.Request) -> httpx.Response:
        role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
        return httpx.Response(200, content=sse(role, chat_chunk("a", 2), chat_chunk("b", 3),
                                               chat_chunk("c", 6), "[DONE]"))

    record = run_send(handler, settings=RequestSettings(model="m", endpoint="chat"))
    assert record.chunk_num_tokens == [2, 1, 3]
    assert record.num_output_tokens == 6


def test_a_usage_only_stream_succeeds_timed_by_its_choice_chunks():
    # A random-weight model's ids can decode to nothing: chunks with empty text, and the
    # tokens only in the usage.
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse(
            text_chunk(""), text_chunk(""), {"choices": [{"index": 0, "text": "",
                                                          "finish_reason": "length"}]},
            {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}, "[DONE]"))

    record = run_send(handler)
    assert record.success and not record.text
    assert num_output_tokens(record) == 4 and record.num_prompt_tokens == 2
    assert len(record.chunk_times_s) == 3  # every chunk that carried a choice
    assert 0 < ttft_s(record) == record.chunk_times_s[0] <= record.e2e_s
    assert tpot_s(record) is not None


def test_a_stream_with_only_a_usage_chunk_is_timed_by_it():
    body = sse({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 3}}, "[DONE]")
    record = run_send(lambda request: httpx.Response(200, content=body))
    assert record.success and not record.text and len(record.chunk_times_s) == 1
    assert num_output_tokens(record) == 3


def test_text_chunks_time_a_stream_that_has_them():
    body = sse(text_chunk(""), text_chunk("a"), text_chunk(""), text_chunk("b"),
               {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 4}}, "[DONE]")
    record = run_send(lambda request: httpx.Response(200, content=body))
    assert record.success and record.text and len(record.chunk_times_s) == 2
    assert num_output_tokens(record) == 4  # usage, not the chunk count


def test_token_chunks_time_empty_text_too_less_those_that_added_no_token():
    def usage(completion_tokens):
        return {"prompt_tokens": 2, "completion_tokens": completion_tokens}

    tokens = RequestSettings(model="m", timed_chunks="tokens")
    body = sse(text_chunk(""), text_chunk("a"), text_chunk(""), text_chunk("b"),
               {"choices": [], "usage": usage(4)}, "[DONE]")
    record = run_send(lambda request: httpx.Response(200, content=body), settings=tokens)
    assert record.success and record.text and len(record.chunk_times_s) == 4

    counted = sse(text_chunk("", usage(1)), text_chunk("a", usage(3)), text_chunk("", usage(3)),
                  {"choices": [], "usage": usage(3)}, "[DONE]")
    record = run_send(lambda request: httpx.Response(200, content=counted), settings=tokens)
    assert record.chunk_num_tokens == [1, 2]  # the third chunk added no token

    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    chat = sse(role, {"choices": [{"index": 0, "delta": {"content": ""}}]}, "[DONE]")
    record = run_send(lambda request: httpx.Response(200, content=chat),
                      settings=RequestSettings(model="m", endpoint="chat", timed_chunks="tokens"))
    assert len(record.chunk_times_s) == 1 and not record.text


@pytest.mark.parametrize("status, body, reason", [
    (400, {"error": {"message": "bad prompt", "type": "invalid_request_error"}},
     "HTTP 400: bad prompt"),
    (503, "overloaded", "HTTP 503: overloaded")])
def test_an_http_error_is_a_failed_record(status, body, reason):
    content = json.dumps(body).encode() if isinstance(body, dict) else body.encode()
    record = run_send(lambda request: httpx.Response(status, content=content))
    assert not record.success and record.error == reason


def test_an_error_inside_the_stream_is_a_failed_record():
    body = sse(text_chunk("a"), {"error": {"message": "worker died", "type": "server_error"}})
    record = run_send(lambda request: httpx.Response(200, content=body))
    assert record.error == "stream error: worker died"


def test_a_stream_without_text_or_a_broken_connection_fails():
    empty = run_send(lambda request: httpx.Response(200, content=sse("[DONE]")))
    assert empty.error == "no output: no text and no usage tokens received"
    no_tokens = sse(text_chunk(""), {"choices": [], "usage": {"prompt_tokens": 2,
                                                              "completion_tokens": 0}}, "[DONE]")
    assert not run_send(lambda request: httpx.Response(200, content=no_tokens)).success

    def refuse(request):
        raise httpx.ConnectError("connection refused")

    assert run_send(refuse).error == "ConnectError: connection refused"


def test_max_concurrency_bounds_requests_in_flight():
    in_flight, peak = 0, 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        return httpx.Response(200, content=sse(text_chunk("x"), "[DONE]"))

    async def go(max_concurrency):
        async with client_for(handler) as client:
            return await run_load(client, [REQUEST] * 12, SETTINGS,
                                  LoadSettings(max_concurrency=max_concurrency))

    result = asyncio.run(go(3))
    assert peak == 3 and len(result.records) == 12 and all(r.success for r in result.records)
    peak = 0
    asyncio.run(go(None))
    assert peak == 12


def test_sends_keep_to_the_schedule_when_the_loop_wakes_late(monkeypatch):
    """Each sleep of the dispatcher wakes late behind a loop kept busy; the lateness must not
    add up over the run (it did: sends drifted 4 s behind a 40 req/s schedule)."""
    gaps = [0.0] + [0.01] * 40
    monkeypatch.setattr(load_module, "arrival_gaps", lambda *args: gaps)

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse(text_chunk("x"), "[DONE]"))

    async def busy_loop() -> None:  # holds the loop 6 ms in every 7
        while True:
            time.sleep(0.006)
            await asyncio.sleep(0.001)

    async def go():
        busy = asyncio.create_task(busy_loop())
        async with client_for(handler) as client:
            result = await run_load(client, [REQUEST] * len(gaps), SETTINGS,
                                    LoadSettings(request_rate=1))
        busy.cancel()
        return result

    records = asyncio.run(go()).records
    assert len(records) == len(gaps) and all(record.success for record in records)
    assert records[-1].start_s < sum(gaps) + 0.03  # late by a wake-up or two, not by 40


def test_warm_up_stops_a_run_that_cannot_succeed():
    async def go():
        async with client_for(lambda request: httpx.Response(404, json={
                "error": {"message": "The model `m` does not exist."}})) as client:
            await warm_up(client, [REQUEST], SETTINGS, num_warmups=2)

    with pytest.raises(RuntimeError, match="does not exist"):
        asyncio.run(go())


def test_a_failed_warm_up_with_no_text_is_a_warning_not_an_abort():
    usage_only = sse(text_chunk(""), {"choices": [], "usage": {"prompt_tokens": 2,
                                                               "completion_tokens": 4}}, "[DONE]")
    broken = sse({"error": {"message": "worker died"}})
    bodies = iter([usage_only, broken, sse("[DONE]")])
    warnings = []

    async def go():
        async with client_for(lambda request: httpx.Response(200, content=next(bodies))) as client:
            return await warm_up(client, [REQUEST], SETTINGS, num_warmups=3, warn=warnings.append)

    records = asyncio.run(go())
    assert [r.success for r in records] == [True, False, False]
    assert len(warnings) == 2 and "worker died" in warnings[0] and "no output" in warnings[1]

    only_empty = iter([sse("[DONE]")] * 2)  # every warm-up failed, but the server answered

    async def go_empty():
        async with client_for(lambda r: httpx.Response(200, content=next(only_empty))) as client:
            return await warm_up(client, [REQUEST], SETTINGS, num_warmups=2)

    assert not any(r.success for r in asyncio.run(go_empty()))


def test_the_deadline_cancels_what_is_in_flight_and_counts_what_was_never_sent():
    never = asyncio.Event()
    calls = 0

    async def handler(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        if calls > 2:
            await never.wait()  # the server stalls from the third request on
        return httpx.Response(200, content=sse(text_chunk("x"), "[DONE]"))

    async def go():
        async with client_for(handler) as client:
            return await run_load(client, [REQUEST] * 6, SETTINGS, LoadSettings(max_concurrency=1),
                                  max_duration_s=0.3)

    started = time.perf_counter()
    result = asyncio.run(go())
    assert time.perf_counter() - started < 3
    assert result.deadline_reached and len(result.records) == 2
    assert len(result.in_flight) == 1 and result.in_flight[0].error == DEADLINE_ERROR
    assert result.num_not_sent == 3
    summary = result.summary()
    assert (summary["completed"], summary["failed"], summary["outstanding"]) == (2, 0, 4)
    assert (summary["outstanding_in_flight"], summary["outstanding_not_sent"]) == (1, 3)
    assert summary["num_requests"] == 6 and summary["duration_s"] == pytest.approx(0.3, abs=0.2)


def test_poisson_gaps_have_the_requested_mean():
    gaps = arrival_gaps(4001, request_rate=20.0, seed=1)
    assert gaps[0] == 0.0 and min(gaps[1:]) > 0
    assert sum(gaps) / 4000 == pytest.approx(1 / 20, rel=0.05)
    bursty = arrival_gaps(4001, request_rate=20.0, burstiness=0.25, seed=1)
    assert sum(bursty) / 4000 == pytest.approx(1 / 20, rel=0.1)
    variance = lambda xs: sum((x - 1 / 20) ** 2 for x in xs) / len(xs)  # noqa: E731
    assert variance(bursty[1:]) > 2 * variance(gaps[1:])  # same mean, burstier
    assert arrival_gaps(3, math.inf) == [0.0, 0.0, 0.0]
    assert arrival_gaps(50, 5.0, seed=4) == arrival_gaps(50, 5.0, seed=4)


def test_a_client_pool_spreads_requests_over_its_clients_and_closes_them_all():
    from cli.bench.client import ClientPool

    served_by = []

    def handler_for(index):
        def handler(request):
            served_by.append(index)
            return httpx.Response(200, content=sse(text_chunk("hi"), "[DONE]"))
        return handler

    async def go():
        clients = [httpx.AsyncClient(transport=httpx.MockTransport(handler_for(i)),
                                     base_url="http://bench") for i in range(3)]
        async with ClientPool(clients) as pool:
            records = [await send(pool, REQUEST, SETTINGS, run_started=0.0) for _ in range(6)]
        return clients, records

    clients, records = asyncio.run(go())
    assert served_by == [0, 1, 2, 0, 1, 2]
    assert all(record.success for record in records)
    assert all(client.is_closed for client in clients)


def test_a_chat_request_sends_its_messages_and_session_id():
    messages = ({"role": "system", "content": "s"}, {"role": "user", "content": "u"})
    request = BenchRequest(prompt="templated", prompt_ids=[1], output_len=2, messages=messages,
                           user="conv-1")
    chat = request_body(request, RequestSettings(model="m", endpoint="chat"))
    assert chat["messages"] == list(messages) and chat["user"] == "conv-1"
    completion = request_body(request, RequestSettings(model="m"))
    assert completion["prompt"] == "templated" and "messages" not in completion
    assert "user" not in request_body(REQUEST, SETTINGS)


def test_cached_tokens_and_the_text_are_kept_when_asked():
    body = sse(text_chunk("Hel"), text_chunk("lo"),
               {"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": 2,
                                         "prompt_tokens_details": {"cached_tokens": 1}}}, "[DONE]")

    async def go(keep_text: bool):
        async with client_for(lambda request: httpx.Response(200, content=body)) as client:
            return await send(client, REQUEST, SETTINGS, run_started=0.0, keep_text=keep_text)
    kept, plain = asyncio.run(go(True)), asyncio.run(go(False))
    assert kept.output_text == "Hello" and plain.output_text is None
    assert kept.num_cached_tokens == plain.num_cached_tokens == 1
    no_details = sse(text_chunk("a"), {"choices": [], "usage": {"prompt_tokens": 2,
                                                                "completion_tokens": 1}}, "[DONE]")
    assert run_send(lambda request: httpx.Response(200, content=no_details)).num_cached_tokens is None
