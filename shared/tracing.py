"""OpenTelemetry setup and trace-context propagation through NATS headers.

Spans are made only where they are exported (``--otel-exporter console``): the SDK's
tracer provider is installed then, and every handled message gets a span (``message_span``)
whose context the messages its handler sends carry on (``traceparent``). With the default
``none`` no provider is installed and no span is made (the span was half of the kvstore's
CPU per lookup: 0.062 -> 0.030 ms, BENCHMARKS.md, issue 14): a message's trace headers,
when it carries any, are passed on as they came by what its handler sends, so a process
that exports nothing keeps a trace intact between processes that do; it parses none of them.
The SDK reads the standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default:
parent-based, always on).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar

from opentelemetry import context, propagate, trace
from opentelemetry.trace import SpanKind, Tracer, TracerProvider

from shared.config import check_choice
from shared.sections.runtime import OtelExporter

TRACE_HEADERS = ("traceparent", "tracestate", "baggage")  # what the default propagators read

_span_tracer: Tracer | None = None  # None: no span is made
_NO_CONTEXT = nullcontext()
# the trace headers of the message being handled, passed on when no span is made
_passed_on: ContextVar[dict[str, str] | None] = ContextVar("flotilla_trace_headers",
                                                           default=None)


def setup_tracing(service: str, exporter: OtelExporter = OtelExporter.NONE) -> None:
    """Export spans named after the service, to ``exporter``."""
    check_choice(exporter, OtelExporter, "otel_exporter")
    if exporter == OtelExporter.NONE:
        return
    from opentelemetry.sdk.resources import Resource  # the SDK only where spans are exported
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    provider = SdkTracerProvider(resource=Resource.create({"service.name": f"flotilla-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)
    make_spans(provider)


def make_spans(provider: TracerProvider | None) -> None:
    """Make a span per handled message with ``provider`` from now on (None: none)."""
    global _span_tracer
    _span_tracer = provider.get_tracer("flotilla") if provider is not None else None


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str] | None:
    """Headers carrying the current trace context (``traceparent``): the current span's, else
    the trace headers of the message being handled; None when there are none (nats-py then
    sends a message without a header block)."""
    carrier = dict(headers or {})
    propagate.inject(carrier)
    if "traceparent" not in carrier:  # no span current
        passed_on = _passed_on.get()
        if passed_on is not None:
            carrier.update(passed_on)
    return carrier or None


def extract_context(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})


def message_span(name: str, headers: dict[str, str] | None,
                 kind: SpanKind) -> AbstractContextManager:
    """Around the handler of a message with these headers: a span, child of the caller's,
    when spans are exported; else the caller's trace headers, if it sent any, kept to be
    passed on by what the handler sends."""
    if _span_tracer is not None:
        return _span_tracer.start_as_current_span(name, context=extract_context(headers),
                                                  kind=kind)
    if headers:
        carried = {key: headers[key] for key in TRACE_HEADERS if key in headers}
        if carried:
            return _PassedOn(carried)
    return _NO_CONTEXT


class _PassedOn:
    """Trace headers to pass on while the block runs (no span, nothing parsed)."""

    __slots__ = ("_headers", "_token")

    def __init__(self, headers: dict[str, str]) -> None:
        self._headers = headers

    def __enter__(self) -> None:
        self._token = _passed_on.set(self._headers)

    def __exit__(self, *exc_info) -> None:
        _passed_on.reset(self._token)


tracer = trace.get_tracer("flotilla")  # a proxy: the SDK's tracer once one is installed
