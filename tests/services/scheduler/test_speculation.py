"""Speculative decoding's scheduler side: prompt-lookup drafts, the config, and the
bookkeeping of a step that verified drafts (kept ones become outputs before the sampled
token; rejected ones count as not computed)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.scheduler.speculation import (
    NO_DRAFTS, DraftPolicy, NgramIndex, NoDrafts, can_speculate, drafter, host_drafts,
)
from shared.messages import GenerateRequest, SamplingParams, StepPlan, StepResult, StructuredSpec
from shared.sections.speculative import SpeculativeConfig, parse_speculative_config

EOS = 0
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "adaptive": false}'


def ngram_drafts(token_ids: Sequence[int], num_drafts: int, min_n: int, max_n: int) -> list[int]:
    """The reference lookup, a scan: up to ``num_drafts`` tokens that followed the latest earlier occurrence of the
    longest suffix of ``token_ids`` (``max_n`` down to ``min_n`` tokens) that occurs
    earlier; [] when none does."""
    length = len(token_ids)
    if num_drafts <= 0:
        return []
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = list(token_ids[length - n:])
        # latest start before the suffix itself whose n tokens equal it
        for start in range(length - n - 1, -1, -1):
            if token_ids[start] == suffix[0] and list(token_ids[start:start + n]) == suffix:
                follow = token_ids[start + n:start + n + num_drafts]
                return list(follow)
    return []


def test_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix():
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 3, 4, 6, 7]
    # suffix [6, 7] last occurred at 6..7, followed by 3, 4, 6
    assert ngram_drafts(tokens, 3, 2, 4) == [3, 4, 6]
    # the longer suffix [4, 6, 7] never occurred before: the shorter one decides
    assert ngram_drafts(tokens, 3, 3, 4) == []
    assert ngram_drafts([1, 2, 3, 1, 2], 5, 2, 3) == [3, 1, 2]  # as many as follow
    assert ngram_drafts([1, 2, 3], 4, 1, 2) == []  # nothing repeats
    assert ngram_drafts([7, 7], 2, 1, 1) == [7]
    assert ngram_drafts([1, 2, 1, 2], 0, 1, 2) == []


def test_the_incremental_index_drafts_what_the_scan_drafts():
    rng = random.Random(3)
    for _ in range(200):
        tokens = [rng.randrange(5) for _ in range(rng.randint(1, 12))]
        index = NgramIndex(2, 4)
        for length in range(1, len(tokens) + 1):  # grown token by token, as a request is
            assert index.drafts(tokens[:length], 3) == ngram_drafts(tokens[:length], 3, 2, 4)
    index = NgramIndex(1, 3)
    tokens = [rng.randrange(4) for _ in range(50)]
    assert index.drafts(tokens, 4) == ngram_drafts(tokens, 4, 1, 3)  # all at once


def test_the_config_takes_vllms_names_and_refuses_what_it_cannot_do():
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
                                      '"prompt_lookup_max": 3, "prompt_lookup_min": 1}')
    assert config == SpeculativeConfig(num_speculative_tokens=5, prompt_lookup_max=3,
                                       prompt_lookup_min=1)
    assert parse_speculative_config("") is None
    for bad, says in (('{"method": "medusa"}', "not supported"),
                      ('{"method": "eagle"}', "model goes with methods"),
                      ('{"num_speculative_tokens": 0}', "between 1 and 16"),
                      ('{"prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_min"),
                      ('{"num_speculative_tokens": 4, "bogus": 1}', "bogus"),
                      # benchmark-only modes are not the product's (benchmarks/
                      # speculation_plugins.py takes them out of a benchmark's JSON)
                      ('{"method": "replay"}', "not supported"),
                      ('{"replay_path": "/x.json"}', "replay_path"),
                      ('{"rejection_sample_method": "synthetic"}', "rejection_sample_method"),
                      ("{ngram}", "not JSON")):
        with pytest.raises(ValueError, match=says):
            parse_speculative_config(bad)
    with pytest.raises(ValueError, match="not supported"):
        SchedulerConfig(speculative_config=parse_speculative_config('{"method": "medusa"}'))


def test_requests_whose_adjustments_depend_only_on_the_position_are_drafted_for():
    greedy = SamplingParams(temperature=0.0)
    assert can_speculate(greedy) and can_speculate(SamplingParams(top_k=1))
    # sampling with temperature, top-k and top-p: rejection sampling keeps the distribution
    assert can_speculate(SamplingParams(temperature=0.7, top_k=20, top_p=0.9))
    # the worker adjusts each verify row as it adjusts the row it samples from
    for adjusted in (SamplingParams(temperature=0.7, min_p=0.1),
                     SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
                     SamplingParams(temperature=0.0, min_tokens=4)):
        assert can_speculate(adjusted)
    for other in (SamplingParams(temperature=0.0, logprobs=2),
                  SamplingParams(temperature=0.0, repetition_penalty=1.1),
                  SamplingParams(temperature=0.0, speculative=False),  # opted out
                  SamplingParams(temperature=0.0, structured=StructuredSpec(kind="json_object"))):
        assert not can_speculate(other)
        assert drafter(SpeculativeConfig()).drafts("r", [1, 2, 1, 2], other, 4) == NO_DRAFTS


def scheduler(spec: str = NGRAM, **config) -> Scheduler:
    return Scheduler(SchedulerConfig(speculative_config=parse_speculative_config(spec), **config), num_blocks=64,
                     block_size=4, max_model_len=128, eos_token_ids=[EOS])


def submit(core: Scheduler, prompt: list[int], max_tokens: int = 20) -> None:
    core.add_request(GenerateRequest(request_id="r", prompt_token_ids=prompt,
                                     sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
                                     output_subject="out"))


def kept(plan: StepPlan, num_kept: int) -> list[list[int]]:
    """A result's accepted_draft_ids for a plan of one request whose first ``num_kept``
    drafts (the scheduler's) the worker kept."""
    return [plan.scheduled[0].draft_token_ids[:num_kept]]


def step(core: Scheduler, sampled: int, accepted: int | None = None):
    plan = core.schedule()
    result = StepResult(plan.step_id, [s.request_id for s in plan.scheduled], [sampled],
                        accepted_draft_ids=[] if accepted is None else kept(plan, accepted))
    return plan, core.update(plan, result)


def test_a_verify_step_outputs_the_kept_drafts_then_its_token():
    core = scheduler()
    submit(core, [9, 1, 2, 3, 4, 1, 2])
    plan, emitted = step(core, sampled=3)  # the prompt; it samples 3
    req = core.requests["r"]
    assert emitted[0].output.new_token_ids == [3] and req.num_computed_tokens == 7
    plan, _ = core.schedule(), None
    # after [.., 1, 2, 3] the lookup finds [1, 2, 3] at 1..3, followed by 4, 1, 2
    assert plan.scheduled[0].draft_token_ids == [4, 1, 2]
    assert plan.scheduled[0].num_drafts == 3
    assert plan.scheduled[0].num_new_tokens == 4  # the last token and its 3 drafts
    assert core.schedule() is None  # not planned again before the result says what it kept
    emitted = core.update(plan, StepResult(plan.step_id, ["r"], [7],
                                           accepted_draft_ids=[[4, 1]]))
    assert emitted[0].output.new_token_ids == [4, 1, 7]
    assert req.output_token_ids == [3, 4, 1, 7]
    # computed: the prompt, 3, and the kept 4 and 1; 7 is the next step's input
    assert req.num_computed_tokens == 10 and req.num_tokens == 11
    books = core.draft_books
    assert (books.num_draft_tokens, books.num_accepted_drafts) == (3, 2)
    # one verify pass; its first two draft positions kept, the third not
    assert books.num_drafted_steps == 1
    assert books.num_accepted_per_position == [1, 1, 0]
    next_plan = core.schedule()
    assert next_plan.scheduled[0].num_new_tokens == 1 + len(next_plan.scheduled[0].draft_token_ids)


DRAFT_MODEL = ('{"method": "draft_model", "model": "dummy:llama-3.2-1b", "num_speculative_tokens": 3, '
               '"adaptive": false}')


def test_a_draft_model_gets_slots_and_the_result_says_what_it_proposed():
    """method draft_model: the plan carries draft slots, not drafts, for every request that
    can take drafts (no repeat needed); the result's drafts are what the output keeps."""
    with pytest.raises(ValueError, match="model goes with methods draft_model"):
        SpeculativeConfig(method="draft_model")
    worker = WorkerConfig(speculative_config=parse_speculative_config(DRAFT_MODEL))
    assert (worker.draft_model, worker.num_speculative_tokens) == ("dummy:llama-3.2-1b", 3)
    ngram = WorkerConfig(speculative_config=parse_speculative_config(NGRAM))
    assert (ngram.draft_model, ngram.num_speculative_tokens) == ("", 3)
    assert (WorkerConfig().draft_model, WorkerConfig().num_speculative_tokens) == ("", 0)
    core = scheduler(DRAFT_MODEL)
    submit(core, [9, 8, 7])
    step(core, sampled=5)
    plan = core.schedule()
    verify = plan.scheduled[0]
    assert (verify.draft_token_ids, verify.num_drafts, verify.num_new_tokens) == ([], 3, 4)
    emitted = core.update(plan, StepResult(plan.step_id, ["r"], [6],
                                           accepted_draft_ids=[[11, 12]]))
    assert emitted[0].output.new_token_ids == [11, 12, 6]
    req = core.requests["r"]
    assert req.output_token_ids == [5, 11, 12, 6] and req.num_computed_tokens == 6
    plan = core.schedule()
    with pytest.raises(ValueError, match="3 drafts, the worker kept 4"):
        core.update(plan, StepResult(plan.step_id, ["r"], [6],
                                     accepted_draft_ids=[[11, 12, 13, 14]]))


def test_a_worker_without_a_draft_model_gets_plain_decode_steps():
    """A deployment whose worker lacks --draft-model (WorkerInfo.draft_model ""): draft slots
    would fail every step the worker takes, so the scheduler drafts nothing; n-gram drafts
    need no worker model and stay."""
    core = Scheduler(SchedulerConfig(speculative_config=parse_speculative_config(DRAFT_MODEL)), num_blocks=64,
                     block_size=4, max_model_len=128, eos_token_ids=[EOS], worker_drafts=False)
    assert not core.drafter.enabled
    submit(core, [9, 8, 7])
    step(core, sampled=5)
    plan = core.schedule()
    assert (plan.scheduled[0].num_drafts, plan.scheduled[0].num_new_tokens) == (0, 1)
    ngram = Scheduler(SchedulerConfig(speculative_config=parse_speculative_config(NGRAM)), num_blocks=64, block_size=4,
                      max_model_len=128, eos_token_ids=[EOS], worker_drafts=False)
    assert ngram.drafter.enabled


class FixedProposer:
    """Proposes [8, 8] after anything (a proposer plugged in, as a benchmark's is)."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def propose(self, request_id, token_ids, num_drafts):
        return host_drafts([8, 8][:num_drafts])

    def forget(self, req) -> None:
        self.forgotten.append(req.request_id)


def test_the_drafts_are_the_proposers_and_the_books_the_schedulers():
    """Off, the drafter is the null one, which holds nothing, and the scheduler's books stay
    at zero; on, the policy asks its proposer (one put in its place too) for each drafted
    request's drafts and tells it when a request is done."""
    off = scheduler(spec="")
    assert isinstance(off.drafter, NoDrafts) and not vars(off.drafter)
    submit(off, [1, 2, 3, 1, 2])
    step(off, sampled=3)
    assert off.schedule().scheduled[0].num_drafts == 0
    assert off.draft_books.num_drafted_steps == 0
    core = scheduler()
    assert isinstance(core.drafter, DraftPolicy)
    core.drafter.proposer = proposer = FixedProposer()
    submit(core, [9, 8, 7], max_tokens=4)
    step(core, sampled=5)
    plan, emitted = step(core, sampled=6, accepted=1)
    assert (plan.scheduled[0].num_drafts, plan.scheduled[0].draft_token_ids) == (2, [8, 8])
    assert emitted[0].output.new_token_ids == [8, 6]
    assert core.draft_books.num_accepted_per_position == [1, 0]
    step(core, sampled=9)  # the fourth token: done
    assert proposer.forgotten == ["r"]


def test_drafts_stop_at_max_tokens_and_an_end_among_them_ends_the_output():
    core = scheduler()
    submit(core, [1, 2, EOS, 5, 1, 2], max_tokens=3)
    step(core, sampled=EOS + 7)  # output [7]: two tokens left, one of them sampled
    plan = core.schedule()
    assert len(plan.scheduled[0].draft_token_ids) <= 1
    core2 = scheduler()
    submit(core2, [4, 1, 2, EOS, 5, 1, 2])
    step(core2, sampled=EOS + 8)  # [.., 1, 2, 8]: no drafts for [2, 8]
    plan = core2.schedule()
    assert plan.scheduled[0].draft_token_ids == []
    core3 = scheduler()
    submit(core3, [4, 1, 2, EOS, 5, 4, 1])
    step(core3, sampled=2)  # [.., 4, 1, 2]: drafts EOS, 5, 4
    plan = core3.schedule()
    assert plan.scheduled[0].draft_token_ids == [EOS, 5, 4]
    emitted = core3.update(plan, StepResult(plan.step_id, ["r"], [9],
                                            accepted_draft_ids=kept(plan, 3)))
    assert emitted[0].output.new_token_ids == [EOS] and emitted[0].output.finish_reason == "stop"
    assert "r" not in core3.requests


def test_without_the_config_no_drafts_are_sent():
    core = scheduler(spec="")
    submit(core, [1, 2, 3, 1, 2])
    step(core, sampled=3)
    assert core.schedule().scheduled[0].draft_token_ids == []
