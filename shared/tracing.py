"""OpenTelemetry setup and trace-context propagation through NATS headers."""

from __future__ import annotations

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter


def setup_tracing(service: str, exporter: str = "none") -> None:
    """Install a tracer provider named after the service. ``exporter`` is "none"
    (spans are created and propagated but not exported) or "console"."""
    provider = TracerProvider(resource=Resource.create({"service.name": f"flotilla-{service}"}))
    if exporter == "console":
        provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)


def inject_headers(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Return headers carrying the current trace context (``traceparent``)."""
    carrier = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract_context(headers: dict[str, str] | None) -> context.Context:
    return propagate.extract(headers or {})


tracer = trace.get_tracer("flotilla")
