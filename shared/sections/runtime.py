"""Knobs every process has: the bus, logs and traces, the model it serves, its replica and
its drain on SIGTERM."""

from __future__ import annotations

import enum
from typing import Annotated

from shared.config import Section, check_choice, check_number, knob


class OtelExporter(enum.StrEnum):
    """Where each service's OpenTelemetry spans go (shared/tracing.py)."""

    NONE = "none"  # no spans; the trace context is passed through
    CONSOLE = "console"


class Bus(Section, frozen=True, kw_only=True):
    nats_url: Annotated[str, knob("NATS server URL", serve=False)] = "nats://127.0.0.1:4222"
    namespace: Annotated[str, knob(
        "NATS subject prefix, so several deployments can share one NATS")] = "flotilla"
    instance_id: Annotated[str, knob(
        "unique id of this process (generated when empty)", serve=False)] = ""


class Observability(Section, frozen=True, kw_only=True):
    log_level: Annotated[str, knob("debug, info, warning or error")] = "info"
    log_json: Annotated[bool, knob("log JSON lines instead of console text")] = False
    otel_exporter: Annotated[OtelExporter, knob(
        "OpenTelemetry span exporter: none (no SDK, no spans; trace headers passed on) or "
        "console (a span per handled message)")] = OtelExporter.NONE
    otlp_traces_endpoint: Annotated[str, knob(
        "send spans over OTLP/HTTP (protobuf) to this collector URL, e.g. "
        "http://collector:4318 (/v1/traces is added when the URL has no path); vLLM's flag. "
        "Set: a span per handled message and one trace per request (docs/tracing.md), "
        "whatever --otel-exporter says")] = ""

    def __post_init__(self) -> None:
        check_choice(self.otel_exporter, OtelExporter, "otel_exporter")
        if self.otlp_traces_endpoint and not self.otlp_traces_endpoint.startswith(
                ("http://", "https://")):
            raise ValueError("otlp_traces_endpoint must be an http:// or https:// URL (OTLP "
                             f"over HTTP), not {self.otlp_traces_endpoint!r}")


class ModelSource(Section, frozen=True, kw_only=True):
    model: Annotated[str, knob(
        "the model: smollm2 (the default, shipped), a .gguf file, a Hugging Face model "
        "directory, or dummy:<preset> (random weights of a real architecture)")] = "smollm2"
    cache_dir: Annotated[str, knob("where converted models are cached")] = "~/.cache/flotilla"


class Replica(Section, frozen=True, kw_only=True):
    replica_id: Annotated[str, knob(
        "the model replica this process serves: a scheduler drives the worker of its own "
        "replica id", serve=False)] = "0"


class Drain(Section, frozen=True, kw_only=True):
    shutdown_timeout: Annotated[float, knob(
        "on SIGTERM, seconds to finish the work in flight (a scheduler its requests, a worker "
        "its steps, the kvstore its disk writes), then exit (flotilla serve sets it from its "
        "own --shutdown-timeout)", serve=False)] = 30.0

    def __post_init__(self) -> None:
        check_number(self.shutdown_timeout, "shutdown_timeout")


COMMON = (Bus, Observability, ModelSource)  # in every service's config
