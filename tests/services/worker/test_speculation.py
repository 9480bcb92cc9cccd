"""Speculative decoding's worker side: a step that computes a request's last token and
its drafts keeps each draft while it equals the greedy argmax before it, then samples the
token after the last kept one; the request's tokens equal plain greedy decoding's."""

from __future__ import annotations

import pytest

from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17]
BLOCKS = [0, 1, 2, 3, 4, 5]  # block_size 16: room for 96 tokens


@pytest.fixture()
def runner(dummy_model) -> ModelRunner:
    return ModelRunner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
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
    fresh = ModelRunner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                     block_size=16), dummy_model)
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
            "r", 1 + len(drafts), [], drafts)]))
        assert result.num_accepted_drafts == [kept]
        tokens += drafts[:kept] + result.sampled_token_ids
        state = fresh._requests["r"]
        assert state.token_ids == PROMPT + tokens
        assert state.num_computed_tokens == len(PROMPT) + len(tokens) - 1
    assert tokens == expected[:len(tokens)] and len(tokens) == 12
    # and plain decoding goes on from there
    result = fresh.execute(StepPlan(5, [], [ScheduledRequest("r", 1)]))
    assert result.sampled_token_ids == [expected[12]] and result.num_accepted_drafts == []


def test_drafts_must_follow_the_last_known_token(runner):
    runner.execute(StepPlan(0, [NewRequestData("r", PROMPT, GREEDY, BLOCKS)],
                            [ScheduledRequest("r", len(PROMPT))]))
    with pytest.raises(ValueError, match="2 drafts"):
        runner.execute(StepPlan(1, [], [ScheduledRequest("r", 2, [], [5, 6])]))
