"""Continuous batching over a paged KV cache: pure, synchronous policy code.

There is no prefill or decode mode: each request has ``num_computed_tokens`` and a
token count (prompt + outputs so far), and every step catches requests up under one
token budget, running requests first (decodes, then the rest of chunked prompts),
then waiting requests in arrival order. Blocks are allocated as tokens need them;
when they run out, the latest running request is preempted (its blocks freed, its
tokens recomputed later), so nothing is lost and nothing is sent twice.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from services.scheduler.block_manager import BlockManager, num_blocks_for
from services.scheduler.config import SchedulerConfig
from shared.errors import InvalidRequest
from shared.messages import (
    ErrorInfo, GenerateRequest, NewRequestData, RequestOutput, SamplingParams,
    ScheduledRequest, StepPlan, StepResult,
)


@dataclass(eq=False)  # identity: requests are looked up in lists
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_subject: str
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    known_to_worker: bool = False  # the worker holds this request's state

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass(frozen=True)
class Emitted:
    """A RequestOutput and the subject of the gateway waiting for it."""

    output_subject: str
    output: RequestOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, num_blocks: int, block_size: int,
                 max_model_len: int, eos_token_ids: list[int]) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.block_manager = BlockManager(num_blocks, block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self._next_step_id = 0
        self._forget_ids: list[str] = []  # the worker should drop these at the next step

    # ------------------------------------------------------------ intake
    def add_request(self, request: GenerateRequest) -> None:
        if request.request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request.request_id}", param="request_id")
        num_prompt = len(request.prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequest("the prompt is empty", param="prompt")
        num_total = num_prompt + request.sampling.max_tokens
        if num_total > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({num_prompt} tokens) plus max_tokens ({request.sampling.max_tokens}) is "
                f"{num_total} tokens, over the model's context length of {self.max_model_len}",
                param="max_tokens", code="context_length_exceeded")
        capacity = self.block_manager.num_blocks * self.block_manager.block_size
        if num_blocks_for(num_total, self.block_manager.block_size) > self.block_manager.num_blocks:
            raise InvalidRequest(
                f"the request needs {num_total} tokens of KV cache; this replica's cache holds "
                f"{capacity}", param="max_tokens", code="kv_cache_too_small")
        req = Request(request.request_id, list(request.prompt_token_ids), request.sampling,
                      request.output_subject, request.arrival_time)
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------ one step
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when there is nothing to compute."""
        budget = self.config.max_num_batched_tokens
        new_requests: list[NewRequestData] = []
        scheduled: list[ScheduledRequest] = []
        preempted = False
        for req in list(self.running):
            if budget == 0:
                break
            if req not in self.running:  # preempted to make room for an earlier request
                continue
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if num_new == 0:
                continue
            new_block_ids = self._grow_or_preempt(req, req.num_computed_tokens + num_new)
            if new_block_ids is None:  # req itself was preempted: later ones already were
                preempted = True
                break
            self._schedule(req, num_new, new_block_ids, new_requests, scheduled)
            budget -= num_new
        while (not preempted and budget > 0 and self.waiting
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            num_missing = self.block_manager.num_missing_blocks(req.block_table, num_new)
            if not self.block_manager.can_allocate(num_missing):
                break  # FCFS: later requests wait behind this one
            self.waiting.popleft()
            self.running.append(req)
            self._schedule(req, num_new, self.block_manager.allocate(num_missing), new_requests,
                           scheduled)
            budget -= num_new
        if not scheduled:
            return None
        plan = StepPlan(self._next_step_id, new_requests, scheduled, self._forget_ids)
        self._next_step_id += 1
        self._forget_ids = []
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Emitted]:
        """Apply the tokens a step sampled; return the outputs to publish."""
        self.num_steps += 1
        emitted: list[Emitted] = []
        for request_id, token_id in zip(result.request_ids, result.sampled_token_ids):
            req = self.requests.get(request_id)
            if req is None:  # aborted while the step ran
                continue
            req.output_token_ids.append(token_id)
            finish_reason = self._finish_reason(req, token_id)
            emitted.append(Emitted(req.output_subject, RequestOutput(
                request_id, [token_id], finish_reason, len(req.prompt_token_ids))))
            if finish_reason is not None:
                self._finish(req)
        return emitted

    def fail_all(self, error: ErrorInfo) -> list[Emitted]:
        """The worker is gone: end every request with ``error``."""
        emitted = [Emitted(req.output_subject,
                           RequestOutput(req.request_id, [], "error", len(req.prompt_token_ids), error))
                   for req in self.requests.values()]
        for req in list(self.requests.values()):
            self._finish(req)
        self._forget_ids = []
        return emitted

    # ------------------------------------------------------------ helpers
    def _schedule(self, req: Request, num_new: int, new_block_ids: list[int],
                  new_requests: list[NewRequestData], scheduled: list[ScheduledRequest]) -> None:
        req.block_table.extend(new_block_ids)
        if req.known_to_worker:
            scheduled.append(ScheduledRequest(req.request_id, num_new, new_block_ids))
        else:
            new_requests.append(NewRequestData(req.request_id, req.all_token_ids, req.sampling,
                                               list(req.block_table), req.num_computed_tokens))
            scheduled.append(ScheduledRequest(req.request_id, num_new, []))
            req.known_to_worker = True
        req.num_computed_tokens += num_new

    def _grow_or_preempt(self, req: Request, num_tokens: int) -> list[int] | None:
        """Blocks for ``req`` to hold ``num_tokens``, preempting the latest running
        requests until they fit; None if ``req`` itself had to be preempted."""
        while True:
            num_missing = self.block_manager.num_missing_blocks(req.block_table, num_tokens)
            if self.block_manager.can_allocate(num_missing):
                return self.block_manager.allocate(num_missing)
            victim = self.running[-1]
            self._preempt(victim)
            if victim is req:
                return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        if req.known_to_worker:
            self._forget_ids.append(req.request_id)
            req.known_to_worker = False
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def _finish_reason(self, req: Request, token_id: int) -> str | None:
        sampling = req.sampling
        if (not sampling.ignore_eos and token_id in self.eos_token_ids) or \
                token_id in sampling.stop_token_ids:
            return "stop"
        if len(req.output_token_ids) >= sampling.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _finish(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.block_manager.free(req.block_table)
        req.block_table = []
        if req.known_to_worker:
            self._forget_ids.append(req.request_id)
