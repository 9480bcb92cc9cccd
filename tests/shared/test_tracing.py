"""Trace context over a real nats-server, through two hops (client -> front -> back):
without an exporter no span is made and the caller's trace headers pass through the middle
hop unchanged; with one every handled message is a span, child of the caller's."""

from __future__ import annotations

import pytest
from opentelemetry import baggage, context, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shared import tracing
from shared.bus import Bus
from shared.messages import Empty, HealthReply

pytestmark = pytest.mark.integration


@pytest.fixture
def recorded():
    """Spans made by this process's handlers (and the client's), exported to memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.make_spans(provider)
    yield provider, exporter
    tracing.make_spans(None)


async def two_hops(nats_url: str) -> tuple[Bus, list[dict]]:
    """A bus serving ``t.front`` (which calls ``t.back``) and ``t.back``; what each handler
    saw: its current span context and the headers it would send on."""
    bus = await Bus.connect(nats_url, name="hops")
    seen: list[dict] = []

    def note(hop: str) -> None:
        span = trace.get_current_span()
        seen.append({"hop": hop, "context": span.get_span_context(),
                     "recording": span.is_recording(), "headers": tracing.inject_headers()})

    async def front(_: Empty) -> HealthReply:
        note("front")
        return await bus.request("t.back", Empty(), HealthReply)

    async def back(_: Empty) -> HealthReply:
        note("back")
        return HealthReply(service="back", instance_id="b")

    await bus.serve("t.front", Empty, front)
    await bus.serve("t.back", Empty, back)
    await bus.flush()
    return bus, seen


async def test_without_an_exporter_no_span_is_made_and_the_callers_trace_passes_through(nats_url):
    client = TracerProvider().get_tracer("client")  # the caller exports; this process does not
    bus, seen = await two_hops(nats_url)
    try:
        with client.start_as_current_span("client") as span:
            token = context.attach(baggage.set_baggage("tenant", "t1"))
            await bus.request("t.front", Empty(), HealthReply)
            sent = tracing.inject_headers()
            context.detach(token)
        caller = span.get_span_context()
        assert sent["traceparent"].startswith(f"00-{caller.trace_id:032x}-{caller.span_id:016x}-")
        assert sent["baggage"] == "tenant=t1"
        assert [s["hop"] for s in seen] == ["front", "back"]
        for hop in seen:  # no span; the caller's headers sent on as they came
            assert not hop["recording"] and not hop["context"].is_valid
            assert hop["headers"] == sent
        seen.clear()
        await bus.request("t.front", Empty(), HealthReply)  # no trace context: none made up
        assert [s["hop"] for s in seen] == ["front", "back"]
        assert all(s["headers"] is None for s in seen)
        assert tracing.inject_headers({"a": "b"}) == {"a": "b"}
    finally:
        await bus.close()


async def test_with_an_exporter_each_handled_message_is_a_span_child_of_the_callers(nats_url,
                                                                                   recorded):
    provider, exporter = recorded
    bus, seen = await two_hops(nats_url)
    try:
        with provider.get_tracer("client").start_as_current_span("client"):
            await bus.request("t.front", Empty(), HealthReply)
        await bus.request("t.front", Empty(), HealthReply)
    finally:
        await bus.close()
    finished = exporter.get_finished_spans()  # in the order they ended
    assert [span.name for span in finished] == ["t.back", "t.front", "client", "t.back", "t.front"]
    back, front, client = finished[:3]
    assert front.kind == trace.SpanKind.SERVER and back.kind == trace.SpanKind.SERVER
    assert front.parent.span_id == client.context.span_id
    assert back.parent.span_id == front.context.span_id
    assert front.context.trace_id == back.context.trace_id == client.context.trace_id
    assert all(s["recording"] for s in seen)
    back, front = finished[3:]  # no caller span: a trace of its own
    assert front.parent is None and back.parent.span_id == front.context.span_id
    assert front.context.trace_id not in (client.context.trace_id, 0)


def test_an_unknown_exporter_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="otel_exporter must be one of none, console, not 'jaeger'"):
        tracing.setup_tracing("test", "jaeger")
