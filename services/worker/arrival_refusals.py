"""Requests the worker refuses one by one when they arrive, instead of failing their step.

A plan's new request can name a LoRA adapter this worker has not read yet (loaded at run
time on the scheduler, or a worker that joined since) whose files are gone or unreadable
now. Failing the whole step would fail every request of the replica (the scheduler then
fails them all with a 503 and re-attaches); instead ``screen`` takes such requests out of
the plan before any rank sees it and ``attach`` reports them on that step's result, where
the scheduler ends each with its reason (a 500: the same files would fail again on this
replica) and leaves the others running.
"""

from __future__ import annotations

from typing import Callable

import msgspec

from shared.messages import NewRequestData, StepPlan, StepResult

# resolve(request_id, lora_name, lora_path, lora_hash): the adapter's key, or raises
Resolve = Callable[[str, str, str, str], str]


class ArrivalRefusals:
    def __init__(self) -> None:
        self._pending: dict[int, dict[str, str]] = {}  # step id -> request id -> reason

    def screen(self, plan: StepPlan, resolve: Resolve) -> StepPlan:
        """``plan`` without the new requests whose adapter cannot be resolved (their reasons
        kept for the step's result); the plan itself when every one resolves."""
        refused = {}
        for new in plan.new_requests:
            reason = _refusal(new, resolve)
            if reason is not None:
                refused[new.request_id] = reason
        if not refused:
            return plan
        self._pending[plan.step_id] = refused
        return msgspec.structs.replace(
            plan, new_requests=[n for n in plan.new_requests if n.request_id not in refused],
            scheduled=[s for s in plan.scheduled if s.request_id not in refused])

    def attach(self, results: list[StepResult]) -> list[StepResult]:
        """Each result of a screened step carries its refused requests and their reasons."""
        if not self._pending:
            return results
        for index, result in enumerate(results):
            refused = self._pending.pop(result.step_id, None)
            if refused:
                results[index] = msgspec.structs.replace(
                    result, refused_request_ids=list(refused),
                    refusal_reasons=list(refused.values()))
        return results


def _refusal(new: NewRequestData, resolve: Resolve) -> str | None:
    if not new.lora_name:
        return None
    try:
        resolve(new.request_id, new.lora_name, new.lora_path, new.lora_hash)
    except (ValueError, OSError) as exc:
        return f"LoRA adapter {new.lora_name!r} cannot be used on this replica: {exc}"
    return None
