"""Speculative decoding's benchmark-only modes (benchmarks/speculation_plugins.py): taken out of
a benchmark's JSON (vLLM's names), checked as the product's config was, and installed in
process: synthetic acceptance as the runner's acceptance rule (a set share of the drafts kept
whatever the model computes, seeded), replay as the scheduler's proposer."""

from __future__ import annotations

import json

import pytest

from benchmarks.speculation_plugins import (
    BenchmarkModes, ReplayProposer, SyntheticAcceptance, load_replay, split_speculative_config,
)
from services.worker.config import WorkerConfig
from services.worker.runner_build import build_runner
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.sections.speculative import SpeculativeConfig
from tests.services.worker.conftest import dummy_preset

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPT = [11, 12, 13, 14, 15, 16, 17]
BLOCKS = [0, 1, 2, 3, 4, 5]  # block_size 16: room for 96 tokens


def test_a_benchmarks_json_splits_into_the_products_config_and_its_modes(tmp_path):
    path = tmp_path / "replay.json"
    path.write_text('{"prompts": [[1, 2]], "outputs": [[3, 4]]}')
    config, modes = split_speculative_config(json.dumps({
        "method": "replay", "replay_path": str(path), "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic", "synthetic_acceptance_length": 2.5}))
    assert config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    assert modes == BenchmarkModes(replay_path=str(path), synthetic_acceptance_length=2.5)
    spec = '{"method": "draft_model", "model": "dummy:tiny-llama"}'
    assert split_speculative_config(spec) == (SpeculativeConfig(
        method="draft_model", model="dummy:tiny-llama"), BenchmarkModes())
    assert split_speculative_config("") == (None, BenchmarkModes())
    for bad, says in (('{"method": "replay"}', "replay_path"),
                      ('{"replay_path": "/x.json"}', "replay_path"),
                      ('{"rejection_sample_method": "block"}', "standard or synthetic"),
                      ('{"rejection_sample_method": "synthetic"}', "needs one"),
                      ('{"synthetic_acceptance_length": 2.0}', "goes with"),
                      ('{"rejection_sample_method": "synthetic", "num_speculative_tokens": 2, '
                       '"synthetic_acceptance_length": 3.5}', "between 1 and"),
                      ('{"method": "eagle"}', "eagle, eagle3, and each needs one"),
                      ('{"method": "medusa"}', "not supported")):
        with pytest.raises(ValueError, match=says):
            split_speculative_config(bad)


def test_a_replay_file_that_cannot_be_read_fails_naming_it(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"prompts": [[1, 2]], "outputs": [[3], [4]]}')
    for path, says in ((tmp_path / "missing.json", "No such file"), (bad, "1 prompts, 2 outputs")):
        with pytest.raises(ValueError, match=f"replay_path {path}: .*{says}"):
            split_speculative_config(f'{{"method": "replay", "replay_path": "{path}"}}')
        with pytest.raises(ValueError, match=f"replay_path {path}"):
            load_replay(str(path))


def test_replay_proposes_the_saved_output_after_the_longest_saved_prompt():
    proposer = ReplayProposer({(1, 2): [3, 4, 5, 6], (1, 2, 9): [7, 8]})
    assert proposer.propose("a", [1, 2, 3, 4], 3).token_ids == [5, 6]  # 2 outputs so far
    assert proposer.propose("b", [1, 2, 9], 4).token_ids == [7, 8]
    assert proposer.propose("c", [5, 6], 2).token_ids == []  # not saved


def test_synthetic_acceptance_keeps_a_set_share_of_the_drafts_seeded():
    """floor(L - 1) drafts kept a verify step, one more with the fractional rest's chance
    (seeded: a run repeats), never more than were sent."""
    synthetic = SyntheticAcceptance(3.25)
    draws = [synthetic.num_kept(4) for _ in range(4000)]
    assert set(draws) == {2, 3} and 0.22 < draws.count(3) / len(draws) < 0.28
    assert synthetic.num_kept(1) == 1  # only one draft sent
    again = SyntheticAcceptance(3.25)
    assert [again.num_kept(4) for _ in range(4000)] == draws


def test_synthetic_acceptance_keeps_the_drafts_and_samples_after_them(tmp_path_factory):
    """Installed as the runner's acceptance rule, at an acceptance length of 3: the worker
    keeps 2 drafts whatever the model computes, and the token after them is the model's
    argmax at that row."""
    model = dummy_preset(tmp_path_factory, "tiny-llama")

    def runner():
        return build_runner(WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB",
                                         block_size=16), model)

    plain = runner()
    expected = list(plain.execute(StepPlan(0, [NewRequestData("r", PROMPT, GREEDY, BLOCKS)],
                                           [ScheduledRequest("r", len(PROMPT))])
                                  ).sampled_token_ids)
    for step_id in (1, 2):
        expected += plain.execute(StepPlan(step_id, [], [ScheduledRequest("r", 1)])
                                  ).sampled_token_ids
    forced = runner()
    forced.verify = SyntheticAcceptance(3.0)
    forced.execute(StepPlan(0, [NewRequestData("r", PROMPT, GREEDY, BLOCKS)],
                            [ScheduledRequest("r", len(PROMPT))]))
    wrong = [(expected[1] + 1) % 100, (expected[2] + 1) % 100, 7]
    result = forced.execute(StepPlan(1, [], [ScheduledRequest("r", 4, [], 3, wrong)]))
    assert result.accepted_draft_ids == [wrong[:2]]  # kept though the model disagrees
    state = forced._requests["r"]
    assert state.token_ids == PROMPT + expected[:1] + wrong[:2] + result.sampled_token_ids
    assert state.num_computed_tokens == len(PROMPT) + 3
    # the token after them: what plain decoding of those tokens gives
    prompt = PROMPT + expected[:1] + wrong[:2]
    assert runner().execute(StepPlan(0, [NewRequestData("r", prompt, GREEDY, BLOCKS)],
                                     [ScheduledRequest("r", len(prompt))])
                            ).sampled_token_ids == result.sampled_token_ids
