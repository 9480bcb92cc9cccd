"""One trace per request, collected the way an operator collects it: every service of a real
stack exports over OTLP/HTTP (``FLOTILLA_OTLP_TRACES_ENDPOINT``, the env form of
``--otlp-traces-endpoint``) to a receiver in this process; one chat completion's trace has
a single root span (the gateway's HTTP span) and spans from the tokenizer, the scheduler
(its GenAI attributes equal to the response's usage) and the worker, all of that trace, each
one's parent in it."""

from __future__ import annotations

import gzip
import threading
import time
from collections import defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai
import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (  # noqa: E402
    ExportTraceServiceRequest, ExportTraceServiceResponse,
)

from tests.integration.conftest import start_stack  # noqa: E402

pytestmark = pytest.mark.integration
ROOT_NAME = "POST /v1/chat/completions"


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint (POST /v1/traces, protobuf) keeping every span with its
    resource's ``service.name``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, object]] = []  # (service.name, Span)
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                ok = self.path == "/v1/traces"
                if ok:
                    receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.lock:
            for resource_spans in request.resource_spans:
                attrs = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                service = attrs.get("service.name", "")
                for scope_spans in resource_spans.scope_spans:
                    self.spans.extend((service, span) for span in scope_spans.spans)

    def trace_of(self, trace_id: bytes) -> list[tuple[str, object]]:
        with self.lock:
            return [(s, span) for s, span in self.spans if span.trace_id == trace_id]

    def roots(self, name: str) -> list[object]:
        with self.lock:
            return [span for s, span in self.spans
                    if s == "flotilla-gateway" and span.name == name and not span.parent_span_id]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def attributes(span) -> dict:
    values = {}
    for a in span.attributes:
        field = a.value.WhichOneof("value")
        values[a.key] = getattr(a.value, field) if field else None
    return values


def complete(request_trace: list) -> bool:
    """The trace holds every service's span and each span's parent is in it."""
    services = {service for service, _ in request_trace}
    names = {span.name for _, span in request_trace}
    ids = {span.span_id for _, span in request_trace}
    return ({"flotilla-gateway", "flotilla-tokenizer", "flotilla-scheduler",
             "flotilla-worker"} <= services and {"scheduler.request", "worker.prefill"} <= names
            and all(not span.parent_span_id or span.parent_span_id in ids
                    for _, span in request_trace))


@pytest.fixture
def receiver():
    receiver = OtlpReceiver()
    yield receiver
    receiver.close()


@pytest.mark.slow  # (make test-slow: a stack of its own, half a minute or more)
def test_one_chat_request_is_one_trace_across_every_service(tmp_path, receiver, model_files):
    stack = start_stack(tmp_path / "logs", env={
        "FLOTILLA_OTLP_TRACES_ENDPOINT": receiver.url, "OTEL_BSP_SCHEDULE_DELAY": "100"},
        service_args={"worker": ["--kv-cache-memory", "64MiB"]})
    try:
        client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0)
        response = client.chat.completions.create(
            model=model_files.name, messages=[{"role": "user", "content": "Say hello."}],
            temperature=0, max_tokens=8)
        deadline = time.monotonic() + 15
        roots: list = []
        request_trace: list = []
        while time.monotonic() < deadline:
            roots = receiver.roots(ROOT_NAME)
            if len(roots) == 1:
                request_trace = receiver.trace_of(roots[0].trace_id)
                if complete(request_trace):
                    break
            time.sleep(0.1)
    finally:
        stack.stop()
    assert len(roots) == 1, [[(service, span.name) for service, span in receiver.trace_of(
        root.trace_id)] for root in roots]  # FastAPI's own HTTP span would be a second root
    by_service = defaultdict(list)
    for service, span in request_trace:
        by_service[service].append(span)
    assert complete(request_trace), {service: [span.name for span in spans]
                                     for service, spans in by_service.items()}
    assert [span for span in by_service["flotilla-gateway"] if not span.parent_span_id] == roots
    assert sum(not span.parent_span_id for _, span in request_trace) == 1  # the one root
    (scheduler_span,) = [span for span in by_service["flotilla-scheduler"]
                         if span.name == "scheduler.request"]
    got = attributes(scheduler_span)
    assert got["gen_ai.request.model"] == model_files.name
    assert got["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert got["gen_ai.usage.output_tokens"] == response.usage.completion_tokens
    assert 0 < got["gen_ai.latency.time_to_first_token"] <= got["gen_ai.latency.e2e"]
    assert got["gen_ai.latency.time_in_queue"] >= 0
    (prefill,) = [s for s in by_service["flotilla-worker"] if s.name == "worker.prefill"]
    assert prefill.parent_span_id == scheduler_span.span_id  # the request's own work
    assert len(prefill.links) == 1 and prefill.links[0].trace_id != roots[0].trace_id  # its step
    assert attributes(prefill)["flotilla.num_new_tokens"] == response.usage.prompt_tokens
    assert any(s.name.endswith("tokenizer.encode") for s in by_service["flotilla-tokenizer"])
