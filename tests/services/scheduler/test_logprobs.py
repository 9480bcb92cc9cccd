"""Sampled-token and prompt logprobs: passed from the worker's results into outputs."""

from __future__ import annotations

import pytest

from shared.messages import StepResult, TokenLogprobs
from tests.services.scheduler.test_scheduler import (
    FakeWorker, expected_tokens, make_scheduler, request, run_to_completion,
)


def outputs_of(record, request_id):
    return [o for o in record if o.request_id == request_id]


def expected_prompt_logprobs(prompt):
    """What FakeWorker computes: -position for every prompt token but the first."""
    return [None] + [TokenLogprobs(token, -float(i)) for i, token in enumerate(prompt) if i]


def test_sampled_logprobs_go_into_each_output_where_asked():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    scheduler.add_request(request("lp", 5, 4, logprobs=2, ignore_eos=True))
    scheduler.add_request(request("plain", 5, 4, ignore_eos=True))
    record = []
    outputs, _, _ = run_to_completion(scheduler, worker, record=record)
    assert [o.logprobs for o in outputs_of(record, "lp")] == \
        [[TokenLogprobs(token, -0.25)] for token in outputs["lp"]]
    assert all(o.logprobs == [] and o.prompt_logprobs == [] for o in outputs_of(record, "plain"))


def test_a_result_without_logprobs_from_an_older_worker():
    scheduler = make_scheduler()
    scheduler.add_request(request("lp", 5, 4, logprobs=2))
    plan = scheduler.schedule()
    [emitted] = scheduler.update(plan, StepResult(plan.step_id, ["lp"], [7]))
    assert emitted.output.new_token_ids == [7] and emitted.output.logprobs == []


@pytest.mark.parametrize("depth", [1, 2])
def test_prompt_logprobs_gathered_over_chunks_come_with_the_first_output(depth):
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker(64)
    req = request("p", 30, 3, prompt_logprobs=1, ignore_eos=True)
    scheduler.add_request(req)
    record = []
    outputs, _, plans = run_to_completion(scheduler, worker, depth=depth, record=record)
    assert len([p for p in plans if p.scheduled[0].num_new_tokens > 1]) == 4  # 8 + 8 + 8 + 6
    first, *rest = outputs_of(record, "p")
    assert first.prompt_logprobs == expected_prompt_logprobs(req.prompt_token_ids)
    assert all(o.prompt_logprobs == [] for o in rest)
    assert outputs["p"] == expected_tokens("p", 30, 3)


def test_prompt_logprobs_take_no_prefix_hits_but_leave_blocks_for_others():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    prompt = list(range(100, 114))
    scheduler.add_request(request("a", 0, 1, prompt=prompt))
    run_to_completion(scheduler, worker)
    scheduler.add_request(request("b", 0, 1, prompt=prompt, prompt_logprobs=0))
    scheduler.add_request(request("c", 0, 1, prompt=prompt + [5]))
    record = []
    _, _, plans = run_to_completion(scheduler, worker, record=record)
    new = {n.request_id: n for p in plans for n in p.new_requests}
    assert new["b"].num_computed_tokens == 0  # a's blocks are cached, but b needs every logit
    assert new["c"].num_computed_tokens == 12
    [first_b] = outputs_of(record, "b")
    assert first_b.num_cached_tokens == 0
    assert first_b.prompt_logprobs == expected_prompt_logprobs(prompt)


def test_prompt_logprobs_of_a_request_preempted_mid_prompt_are_not_repeated():
    # "a" decodes and grows; "p" chunks its 36-token prompt and is preempted (each time
    # "a" needs a block), and recomputes from 0 when admitted again.
    scheduler, worker = make_scheduler(num_blocks=10, max_num_batched_tokens=8,
                                       admission_reserve=False), FakeWorker(10)
    scheduler.add_request(request("a", 4, 30, ignore_eos=True))
    req = request("p", 36, 2, prompt_logprobs=0, ignore_eos=True)
    scheduler.add_request(req)
    record = []
    outputs, _, plans = run_to_completion(scheduler, worker, depth=2, record=record)
    assert scheduler.num_preemptions >= 1
    assert [n.request_id for p in plans for n in p.new_requests].count("p") >= 2
    first, *_ = outputs_of(record, "p")
    assert first.prompt_logprobs == expected_prompt_logprobs(req.prompt_token_ids)
    assert outputs["p"] == expected_tokens("p", 36, 2)


def test_prompt_logprobs_of_steps_planned_before_a_preemption_are_dropped():
    # Results of steps planned before the request was sent again arrive late (several steps
    # in flight): they describe the abandoned computation.
    scheduler, worker = make_scheduler(max_num_batched_tokens=4), FakeWorker(64)
    req = request("p", 12, 1, prompt_logprobs=0, ignore_eos=True)
    scheduler.add_request(req)
    stale = scheduler.schedule()  # tokens 0..3
    scheduler._preempt(scheduler.requests["p"])  # as _grow_or_preempt would
    fresh = scheduler.schedule()  # sent again, tokens 0..3
    assert fresh.finished_request_ids == ["p"] and fresh.new_requests[0].request_id == "p"
    stale_result, fresh_result = worker.execute(stale), worker.execute(fresh)
    assert stale_result.prompt_logprobs["p"]  # the worker did compute them
    scheduler.update(stale, stale_result)
    scheduler.update(fresh, fresh_result)
    record = []
    run_to_completion(scheduler, worker, record=record)
    [first] = outputs_of(record, "p")
    assert first.prompt_logprobs == expected_prompt_logprobs(req.prompt_token_ids)


def test_siblings_that_want_prompt_logprobs_compute_the_prompt_each():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    req = request("r", 14, 2, n=2, prompt_logprobs=0, ignore_eos=True)
    scheduler.add_request(req)
    record = []
    _, _, plans = run_to_completion(scheduler, worker, record=record)
    assert [s.num_new_tokens for s in plans[0].scheduled] == [14, 14]
    for request_id in ("r-0", "r-1"):
        first = outputs_of(record, request_id)[0]
        assert first.prompt_logprobs == expected_prompt_logprobs(req.prompt_token_ids)
