"""What the runner keeps between steps: each request's state, and the step left in flight
(its kernels queued, its sampled tokens still on the device)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kernels.sampling import draw_seed
from services.worker.kv_step import KvStep
from services.worker.staging import to_host
from shared.messages import SamplingParams, StepPlan, StepResult


@dataclass
class RequestState:
    token_ids: list[int]  # prompt, then every sampled token
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    num_prompt_tokens: int
    # prompt logprobs still to compute: the request asked and had no outputs when it arrived
    wants_prompt_logprobs: bool = False
    # tokens sampled by the step in flight, not read back yet (they follow token_ids)
    num_pending_tokens: int = 0
    # positions whose KV the draft model has written (draft_model.py)
    num_draft_computed: int = 0
    # its LoRA adapter's registered name ("": the base model; lora_slots.py)
    lora_name: str = ""

    @property
    def num_tokens(self) -> int:
        """Known tokens and the one being sampled by the step in flight."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_outputs(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def seed_next_draw(self, output_index: int | None = None) -> None:
        """A seeded draw depends only on (seed, output index), so a request preempted and
        recomputed draws exactly what it would have drawn, whatever the batch. The output
        index is ``num_outputs`` unless given (after kept drafts, further on)."""
        if self.generator is not None:
            index = self.num_outputs if output_index is None else output_index
            self.generator.manual_seed(draw_seed(self.sampling.seed, index))


def needs_host_tokens(sampling: SamplingParams) -> bool:
    """Sampling this request reads its earlier tokens on the host, or reports host values."""
    return sampling.logprobs is not None or sampling.prompt_logprobs is not None \
        or sampling.structured is not None or sampling.has_penalties


def plan_needs_host_tokens(plan: StepPlan, requests: dict[str, RequestState]) -> bool:
    """The step's sampling reads host tokens (``needs_host_tokens``), or the next plan depends
    on its tokens (it verifies drafts): it cannot be left in flight."""
    if any(needs_host_tokens(new.sampling) for new in plan.new_requests):
        return True
    for scheduled in plan.scheduled:
        if scheduled.num_drafts:
            return True  # the next plan depends on how many drafts are kept
        state = requests.get(scheduled.request_id)
        if state is not None and needs_host_tokens(state.sampling):
            return True
    return False


@dataclass
class StepInFlight:
    """A step whose kernels are queued and whose sampled tokens are still on the device."""

    plan: StepPlan
    start_time: float
    request_ids: list[str]  # per sampled row
    states: list[RequestState]  # per sampled row: the state the token belongs to
    token_ids: torch.Tensor  # [num_sampled] int64, on the device
    host_token_ids: torch.Tensor  # [num_sampled] int64 on the host (CUDA: pinned, async copy)
    copied: torch.cuda.Event | None  # CUDA: the copy to host_token_ids is done
    rows: dict[str, int]  # request id -> its row
    kv: KvStep  # the plan's kvstore work (its loads)

    @classmethod
    def start(cls, plan: StepPlan, start_time: float, request_ids: list[str],
              states: list[RequestState], token_ids: torch.Tensor | None,
              device: torch.device, kv: KvStep,
              read_back: torch.cuda.Stream | None = None) -> StepInFlight:
        """``read_back``: CUDA, the stream the tokens go to the host on, once sampled. On a
        stream of its own the copy leaves the compute stream free: the next step starts right
        after this one's draw instead of a few microseconds after the copy (one H200, batch-1
        decode: ~10 us a step). None: the current stream."""
        if token_ids is None:  # nothing scheduled: an empty step
            token_ids = torch.empty(0, dtype=torch.int64, device=device)
        host_token_ids, copied = to_host(token_ids, read_back)  # once the draw is done
        return cls(plan, start_time, request_ids, states, token_ids, host_token_ids, copied,
                   {request_id: row for row, request_id in enumerate(request_ids)}, kv)

    def done(self) -> bool:
        """Its tokens are on the host and its loads complete (the scheduler takes the result
        to mean the loaded blocks are ready)."""
        return (self.copied is None or self.copied.query()) and self.kv.loads_done()

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        self.kv.wait_for_loads()

    def result(self, token_ids: list[int]) -> StepResult:
        """Its result, once read back (``wait``) as ``token_ids``."""
        return StepResult(step_id=self.plan.step_id, request_ids=self.request_ids,
                          sampled_token_ids=token_ids,
                          step_time_s=time.perf_counter() - self.start_time,
                          kv_load_bytes=self.kv.load_bytes,
                          kv_load_bytes_per_s=self.kv.load_bytes_per_s())

    def row_of(self, request_id: str, state: RequestState) -> int | None:
        """The row holding ``state``'s pending token (None: this step samples none for it)."""
        row = self.rows.get(request_id)
        return row if row is not None and self.states[row] is state else None
