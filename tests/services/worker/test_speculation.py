"""Speculative decoding's worker side: a step that computes a request's last token and
its drafts keeps each draft while it equals the greedy argmax before it, then samples the
token after the last kept one; the request's tokens equal plain greedy decoding's. A request
that samples verifies by rejection sampling: the target's distribution, seeded draws
reproducible."""

from __future__ import annotations

import pytest
import torch

from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from services.worker.runner_build import build_runner
from services.worker.sampler import filtered_probs
from services.worker.speculation import reject_drafts
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17]
BLOCKS = [0, 1, 2, 3, 4, 5]  # block_size 16: room for 96 tokens


@pytest.fixture()
def runner(dummy_model) -> ModelRunner:
    return build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                    block_size=16), dummy_model)


def plain_greedy(runner: ModelRunner, num_tokens: int) -> list[int]:
    """The request's tokens one decode step at a time."""
    result = runner.execute(StepPlan(0, [NewRequestData("r", PROMPT, GREEDY, BLOCKS)],
                                     [ScheduledRequest("r", len(PROMPT))]))
    tokens = list(result.sampled_token_ids)
    for step_id in range(1, num_tokens):
        tokens += runner.execute(StepPlan(step_id, [], [ScheduledRequest("r", 1)])).sampled_token_ids
    return tokens


def test_kept_drafts_and_the_token_after_them_are_plain_greedy_decodings(runner, dummy_model):
    expected = plain_greedy(runner, 16)
    fresh = build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                     block_size=16), dummy_model)
    draws, sample = [], fresh.sampler.sample

    def counted_sample(logits, *args):
        draws.append(len(logits))
        return sample(logits, *args)

    fresh.sampler.sample = counted_sample
    result = fresh.execute(StepPlan(0, [NewRequestData("r", PROMPT, GREEDY, BLOCKS)],
                                    [ScheduledRequest("r", len(PROMPT))]))
    tokens = list(result.sampled_token_ids)
    wrong = (expected[3] + 1) % 100
    # drafts: right, right, wrong, right -> 2 kept, then the argmax after them (token 3)
    for step_id, drafts, kept in ((1, [expected[1], expected[2], wrong, expected[4]], 2),
                                  (2, [expected[4], expected[5]], 2),  # all kept: the bonus
                                  (3, [(expected[6] + 1) % 100], 0),
                                  (4, [expected[8], expected[9], expected[10]], 3)):
        result = fresh.execute(StepPlan(step_id, [], [ScheduledRequest(
            "r", 1 + len(drafts), [], len(drafts), drafts)]))
        assert result.num_accepted_drafts == [kept]
        tokens += drafts[:kept] + result.sampled_token_ids
        state = fresh._requests["r"]
        assert state.token_ids == PROMPT + tokens
        assert state.num_computed_tokens == len(PROMPT) + len(tokens) - 1
    assert tokens == expected[:len(tokens)] and len(tokens) == 12
    assert draws == [1]  # the prompt's; each verify step's token came with its verification
    # and plain decoding goes on from there
    result = fresh.execute(StepPlan(5, [], [ScheduledRequest("r", 1)]))
    assert result.sampled_token_ids == [expected[12]] and result.num_accepted_drafts == []


def test_drafts_must_follow_the_last_known_token(runner):
    runner.execute(StepPlan(0, [NewRequestData("r", PROMPT, GREEDY, BLOCKS)],
                            [ScheduledRequest("r", len(PROMPT))]))
    with pytest.raises(ValueError, match="2 drafts"):
        runner.execute(StepPlan(1, [], [ScheduledRequest("r", 2, [], 2, [5, 6])]))


# ---- rejection sampling (a request that samples)

def chi_square(counts: list[int], probs: list[float]) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs) if p > 0)


def test_rejection_sampling_draws_the_targets_distribution():
    """Over 20,000 seeds, the first token (the draft when kept, else a residual draw) follows
    the target's distribution at that position, and so does the second given the first
    draft was kept. Chi-square with 5 degrees of freedom: 20.5 is the 0.001 quantile, and the
    proposal's own distribution (all mass on the draft) would give thousands."""
    p0 = [0.30, 0.25, 0.20, 0.15, 0.07, 0.03]
    p1 = [0.05, 0.10, 0.40, 0.05, 0.30, 0.10]
    probs = torch.tensor([p0, p1])  # [num_drafts, vocab_size]
    drafts = [1, 4]
    first, second = [0] * 6, [0] * 6
    for seed in range(20_000):
        num_kept, token = reject_drafts(probs, drafts, seed, output_index=3)
        first[drafts[0] if num_kept > 0 else token] += 1
        if num_kept == 1:
            second[token] += 1
        elif num_kept == 2:
            second[drafts[1]] += 1
    assert chi_square(first, p0) < 20.5, first
    assert chi_square(second, p1) < 20.5, second
    assert abs(sum(second) / 20_000 - p0[drafts[0]]) < 0.015  # kept with p0(draft)


def test_a_rejected_draft_is_never_drawn_again_and_top_k_holds():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_k=2)
    probs = filtered_probs(logits, [params])  # only tokens 0 and 1 can come
    tokens = {reject_drafts(probs, [0], seed, 0)[1] for seed in range(300)}
    assert tokens == {None, 1}


def test_seeded_sampling_with_drafts_is_reproducible_and_keeps_drafts(dummy_model):
    """The same seeded request given the same drafts gives the same tokens, in any batch."""
    sampled = SamplingParams(temperature=0.7, seed=123, max_tokens=64, ignore_eos=True)

    def run(other: bool) -> tuple[list[int], list[int]]:
        fresh = build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                         block_size=16), dummy_model)
        new = [NewRequestData("r", PROMPT, sampled, BLOCKS)]
        scheduled = [ScheduledRequest("r", len(PROMPT))]
        if other:  # a greedy neighbour in the same steps
            new.append(NewRequestData("g", PROMPT[:3], GREEDY, [6, 7]))
            scheduled.append(ScheduledRequest("g", 3))
        result = fresh.execute(StepPlan(0, new, scheduled))
        tokens, kept = [result.sampled_token_ids[0]], []
        for step_id in range(1, 6):
            drafts = [tokens[-1], tokens[-1], 5]  # proposals the model may keep or not
            entries = [ScheduledRequest("r", 1 + len(drafts), [], len(drafts), drafts)]
            entries += [ScheduledRequest("g", 1)] if other else []
            result = fresh.execute(StepPlan(step_id, [], entries))
            kept.append(result.num_accepted_drafts[0])
            tokens += drafts[:kept[-1]] + [result.sampled_token_ids[0]]
        return tokens, kept

    alone, with_other = run(False), run(True)
    assert alone == with_other
    assert len(alone[0]) == 1 + sum(alone[1]) + 5


def test_verify_rows_are_adjusted_as_the_row_sampled_from_is(runner, dummy_model):
    """logit_bias and min_tokens adjust each verify row as the sampler adjusts the row it draws
    from, at that row's own output index: a bias makes token 42 the argmax, and min_tokens
    forbids it (a stop token) for the first 3 outputs. Drafts that cross that boundary are
    kept where plain decoding would give them; a 42 drafted too early is not."""
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True,
                            logit_bias={42: 100.0}, min_tokens=3, stop_token_ids=[42])
    plan = StepPlan(0, [NewRequestData("r", PROMPT, params, BLOCKS)],
                    [ScheduledRequest("r", len(PROMPT))])
    expected = list(runner.execute(plan).sampled_token_ids)
    for step_id in range(1, 6):
        expected += runner.execute(StepPlan(step_id, [], [ScheduledRequest("r", 1)])
                                   ).sampled_token_ids
    assert 42 not in expected[:3] and expected[3:] == [42, 42, 42]
    fresh = build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                     block_size=16), dummy_model)
    tokens = list(fresh.execute(plan).sampled_token_ids)
    early = fresh.execute(StepPlan(1, [], [ScheduledRequest("r", 3, [], 2, [42, 42])]))
    assert early.num_accepted_drafts == [0]  # output 1: 42 still forbidden
    tokens += early.sampled_token_ids
    # outputs 2, 3, 4 drafted: the first as plain decoding gives it, then 42 twice
    crossing = fresh.execute(StepPlan(2, [], [ScheduledRequest("r", 4, [], 3, expected[2:5])]))
    assert crossing.num_accepted_drafts == [3]
    tokens += expected[2:5] + crossing.sampled_token_ids
    assert tokens == expected
