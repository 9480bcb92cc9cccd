"""A step plan's scheduled entries checked against what the worker knows, before any state
changes: each becomes the ``SequenceChunk`` of its work (the tokens it computes from its
state's ``num_computed_tokens``, its block table, whether it samples, its drafts), or a
ValueError naming the request refuses the whole step. Pure host code."""

from __future__ import annotations

from dataclasses import dataclass

from services.worker.draft_model import WorkerProposer
from services.worker.step_inputs import SequenceChunk
from services.worker.step_state import RequestState, StepInFlight
from shared.messages import ScheduledRequest


@dataclass(frozen=True)
class CacheShape:
    """What a plan's block ids and lengths are checked against."""

    num_blocks: int
    block_size: int
    max_model_len: int

    def check_block_ids(self, request_id: str, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"request {request_id}: block ids {bad} outside "
                             f"[0, {self.num_blocks})")


def chunk_of(scheduled: ScheduledRequest, state: RequestState | None, cache: CacheShape,
             in_flight: StepInFlight | None, proposer: WorkerProposer) -> SequenceChunk:
    """One scheduled entry's work (``state``: its request's, None when unknown). Its last
    known token may be the one ``in_flight`` samples (a placeholder, filled on the device);
    its drafts follow that token (the scheduler's, or slots ``proposer`` fills)."""
    request_id, num_new_tokens = scheduled.request_id, scheduled.num_new_tokens
    if state is None:
        raise ValueError(f"unknown request id {request_id!r}")
    drafts = _drafts(scheduled, proposer)
    start, end = state.num_computed_tokens, state.num_computed_tokens + num_new_tokens
    known_end = end - len(drafts)  # drafts follow the last known token
    if num_new_tokens <= len(drafts) or known_end > state.num_tokens \
            or (drafts and known_end != len(state.token_ids)):
        raise ValueError(f"request {request_id}: {num_new_tokens} new tokens after {start} "
                         f"computed ({len(drafts)} drafts); it has {state.num_tokens} tokens")
    if end > cache.max_model_len:
        raise ValueError(f"request {request_id}: {end} tokens exceed max_model_len "
                         f"{cache.max_model_len}")
    cache.check_block_ids(request_id, scheduled.new_block_ids)
    block_table = state.block_table + list(scheduled.new_block_ids)
    if len(block_table) * cache.block_size < end:
        raise ValueError(f"request {request_id}: too few blocks, {len(block_table)} of "
                         f"{cache.block_size} tokens for {end} tokens")
    # positions start.. predicting prompt tokens (the last prompt position predicts an output)
    num_logprob_rows = max(0, min(end, state.num_prompt_tokens - 1) - start) \
        if state.wants_prompt_logprobs else 0
    token_ids = state.token_ids[start:known_end]
    pending_row = None
    if known_end > len(state.token_ids):  # its last token: sampled by the step in flight
        if in_flight is None or known_end - len(state.token_ids) != 1 \
                or in_flight.row_of(request_id, state) is None:
            raise ValueError(f"request {request_id}: token {end - 1} is not known yet")
        pending_row = in_flight.row_of(request_id, state)
        token_ids.append(0)  # placeholder: filled on the device (fill_pending_inputs)
    return SequenceChunk(token_ids=token_ids + drafts, start=start, block_table=block_table,
                         sample=known_end == state.num_tokens,
                         num_logprob_rows=num_logprob_rows, pending_row=pending_row,
                         num_drafts=len(drafts),
                         draft_slots=bool(drafts and not scheduled.draft_token_ids))


def _drafts(scheduled: ScheduledRequest, proposer: WorkerProposer) -> list[int]:
    """A scheduled entry's drafts: the scheduler's tokens, or placeholders for the slots the
    worker's proposer fills (its draft model, draft_model.py; the null one refuses them)."""
    given = scheduled.draft_token_ids
    if given and len(given) != scheduled.num_drafts:
        raise ValueError(f"request {scheduled.request_id}: {len(given)} draft tokens for "
                         f"{scheduled.num_drafts} drafts")
    proposer.check(scheduled.request_id, scheduled)
    return list(given) or [0] * scheduled.num_drafts
