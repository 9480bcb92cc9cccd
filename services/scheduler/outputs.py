"""What a step's tokens make of a request: its outputs, when it ends, the RequestOutput its
gateway gets, and the prompt logprobs the first one carries. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Set

from services.scheduler.request import Request
from shared.messages import ErrorInfo, RequestOutput, StepPlan, StepResult, TokenLogprobs


def finish_reason(req: Request, token_id: int, eos_token_ids: Set[int],
                  max_model_len: int) -> str | None:
    """Why the request ends with ``token_id`` (already appended), or None."""
    sampling = req.sampling
    if (not sampling.ignore_eos and token_id in eos_token_ids) or \
            token_id in sampling.stop_token_ids:
        return "stop"
    if len(req.output_token_ids) >= sampling.max_tokens or req.num_tokens >= max_model_len:
        return "length"
    return None


def append_outputs(req: Request, token_ids: list[int], eos_token_ids: Set[int],
                   max_model_len: int) -> tuple[list[int], str | None]:
    """Append a step's tokens (one, or kept drafts and one) to the request's outputs up to
    the one that ends it -> (the tokens appended, its finish reason or None)."""
    for count, token_id in enumerate(token_ids, 1):
        req.output_token_ids.append(token_id)
        reason = finish_reason(req, token_id, eos_token_ids, max_model_len)
        if reason is not None:
            return token_ids[:count], reason  # what follows the end is not output
    return token_ids, None


def request_output(req: Request, token_ids: list[int], reason: str | None,
                   logprobs: list[TokenLogprobs]) -> RequestOutput:
    """The RequestOutput of these new tokens; the request's first carries its figures."""
    first = req.num_outputs_sent == 0
    req.num_outputs_sent += 1
    queue_time = (req.first_scheduled_time or req.arrival_time) - req.arrival_time
    prompt_logprobs: list[TokenLogprobs | None] = []
    if first and req.sampling.prompt_logprobs is not None:
        prompt_logprobs = [None, *req.prompt_logprobs]
        req.prompt_logprobs = []
    return RequestOutput(request_id=req.request_id, new_token_ids=token_ids,
                         finish_reason=reason, num_prompt_tokens=len(req.prompt_token_ids),
                         num_cached_tokens=req.num_cached_tokens if first else 0,
                         queue_time_s=max(0.0, queue_time) if first else 0.0,
                         logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def refused_outputs(requests: Mapping[str, Request], result: StepResult
                    ) -> list[tuple[Request, RequestOutput]]:
    """The failures of the requests the worker refused at arrival (an adapter it cannot
    read: the worker's arrival_refusals.py), each with the worker's reason: a 500, since the
    same replica would refuse it again (a 503 would make the gateway re-send it there)."""
    failures = []
    for request_id, reason in zip(result.refused_request_ids, result.refusal_reasons):
        req = requests.get(request_id)
        if req is not None:
            error = ErrorInfo(status=500, message=reason, code="lora_adapter_unreadable")
            failures.append((req, RequestOutput.failure(request_id, len(req.prompt_token_ids),
                                                        error)))
    return failures


def add_prompt_logprobs(requests: Mapping[str, Request], plan: StepPlan,
                        result: StepResult) -> None:
    """Collect prompt logprobs chunk by chunk until the first output carries them; a step
    planned before the request was last sent to the worker (it was preempted since, and
    recomputes from 0) brings stale ones."""
    for request_id, entries in result.prompt_logprobs.items():
        req = requests.get(request_id)
        if req is not None and req.num_outputs_sent == 0 and plan.step_id >= req.sent_at_step:
            req.prompt_logprobs.extend(entries)
