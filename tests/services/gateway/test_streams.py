"""A sequence's stream in the gateway: deltas merged until read, and a non-streaming
reader woken once, at the end."""

from __future__ import annotations

import asyncio

from services.gateway.streams import Delta, RequestStream
from shared.messages import ErrorInfo


def test_a_streaming_reader_is_woken_per_delta_and_merges_what_it_missed():
    async def go():
        stream = RequestStream("r", None)
        stream.push(Delta("a", 1))
        first = await stream.next_delta()
        stream.push(Delta("b", 1))
        stream.push(Delta("c", 1, "length"))
        return first, await stream.next_delta(), stream.first_token_at

    first, rest, first_token_at = asyncio.run(go())
    assert (first.text, rest.text, rest.num_new_tokens, rest.finish_reason) == ("a", "bc", 2, "length")
    assert first_token_at > 0


def test_a_non_streaming_reader_is_woken_once_with_the_whole_answer():
    async def go():
        stream = RequestStream("r", None, wake_at_end=True)
        reader = asyncio.create_task(stream.next_delta())
        for text in ("x", "y", "z"):
            stream.push(Delta(text, 1))
            await asyncio.sleep(0)
        woken_early = reader.done()
        stream.push(Delta("!", 1, "stop"))
        return woken_early, await asyncio.wait_for(reader, 5), stream.first_token_at

    woken_early, delta, first_token_at = asyncio.run(go())
    assert not woken_early
    assert (delta.text, delta.num_new_tokens, delta.finish_reason) == ("xyz!", 4, "stop")
    assert first_token_at > 0  # when the first token came, not when the reader woke


def test_a_non_streaming_reader_is_woken_by_an_error():
    async def go():
        stream = RequestStream("r", None, wake_at_end=True)
        stream.push(Delta("x", 1))
        stream.fail(ErrorInfo(status=503, message="gone"))
        return await asyncio.wait_for(stream.next_delta(), 5)

    delta = asyncio.run(go())
    assert (delta.text, delta.finish_reason, delta.error.status) == ("x", "error", 503)
