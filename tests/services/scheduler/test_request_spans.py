"""A request's scheduler span, driven as the scheduler's edge drives it: begun under the
submit's span, its context put in the plan for the worker, token counts and latencies set
from the outputs, ended with the last of its n sequences; and nothing at all with tracing off."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from services.scheduler.request_spans import NoRequestSpans, RequestSpans, request_spans
from services.scheduler.scheduler import Emitted
from services.worker.step_spans import record_prefill_spans
from shared import tracing
from shared.messages import (
    GenerateRequest, NewRequestData, RequestOutput, SamplingParams, ScheduledRequest, StepPlan,
)


@pytest.fixture
def exporter():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.make_spans(provider)
    yield exporter, provider.get_tracer("test")
    tracing.make_spans(None)


def request(request_id: str, n: int = 1) -> GenerateRequest:
    return GenerateRequest(request_id=request_id, prompt_token_ids=[1, 2, 3],
                           sampling=SamplingParams(max_tokens=4), output_subject="out", n=n)


def plan_for(*request_ids: str) -> StepPlan:
    return StepPlan(0, [NewRequestData(r, [1, 2, 3], SamplingParams(), [0]) for r in request_ids],
                    [ScheduledRequest(r, 3) for r in request_ids])


def out(request_id: str, tokens: list[int], reason: str | None = None) -> Emitted:
    return Emitted("out", RequestOutput(request_id=request_id, new_token_ids=tokens,
                                        finish_reason=reason, num_prompt_tokens=3,
                                        queue_time_s=0.25))


def test_a_request_of_two_sequences_is_one_span_ended_by_the_last(exporter):
    exporter, tracer = exporter
    spans = request_spans()
    assert isinstance(spans, RequestSpans)
    with tracer.start_as_current_span("submit") as submit:
        spans.submitted(request("r", n=2), "m")
    plan = spans.traced(plan_for("r-0", "r-1", "other"))
    spans.outputs([out("r-0", [7]), out("r-1", [8]), out("other", [9], "stop")])
    spans.outputs([out("r-0", [7, 7], "stop")])
    assert not exporter.get_finished_spans()[1:]  # r-1 still runs: only "submit" ended
    spans.outputs([out("r-1", [], "length")])
    submit_span, span = exporter.get_finished_spans()
    assert span.name == "scheduler.request" and span.parent.span_id == submit.context.span_id
    assert span.attributes["gen_ai.request.model"] == "m"
    assert span.attributes["gen_ai.usage.input_tokens"] == 3
    assert span.attributes["gen_ai.usage.output_tokens"] == 4
    assert span.attributes["gen_ai.response.finish_reasons"] == ("stop", "length")
    assert span.attributes["gen_ai.latency.time_in_queue"] == 0.25
    assert 0 < span.attributes["gen_ai.latency.time_to_first_token"] \
        <= span.attributes["gen_ai.latency.e2e"]
    parent = f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-"
    assert [new.traceparent[:-2] for new in plan.new_requests] == [parent, parent, ""]
    with tracer.start_as_current_span("step") as step:
        record_prefill_spans(plan, 10, 20)
    (prefill, other_prefill) = [s for s in exporter.get_finished_spans()
                                if s.name == "worker.prefill"]
    assert prefill.parent.span_id == span.context.span_id == other_prefill.parent.span_id
    assert prefill.links[0].context.span_id == step.context.span_id
    assert prefill.attributes["flotilla.num_new_tokens"] == 3
    assert (prefill.start_time, prefill.end_time) == (10, 20)


def test_with_tracing_off_nothing_is_made_and_the_plan_is_the_same_object():
    spans = request_spans()
    assert isinstance(spans, NoRequestSpans)
    spans.submitted(request("r"), "m")
    plan = plan_for("r")
    assert spans.traced(plan) is plan
    assert not tracing.spans_enabled() and tracing.request_traceparent() == ""


def test_the_traces_url_of_an_endpoint():
    assert tracing.traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert tracing.traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert tracing.traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


def test_an_endpoint_that_is_not_http_is_refused():
    from shared.sections.runtime import Observability

    with pytest.raises(ValueError, match="otlp_traces_endpoint must be an http"):
        Observability(otlp_traces_endpoint="grpc://c:4317")
