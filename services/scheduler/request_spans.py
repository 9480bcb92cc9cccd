"""A request's span at its scheduler (docs/tracing.md): begun when the request is queued,
as a child of its submit's span (so of the gateway's HTTP span), ended with its last output,
carrying the OpenTelemetry GenAI attributes (``gen_ai.request.model``,
``gen_ai.usage.input_tokens`` / ``output_tokens``, ``gen_ai.response.finish_reasons``) and
vLLM's latency ones (``gen_ai.latency.time_in_queue``, ``time_to_first_token``, ``e2e``).
Its context rides to the worker in ``NewRequestData.traceparent`` (``traced``), so the
worker's span of the step that first computes the request is the child of this one.

``NoRequestSpans`` (tracing off) does nothing: no span, no dict, the plan as it was. Both
are driven by the scheduler's edge (service.py): ``submitted`` in the submit handler,
``traced`` on each plan sent, ``outputs`` on every batch of outputs it emits."""

from __future__ import annotations

import time
from collections.abc import Iterable

import msgspec
from opentelemetry.trace import Span, Status, StatusCode

from services.scheduler.scheduler import Emitted
from shared.messages import GenerateRequest, StepPlan, choice_request_ids
from shared.tracing import spans_enabled, start_request_span, traceparent_of


class NoRequestSpans:
    def submitted(self, request: GenerateRequest, model_name: str) -> None:
        pass

    def traced(self, plan: StepPlan) -> StepPlan:
        return plan

    def outputs(self, emitted: Iterable[Emitted]) -> None:
        pass


class _Open:
    """One request's span while it runs (its n sequences share it)."""

    __slots__ = ("span", "traceparent", "start_ns", "num_open", "num_output_tokens",
                 "first_token_ns", "finish_reasons")

    def __init__(self, span: Span, start_ns: int, n: int) -> None:
        self.span, self.start_ns, self.num_open = span, start_ns, n
        self.traceparent = traceparent_of(span)
        self.num_output_tokens = 0
        self.first_token_ns = 0
        self.finish_reasons: list[str] = []


class RequestSpans:
    def __init__(self) -> None:
        self._open: dict[str, _Open] = {}  # by sequence request id

    def submitted(self, request: GenerateRequest, model_name: str) -> None:
        """In the submit handler, once the request is queued (its span's parent is current)."""
        start_ns = time.time_ns()
        sampling = request.sampling
        span = start_request_span("scheduler.request", start_ns, {
            "gen_ai.request.model": model_name,
            "gen_ai.response.model": model_name, "gen_ai.request.id": request.request_id,
            "gen_ai.request.max_tokens": sampling.max_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p, "gen_ai.request.n": request.n,
            "gen_ai.usage.input_tokens": len(request.prompt_token_ids)})
        state = _Open(span, start_ns, request.n)
        for request_id in choice_request_ids(request.request_id, request.n):
            self._open[request_id] = state

    def traced(self, plan: StepPlan) -> StepPlan:
        """The plan with each new request's trace context, for the worker's span."""
        if not plan.new_requests:
            return plan
        new_requests = []
        for new in plan.new_requests:
            state = self._open.get(new.request_id)
            if state is not None:
                new = msgspec.structs.replace(new, traceparent=state.traceparent)
            new_requests.append(new)
        return msgspec.structs.replace(plan, new_requests=new_requests)

    def outputs(self, emitted: Iterable[Emitted]) -> None:
        """Outputs emitted: the first token's time, the token counts; a final one ends
        its sequence (and the span with the request's last sequence)."""
        now_ns = time.time_ns()
        for item in emitted:
            output = item.output
            state = self._open.get(output.request_id)
            if state is None:
                continue
            if output.new_token_ids and not state.first_token_ns:
                state.first_token_ns = now_ns
                state.span.set_attribute("gen_ai.latency.time_in_queue", output.queue_time_s)
            state.num_output_tokens += len(output.new_token_ids)
            if output.finish_reason is not None:
                del self._open[output.request_id]
                state.finish_reasons.append(output.finish_reason)
                state.num_open -= 1
                if not state.num_open:
                    _end(state, output.num_prompt_tokens, now_ns)


def _end(state: _Open, num_prompt_tokens: int, now_ns: int) -> None:
    span = state.span
    if num_prompt_tokens:
        span.set_attribute("gen_ai.usage.input_tokens", num_prompt_tokens)
    span.set_attribute("gen_ai.usage.output_tokens", state.num_output_tokens)
    span.set_attribute("gen_ai.response.finish_reasons", state.finish_reasons)
    if state.first_token_ns:
        span.set_attribute("gen_ai.latency.time_to_first_token",
                           (state.first_token_ns - state.start_ns) / 1e9)
    span.set_attribute("gen_ai.latency.e2e", (now_ns - state.start_ns) / 1e9)
    if "error" in state.finish_reasons:
        span.set_status(Status(StatusCode.ERROR))
    span.end(end_time=now_ns)


def request_spans() -> NoRequestSpans | RequestSpans:
    """This process's kind: spans only where they are exported."""
    return RequestSpans() if spans_enabled() else NoRequestSpans()
