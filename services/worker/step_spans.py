"""The worker's span of a request (docs/tracing.md): for each request a plan sends in full
(``NewRequestData`` with a ``traceparent``: the scheduler makes spans), the step that first
computes its tokens becomes ``worker.prefill``, a span in the request's own trace (the child
of its scheduler span) timed as the step ran, linked to the step's span (the batch many
requests share: a trace of its own). Called only where spans are exported."""

from __future__ import annotations

from shared.messages import StepPlan
from shared.tracing import record_span


def record_prefill_spans(plan: StepPlan, start_ns: int, end_ns: int) -> None:
    """One span per traced new request of ``plan``, which ran from ``start_ns`` to ``end_ns``."""
    num_new_tokens = {entry.request_id: entry.num_new_tokens for entry in plan.scheduled}
    step = {"flotilla.step_id": plan.step_id, "flotilla.step.num_requests": len(plan.scheduled),
            "flotilla.step.num_tokens": sum(num_new_tokens.values())}
    for new in plan.new_requests:
        if not new.traceparent:
            continue
        num_prompt_tokens = new.num_prompt_tokens or len(new.token_ids)
        record_span("worker.prefill", new.traceparent, start_ns, end_ns, step | {
            "gen_ai.request.id": new.request_id,
            "flotilla.num_new_tokens": num_new_tokens.get(new.request_id, 0),
            "flotilla.num_computed_tokens": new.num_computed_tokens,
            "gen_ai.usage.input_tokens": num_prompt_tokens})
