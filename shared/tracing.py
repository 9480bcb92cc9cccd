"""OpenTelemetry setup and trace-context propagation through NATS headers.

Spans are made only where they are exported (``--otlp-traces-endpoint URL``: OTLP over
HTTP to a collector; ``--otel-exporter console``: printed): the SDK's
tracer provider is installed then, and every handled message gets a span (``message_span``)
whose context the messages its handler sends carry on (``traceparent``). With the default
``none`` no provider is installed and no span is made (the span was half of the kvstore's
CPU per lookup: 0.062 -> 0.030 ms, BENCHMARKS.md, issue 14): a message's trace headers,
when it carries any, are passed on as they came by what its handler sends, so a process
that exports nothing keeps a trace intact between processes that do; it parses none of them.
The SDK reads the standard ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (default:
parent-based, always on) and ``OTEL_BSP_*`` (batching: ``OTEL_BSP_SCHEDULE_DELAY`` ms).

One trace per request (docs/tracing.md): the gateway's HTTP span is the root; a request's
own spans made away from its messages (the scheduler's, at its end; the worker's, for the
step that first computes it) take its context from ``request_traceparent()`` as it was when
the request came, through ``start_request_span`` and ``record_span``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from contextvars import ContextVar

from opentelemetry import context, propagate, trace
from opentelemetry.trace import Link, Span, SpanKind, Tracer, TracerProvider

from shared.config import check_choice
from shared.sections.runtime import OtelExporter

TRACE_HEADERS = ("traceparent", "tracestate", "baggage")  # what the default propagators read

_span_tracer: Tracer | None = None  # None: no span is made
_NO_CONTEXT = nullcontext()
# the trace headers of the message being handled, passed on when no span is made
_passed_on: ContextVar[dict[str, str] | None] = ContextVar("flotilla_trace_headers",
                                                           default=None)


def setup_tracing(service: str, exporter: OtelExporter = OtelExporter.NONE,
                  otlp_traces_endpoint: str = "") -> None:
    """Export spans named after the service (``flotilla-<service>``): over OTLP/HTTP to
    ``otlp_traces_endpoint`` when set, else to ``exporter``."""
    check_choice(exporter, OtelExporter, "otel_exporter")
    if exporter == OtelExporter.NONE and not otlp_traces_endpoint:
        return
    from opentelemetry.sdk.resources import Resource  # the SDK only where spans are exported
    from opentelemetry.sdk.trace import TracerProvider as SdkTracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    if otlp_traces_endpoint:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        span_exporter = OTLPSpanExporter(endpoint=traces_url(otlp_traces_endpoint))
    else:
        span_exporter = ConsoleSpanExporter()
    provider = SdkTracerProvider(resource=Resource.create({"service.name": f"flotilla-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)
    make_spans(provider)


def traces_url(endpoint: str) -> str:
    """The collector's OTLP/HTTP traces URL: ``/v1/traces`` added to a URL with no path."""
    scheme, _, rest = endpoint.partition("://")
    if "/" not in rest.rstrip("/"):
        return f"{scheme}://{rest.rstrip('/')}/v1/traces"
    return endpoint


def make_spans(provider: TracerProvider | None) -> None:
    """Make a span per handled message with ``provider`` from now on (None: none)."""
    global _span_tracer
    _span_tracer = provider.get_tracer("flotilla") if provider is not None else None


def spans_enabled() -> bool:
    """Whether this process makes spans (an exporter is set): guard any span work with it."""
    return _span_tracer is not None


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


def request_traceparent() -> str:
    """The ``traceparent`` a message sent now would carry ("": none): the current span's,
    else the one passed on. Kept with a request to parent the spans made for it later."""
    if _span_tracer is None:
        passed_on = _passed_on.get()
        return passed_on.get("traceparent", "") if passed_on is not None else ""
    return (inject_headers() or {}).get("traceparent", "")


def start_request_span(name: str, start_time_ns: int, attributes: dict) -> Span:
    """A span of the request being handled (child of the current span), begun at
    ``start_time_ns``; the caller ends it. Only where ``spans_enabled()``."""
    return _span_tracer.start_span(name, start_time=start_time_ns, attributes=attributes)


def traceparent_of(span: Span) -> str:
    """The ``traceparent`` that makes a remote span ``span``'s child."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent", "")


def record_span(name: str, traceparent: str, start_time_ns: int, end_time_ns: int,
                attributes: dict) -> None:
    """A finished span in the trace of ``traceparent`` (its child), linked to the current
    span (the batch it ran in). Only where ``spans_enabled()``."""
    parent = extract_context({"traceparent": traceparent})
    current = trace.get_current_span().get_span_context()
    links = [Link(current)] if current.is_valid else None
    span = _span_tracer.start_span(name, context=parent, start_time=start_time_ns,
                                   attributes=attributes, links=links)
    span.end(end_time=end_time_ns)


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
