"""Speculative decoding's drafts (issue 28), pure: which tokens a decode step verifies
beside its own.

``--speculative-config`` is JSON with vLLM's field names. ``method: "ngram"`` is prompt
lookup: the request's last n tokens (n from ``prompt_lookup_max`` down to
``prompt_lookup_min``) are looked for earlier in its prompt and output, and the tokens
that followed their latest earlier occurrence are proposed, up to
``num_speculative_tokens``. Drafting costs a few dictionary operations on the host per new
token (an n-gram index per request), nothing on the device. ``method: "suffix"``
(suffix.py) matches the longest suffix, up to ``suffix_decoding_max_tree_depth`` tokens, in
the request's own tokens and in recent requests' responses, and proposes more tokens the
longer the match (``suffix_decoding_max_spec_factor`` per matched token). ``method:
"replay"`` (a benchmark mode) proposes the next tokens of the request's saved output
(``replay_path``: JSON ``{"prompts": [[ids]], "outputs": [[ids]]}``, e.g. the same server's
greedy outputs without speculation): every draft then kept, it measures what the verify
machinery gives at full acceptance, whatever the proposer. ``rejection_sample_method:
"synthetic"`` (a benchmark mode, vLLM's name) keeps a set number of each step's drafts
whatever the model computes, ``synthetic_acceptance_length`` tokens a verify step on average
(the model's own token counted): ``floor(L - 1)`` drafts always and one more with the
fractional rest's probability. Output is then not the model's; engines can be compared at
one acceptance on random weights, where greedy tokens are near-ties and no draft survives.
``method: "draft_model"`` (``model``: the draft) plans draft slots instead (``ModelDrafts``):
the worker's draft model fills them before the step's forward and the result says what it
proposed (services/worker/draft_model.py).

The worker computes the request's last token and its drafts in one query; under greedy
decoding it keeps each draft while it equals the model's argmax at the position before,
then the argmax after the last kept one (docs/speculative-decoding.md). So the output is
the tokens plain greedy decoding gives, one to ``num_speculative_tokens + 1`` a step.

A request that samples keeps each draft with the model's probability of it and draws a
replacement at the first rejection (rejection sampling): the same distribution as plain
sampling. Requests with penalties, a grammar or logprobs are not drafted for
(``can_speculate``); they decode as before in the same steps.
``NoDrafts`` is the seam's null side: no speculation.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from pathlib import Path

import msgspec

from services.scheduler.draft_budget import DraftBudget
from services.scheduler.request import Request
from services.scheduler.suffix import ResponseCache, SuffixIndex
from shared.messages import SamplingParams, StepPlan, StepResult
from shared.sections.speculative import SpeculativeConfig, load_replay

DRAFT_SLOT = -1  # a draft the worker's draft model proposes (method draft_model)


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


class NoDrafts:
    """No speculation: every decode computes its one token. Also the books of drafts sent
    and kept, and what a step's result does to a request that verified drafts."""

    enabled = False
    drafts_in_worker = False  # drafts are slots the worker's draft model fills
    step_cap = 0  # the most drafts a request may get in the step being planned

    def drafts_at(self, num_running: int) -> bool:
        """Whether requests are drafted for in the step being planned, with this many
        running (the draft cap of that step is chosen here)."""
        return False

    def planned(self, plan: StepPlan) -> None:
        """The step just planned (after ``drafts_at``)."""

    def step_done(self, plan: StepPlan, result: StepResult) -> None:
        """A step's result is in."""

    def __init__(self) -> None:
        self.num_draft_tokens = 0  # cumulative: drafts verified
        self.num_accepted_drafts = 0  # of those, kept
        self.num_drafted_steps = 0  # a request's verify passes (mean kept: accepted over these)
        self.num_accepted_per_position: list[int] = []  # [i]: kept as the (i + 1)-th draft

    def for_request(self, req: Request, budget: int, max_model_len: int) -> list[int]:
        """Drafts for a decode whose last token is known (none in flight), within its
        max_tokens, the context and the step's token ``budget``."""
        if not self.enabled or req.num_pending_tokens:
            return []
        limit = min(req.sampling.max_tokens - len(req.output_token_ids) - 1,
                    max_model_len - req.num_tokens - 1, budget - 1)
        return self.drafts(req.request_id, req.all_token_ids, req.sampling, limit)

    def num_forced_accept(self, num_drafts: int) -> int:
        """How many of a step's ``num_drafts`` drafts the worker keeps whatever the model
        computes (synthetic acceptance), or -1: it verifies them."""
        return -1

    def settle(self, req: Request, num_accepted: int,
               worker_drafts: Sequence[int] = ()) -> list[int]:
        """The drafts the request's step kept (they come before its sampled token); the
        rejected ones' positions were computed for nothing and count as not computed.
        ``worker_drafts``: what the worker's draft model proposed for its draft slots."""
        drafts, req.draft_token_ids = req.draft_token_ids, []
        if not drafts:
            return []
        if self.drafts_in_worker:
            if len(worker_drafts) != len(drafts) or not 0 <= num_accepted <= len(drafts):
                raise ValueError(f"request {req.request_id}: {len(drafts)} draft slots, the "
                                 f"worker returned {len(worker_drafts)} drafts, "
                                 f"{num_accepted} kept")
            drafts = list(worker_drafts)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_drafts += num_accepted
        self.num_drafted_steps += 1
        self._count_positions(len(drafts), num_accepted)
        if req.known_to_worker:  # (a preempted request recomputes from 0 anyway)
            req.num_computed_tokens -= len(drafts) - num_accepted
        return drafts[:num_accepted]

    def _count_positions(self, num_drafts: int, num_accepted: int) -> None:
        """A draft at position i is kept when the first i + 1 are."""
        missing = num_drafts - len(self.num_accepted_per_position)
        self.num_accepted_per_position += [0] * max(missing, 0)
        for position in range(num_accepted):
            self.num_accepted_per_position[position] += 1

    def drafts(self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
               limit: int) -> list[int]:
        return []

    def worth_waiting(self, request_id: str, token_ids: Sequence[int],
                      sampling: SamplingParams) -> bool:
        return False

    def forget(self, req: Request) -> None:
        """The request finished (or was aborted): drop what was kept for it."""


class NgramDrafts(NoDrafts):
    """Prompt-lookup drafts for the requests that can take them (an n-gram index each)."""

    enabled = True

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__()
        self.config = config
        self._indexes: dict[str, NgramIndex] = {}
        self._synthetic_draws = random.Random(0)  # seeded: a benchmark run repeats
        self.budget = DraftBudget(config.num_speculative_tokens)  # draft_budget.py
        self.step_cap = config.num_speculative_tokens  # drafts a request, this step

    def num_forced_accept(self, num_drafts: int) -> int:
        if self.config.rejection_sample_method != "synthetic":
            return -1
        kept = self.config.synthetic_acceptance_length - 1.0  # drafts kept a step, on average
        whole = math.floor(kept)
        return min(num_drafts, whole + (self._synthetic_draws.random() < kept - whole))

    def drafts_at(self, num_running: int) -> bool:
        limit = self.config.disable_by_batch_size
        over = limit and num_running > limit
        if over:
            self.step_cap = 0
        elif self.config.adaptive:
            self.step_cap = self.budget.cap(num_running)
        else:
            self.step_cap = self.config.num_speculative_tokens
        return self.step_cap > 0

    def planned(self, plan: StepPlan) -> None:
        self.budget.planned(plan.step_id, self.step_cap)  # its drafts count at this cap

    def step_done(self, plan: StepPlan, result: StepResult) -> None:
        drafts = []  # (offered, kept) of each decode; none to count in a step without drafts
        counted = plan.scheduled if self.budget.planned_cap(plan.step_id) else ()
        kept = dict(zip(result.request_ids, result.num_accepted_drafts or ())) if counted else {}
        for scheduled in counted:
            offered = len(scheduled.draft_token_ids) + scheduled.num_draft_slots
            if scheduled.num_new_tokens == 1 + offered:
                drafts.append((offered, kept.get(scheduled.request_id, 0)))
        num_rows = sum(s.num_new_tokens for s in plan.scheduled)
        # a draft model's catch-up over a context (a request's first drafted step) is a
        # one-off: more tokens than the step's own is not what a step of its size costs
        self.budget.step_done(plan.step_id, num_rows, drafts,
                              timed=result.num_draft_catch_up_tokens <= num_rows)

    def _index(self, request_id: str) -> NgramIndex:
        index = self._indexes.get(request_id)
        if index is None:
            index = self._indexes[request_id] = NgramIndex(self.config.prompt_lookup_min,
                                                           self.config.prompt_lookup_max)
        return index

    def drafts(self, request_id: str, token_ids: Sequence[int], sampling: SamplingParams,
               limit: int) -> list[int]:
        """Drafts after ``token_ids``, at most ``limit`` (what max_tokens, the context and
        the step's token budget leave) and the step's draft cap (draft_budget.py: at most
        num_speculative_tokens); none for a request ``can_speculate`` refuses."""
        if limit <= 0 or not can_speculate(sampling):
            return []
        return self._propose(request_id, token_ids, min(limit, self.step_cap))

    def _propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        """The method's own proposal: at most ``num_drafts`` (>= 1) tokens after
        ``token_ids``."""
        return self._index(request_id).drafts(token_ids, num_drafts)

    def worth_waiting(self, request_id: str, token_ids: Sequence[int],
                      sampling: SamplingParams) -> bool:
        """Whether a request whose next token is still being sampled should wait for it
        (skip the step planned meanwhile) so that its next step can verify drafts: when
        its known tokens end in a repeat, a copy is likely going on. Otherwise it is
        planned ahead as usual (overlapped steps), and tries drafts when its result is in."""
        return bool(self.drafts(request_id, token_ids, sampling, 1))

    def forget(self, req: Request) -> None:
        self._indexes.pop(req.request_id, None)


class SuffixDrafts(NgramDrafts):
    """Suffix-lookup drafts (suffix.py): the longest earlier match of a request's suffix in
    its own tokens or in the responses of the last ``suffix_decoding_max_cached_requests``
    requests; a match of n tokens proposes up to ``ceil(n * max_spec_factor)``."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self._suffixes: dict[str, SuffixIndex] = {}
        self.responses = ResponseCache(config.prompt_lookup_min,
                                       config.suffix_decoding_max_tree_depth,
                                       config.suffix_decoding_max_cached_requests)

    def _propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> list[int]:
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
        return tokens[:min(num_drafts, max(1, math.ceil(matched * factor)))]

    def forget(self, req: Request) -> None:
        """Its output joins the responses later requests draft from."""
        self._suffixes.pop(req.request_id, None)
        self.responses.add(req.output_token_ids)


class ReplayDrafts(NgramDrafts):
    """A benchmark's drafts: the next tokens of the request's saved output (``replay_path``),
    found by its prompt; none for a prompt not saved."""

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.outputs = load_replay(config.replay_path)
        # the longest saved prompt a request starts with is its own
        self.prompt_lens = sorted({len(prompt) for prompt in self.outputs}, reverse=True)
        self._found: dict[str, tuple[int, list[int]]] = {}  # request -> (prompt len, output)

    def _propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        found = self._found.get(request_id)
        if found is None:
            found = next(((n, self.outputs[tuple(token_ids[:n])]) for n in self.prompt_lens
                          if tuple(token_ids[:n]) in self.outputs), (len(token_ids), []))
            self._found[request_id] = found
        prompt_len, output = found
        start = len(token_ids) - prompt_len  # output tokens so far
        return output[start:start + num_drafts]

    def forget(self, req: Request) -> None:
        self._found.pop(req.request_id, None)


class ModelDrafts(NgramDrafts):
    """Draft slots (method draft_model): a drafted request's step carries
    ``num_speculative_tokens`` slots (fewer near max_tokens, the context or the step's
    budget), which the worker's draft model fills before the step's forward; the result
    says what it proposed (StepResult.draft_token_ids). Every request that can take drafts
    waits for its token before its next step, so steps that verify are not overlapped."""

    drafts_in_worker = True

    def _propose(self, request_id: str, token_ids: Sequence[int], num_drafts: int) -> list[int]:
        return [DRAFT_SLOT] * num_drafts


def drafter(config: SpeculativeConfig | None) -> NoDrafts:
    if config is None:
        return NoDrafts()
    kinds = {"suffix": SuffixDrafts, "replay": ReplayDrafts, "draft_model": ModelDrafts}
    return kinds.get(config.method, NgramDrafts)(config)
