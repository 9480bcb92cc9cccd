"""Speculative decoding's scheduler side (issue 28), pure: which positions a decode step
verifies beside its own, and what the step's result does to the request.

The seam. The core calls a ``Drafter``, chosen once (``drafter``): ``NoDrafts`` (off: every
decode computes its one token; it keeps nothing) or ``DraftPolicy`` (which requests get
drafts, and how many a step: ``disable_by_batch_size`` and the adaptive cap of
draft_budget.py) around a ``Proposer``, which says what the drafts are:

- ``NgramProposer`` (``method: "ngram"``): prompt lookup. The request's last n tokens (n
  from ``prompt_lookup_max`` down to ``prompt_lookup_min``) are looked for earlier in its
  prompt and output, and the tokens that followed their latest earlier occurrence are
  proposed, up to ``num_speculative_tokens``: a few dictionary operations on the host per
  new token (an n-gram index per request), nothing on the device.
- ``SuffixProposer`` (``method: "suffix"``, suffix.py): the longest suffix, up to
  ``suffix_decoding_max_tree_depth`` tokens, matched in the request's own tokens and in
  recent requests' responses; the longer the match, the more tokens
  (``suffix_decoding_max_spec_factor`` per matched token).
- ``WorkerSlots`` (``method: "draft_model"``, ``"eagle3"``, ``"eagle"``): no tokens here. The plan
  gives draft slots, which the worker's proposer (its draft model,
  services/worker/draft_model.py) fills right before the step's forward.

One wire shape: a drafted ``ScheduledRequest`` carries ``num_drafts`` (counted in its
``num_new_tokens``) and, from a host-side proposer, their ``draft_token_ids``; the result
returns the drafts each request kept (``StepResult.accepted_draft_ids``), so a step is
settled the same way whichever side drafted (``settle_drafts``), and counted in the
``DraftBooks`` (what /metrics, the benchmarks and the tests read). A benchmark installs its
own proposer in process (``DraftPolicy.proposer``; benchmarks/speculation_plugins.py).

The worker computes the request's last token and its drafts in one query; under greedy
decoding it keeps each draft while it equals the model's argmax at the position before, then
the argmax after the last kept one (docs/speculative-decoding.md). So the output is the
tokens plain greedy decoding gives, one to ``num_speculative_tokens + 1`` a step. A request
that samples keeps each draft with the model's probability of it and draws a replacement at
the first rejection (rejection sampling): the same distribution as plain sampling. Requests
with penalties, a grammar or logprobs are not drafted for (``can_speculate``); they decode
as before in the same steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from services.scheduler.draft_budget import DraftBudget
from services.scheduler.request import Request
from services.scheduler.suffix import ResponseCache, SuffixIndex
from shared.messages import SamplingParams, StepPlan, StepResult
from shared.sections.speculative import WORKER_METHODS, SpeculativeConfig


def can_speculate(sampling: SamplingParams) -> bool:
    """Nothing reported per token, and logits adjusted, if at all, by what depends only on the
    position (logit_bias, min_tokens, min_p: the worker adjusts each verify row as it would the
    row it samples from): verifying drafts by the argmax (greedy) then gives exactly the tokens
    plain decoding gives, and by rejection sampling exactly its distribution. Penalties (they
    depend on the drafts before) and grammars (a draft must advance the matcher) are left
    out. And not opted out (the request's ``speculative: false``)."""
    return sampling.speculative and not (
        sampling.structured is not None or sampling.has_penalties
        or sampling.logprobs is not None or sampling.prompt_logprobs is not None)


class Drafts(NamedTuple):
    """A request's drafts in the step being planned."""

    num_drafts: int  # positions after its last known token
    token_ids: list[int]  # their tokens; [] where the worker's proposer fills them


NO_DRAFTS = Drafts(0, [])


class Proposer(Protocol):
    """What a request's drafts are: ``propose`` at most ``num_drafts`` (>= 1) after
    ``token_ids`` (fewer, or none, where it has no guess); ``forget`` what it kept for a
    request that finished or was aborted."""

    def propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> Drafts: ...
    def forget(self, req: Request) -> None: ...


class NgramIndex:
    """One request's n-grams (``min_n``..``max_n`` tokens) -> where each last began,
    grown as its tokens are appended (they only ever are), so a lookup costs O(max_n)
    per new token instead of a scan of the whole sequence (the tests' reference)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.starts: dict[tuple[int, ...], int] = {}
        self.num_starts = dict.fromkeys(self.sizes, 0)  # per n: starts indexed so far

    def drafts(self, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        length = len(token_ids)
        if num_drafts <= 0:
            return []
        for n in self.sizes:
            # index every n-gram but the suffix itself: starts 0 .. length - n - 1
            for start in range(self.num_starts[n], length - n):
                self.starts[tuple(token_ids[start:start + n])] = start
            self.num_starts[n] = max(self.num_starts[n], length - n)
            if length - n < 1:
                continue
            start = self.starts.get(tuple(token_ids[length - n:]))
            if start is not None:
                return list(token_ids[start + n:start + n + num_drafts])
        return []


def host_drafts(token_ids: list[int]) -> Drafts:
    """Drafts a host-side proposer made: their tokens travel with the plan."""
    return Drafts(len(token_ids), token_ids)


class NgramProposer:
    """Prompt lookup: an n-gram index a request (``NgramIndex``)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._indexes: dict[str, NgramIndex] = {}

    def propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> Drafts:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.min_n, self.max_n)
        return host_drafts(index.drafts(token_ids, num_drafts))

    def forget(self, req: Request) -> None:
        self._indexes.pop(req.request_id, None)


class SuffixProposer:
    """Suffix lookup (suffix.py): the longest earlier match of a request's suffix in its own
    tokens or in the responses of the last ``suffix_decoding_max_cached_requests`` requests;
    a match of n tokens proposes up to ``ceil(n * max_spec_factor)``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._suffixes: dict[str, SuffixIndex] = {}
        self.responses = ResponseCache(config.prompt_lookup_min,
                                       config.suffix_decoding_max_tree_depth,
                                       config.suffix_decoding_max_cached_requests)

    def propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> Drafts:
        index = self._suffixes.get(request_id)
        if index is None:
            index = self._suffixes[request_id] = SuffixIndex(
                self.config.prompt_lookup_min, self.config.suffix_decoding_max_tree_depth)
        index.add(request_id, token_ids)
        own = index.match(token_ids, lambda _key: token_ids)
        tokens, matched = ((list(token_ids[own[1]:]), own[2]) if own is not None else ([], 0))
        cached, cached_matched = self.responses.continuation(token_ids)
        if cached_matched > matched:
            tokens, matched = cached, cached_matched
        factor = self.config.suffix_decoding_max_spec_factor
        return host_drafts(tokens[:min(num_drafts, max(1, math.ceil(matched * factor)))])

    def forget(self, req: Request) -> None:
        """Its output joins the responses later requests draft from."""
        self._suffixes.pop(req.request_id, None)
        self.responses.add(req.output_token_ids)


class WorkerSlots:
    """Draft slots (method draft_model): a drafted request's step carries as many as it may
    take (``num_speculative_tokens``, fewer near max_tokens, the context or the step's
    budget), which the worker's draft model fills. Every request that can take drafts then
    waits for its token before its next step, so steps that verify are not overlapped."""

    def propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> Drafts:
        return Drafts(num_drafts, [])

    def forget(self, req: Request) -> None:
        pass


class DraftBooks:
    """The acceptance books: drafts verified and kept, cumulative (what /metrics, the
    benchmarks and the adaptive cap's tests read; zero without speculation)."""

    def __init__(self) -> None:
        self.num_draft_tokens = 0  # drafts verified
        self.num_accepted_drafts = 0  # of those, kept
        self.num_drafted_steps = 0  # a request's verify passes (mean kept: accepted over these)
        self.num_accepted_per_position: list[int] = []  # [i]: kept as the (i + 1)-th draft

    def count(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verify pass; a draft at position i is kept when the first i + 1 are."""
        self.num_draft_tokens += num_drafts
        self.num_accepted_drafts += num_accepted
        self.num_drafted_steps += 1
        missing = num_drafts - len(self.num_accepted_per_position)
        self.num_accepted_per_position += [0] * max(missing, 0)
        for position in range(num_accepted):
            self.num_accepted_per_position[position] += 1


def settle_drafts(req: Request, accepted: Sequence[int], books: DraftBooks) -> list[int]:
    """The drafts the request's step kept (``accepted``, the result's; they come before its
    sampled token), counted in ``books``; the rejected ones' positions were computed for
    nothing and count as not computed."""
    num_drafts, req.num_drafts = req.num_drafts, 0
    if not num_drafts:
        return []
    if len(accepted) > num_drafts:
        raise ValueError(f"request {req.request_id}: {num_drafts} drafts, the worker kept "
                         f"{len(accepted)}")
    books.count(num_drafts, len(accepted))
    if req.known_to_worker:  # (a preempted request recomputes from 0 anyway)
        req.num_computed_tokens -= num_drafts - len(accepted)
    return list(accepted)


class Drafter(Protocol):
    """What the scheduler core calls, step by step (``NoDrafts``, ``DraftPolicy``)."""

    enabled: bool
    step_cap: int  # the most drafts a request may get in the step being planned

    def drafts_at(self, num_running: int) -> bool: ...
    def for_request(self, req: Request, budget: int, max_model_len: int) -> Drafts: ...
    def worth_waiting(self, request_id: str, token_ids: Sequence[int],
                      sampling: SamplingParams) -> bool: ...
    def planned(self, plan: StepPlan) -> None: ...
    def step_done(self, plan: StepPlan, result: StepResult) -> None: ...
    def forget(self, req: Request) -> None: ...


class NoDrafts:
    """No speculation: every decode computes its one token; nothing is kept."""

    enabled = False
    step_cap = 0

    def drafts_at(self, num_running: int) -> bool:
        return False

    def for_request(self, req: Request, budget: int, max_model_len: int) -> Drafts:
        return NO_DRAFTS

    def worth_waiting(self, request_id: str, token_ids: Sequence[int],
                      sampling: SamplingParams) -> bool:
        return False

    def planned(self, plan: StepPlan) -> None:
        pass

    def step_done(self, plan: StepPlan, result: StepResult) -> None:
        pass

    def forget(self, req: Request) -> None:
        pass


class DraftPolicy:
    """Drafts for the requests that can take them, from ``proposer``, within each step's
    draft cap (draft_budget.py)."""

    enabled = True

    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config = config
        self.proposer = proposer  # (a benchmark may install another before the first step)
        self.budget = DraftBudget(config.num_speculative_tokens)  # draft_budget.py
        self.step_cap = config.num_speculative_tokens  # drafts a request, this step

    def drafts_at(self, num_running: int) -> bool:
        """Whether requests are drafted for in the step being planned, with this many
        running (the draft cap of that step is chosen here)."""
        limit = self.config.disable_by_batch_size
        if limit and num_running > limit:
            self.step_cap = 0
        elif self.config.adaptive:
            self.step_cap = self.budget.cap(num_running)
        else:
            self.step_cap = self.config.num_speculative_tokens
        return self.step_cap > 0

    def for_request(self, req: Request, budget: int, max_model_len: int) -> Drafts:
        """Drafts for a decode whose last token is known (none in flight), within its
        max_tokens, the context and the step's token ``budget``."""
        if req.num_pending_tokens:
            return NO_DRAFTS
        limit = min(req.sampling.max_tokens - len(req.output_token_ids) - 1,
                    max_model_len - req.num_tokens - 1, budget - 1)
        return self.drafts(req.request_id, req.all_token_ids, req.sampling, limit)

    def drafts(self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
               limit: int) -> Drafts:
        """Drafts after ``token_ids``, at most ``limit`` (what max_tokens, the context and
        the step's token budget leave) and the step's draft cap (at most
        num_speculative_tokens); none for a request ``can_speculate`` refuses."""
        if limit <= 0 or not can_speculate(sampling):
            return NO_DRAFTS
        return self.proposer.propose(request_id, token_ids, min(limit, self.step_cap))

    def worth_waiting(self, request_id: str, token_ids: Sequence[int],
                      sampling: SamplingParams) -> bool:
        """Whether a request whose next token is still being sampled should wait for it
        (skip the step planned meanwhile) so that its next step can verify drafts: when
        its known tokens end in a repeat, a copy is likely going on. Otherwise it is
        planned ahead as usual (overlapped steps), and tries drafts when its result is in."""
        return self.drafts(request_id, token_ids, sampling, 1).num_drafts > 0

    def planned(self, plan: StepPlan) -> None:
        """The step just planned (after ``drafts_at``): its drafts count at this cap."""
        self.budget.planned(plan.step_id, self.step_cap)

    def step_done(self, plan: StepPlan, result: StepResult) -> None:
        """A step's result is in: the adaptive cap's books of drafts offered and kept, and
        of the step's time."""
        drafts = []  # (offered, kept) of each decode; none to count in a step without drafts
        counted = plan.scheduled if self.budget.planned_cap(plan.step_id) else ()
        kept = dict(zip(result.request_ids, result.num_accepted_drafts)) if counted else {}
        for scheduled in counted:
            if scheduled.num_new_tokens == 1 + scheduled.num_drafts:
                drafts.append((scheduled.num_drafts, kept.get(scheduled.request_id, 0)))
        num_rows = sum(s.num_new_tokens for s in plan.scheduled)
        # a draft model's catch-up over a context (a request's first drafted step) is a
        # one-off: more tokens than the step's own is not what a step of its size costs
        self.budget.step_done(plan.step_id, num_rows, drafts,
                              timed=result.num_draft_catch_up_tokens <= num_rows)

    def forget(self, req: Request) -> None:
        """The request finished (or was aborted): drop what was kept for it."""
        self.proposer.forget(req)


# method -> its proposer, from the config
PROPOSERS: dict[str, Callable[[SpeculativeConfig], Proposer]] = {
    "ngram": lambda config: NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max),
    "suffix": SuffixProposer,
    "draft_model": lambda config: WorkerSlots(),
    "eagle": lambda config: WorkerSlots(),  # (an EAGLE head fills them: eagle_proposer.py)
    "eagle3": lambda config: WorkerSlots(),
}


def drafter(config: SpeculativeConfig | None, worker_drafts: bool = True) -> Drafter:
    """The scheduler's drafter for ``--speculative-config`` (None: off). ``worker_drafts``:
    the worker can fill draft slots (it has a draft model); without it method draft_model
    drafts nothing (host-side methods need no worker model)."""
    if config is None or (config.method in WORKER_METHODS and not worker_drafts):
        return NoDrafts()
    return DraftPolicy(config, PROPOSERS[config.method](config))
