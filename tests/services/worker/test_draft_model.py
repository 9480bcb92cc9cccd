"""Speculative decoding's draft model in the worker (draft_model.py): a step with draft slots
runs the draft model first, verifies what it proposed, and returns the drafts it kept. The served
model drafting for itself proposes its own greedy continuation, so every draft is kept; a
draft model that disagrees changes how many are kept, never the tokens. Its KV follows the
request: a prompt too long for one forward is caught up in pieces, rejected drafts' positions
are computed again."""

from __future__ import annotations

import json

import pytest

from services.worker.config import WorkerConfig
from services.worker.runner import ModelRunner
from services.worker.runner_build import build_runner
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import DUMMY_MARKER, PRESETS_DIR, ModelFiles
from shared.sections.speculative import SpeculativeConfig
from tests.services.worker import model_checks

GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
# the tiny random model repeats this prompt's last token 19 times, then 6457: the drafts must
# foresee the change
PROMPT = [101, 2050, 3077, 999, 41, 8]
BLOCKS = [0, 1, 2, 3, 4, 5]  # block_size 16: room for 96 tokens


def config(draft: ModelFiles | None = None, **overrides) -> WorkerConfig:
    return WorkerConfig(device="cpu", dtype="float32", kv_cache_memory="4MiB", block_size=16,
                        speculative_config=SpeculativeConfig(
                            method="draft_model", model=str(draft.path)) if draft else None,
                        **overrides)


def tiny_variant(tmp_path_factory, name: str, **changes) -> ModelFiles:
    """The tiny preset with some fields changed: other random weights, or another shape."""
    path = tmp_path_factory.mktemp(name)
    preset = json.loads((PRESETS_DIR / "tiny-llama.json").read_text())
    (path / "config.json").write_text(json.dumps({**preset, "eos_token_id": None, **changes}))
    (path / DUMMY_MARKER).write_text("random weights\n")
    return ModelFiles(name=name, path=path)


def greedy_tokens(runner: ModelRunner, prompt: list[int], num_tokens: int) -> list[int]:
    """The request's tokens one plain decode step at a time."""
    return model_checks.greedy_tokens(runner, prompt, num_tokens, BLOCKS, GREEDY)


def drafted_tokens(runner: ModelRunner, prompt: list[int], slots: list[int],
                   catch_ups: list[int] | None = None
                   ) -> tuple[list[int], list[tuple[int, int]]]:
    """Prefill, then one step per entry of ``slots`` with that many draft slots -> (the
    request's tokens, (slots, drafts kept) per step); ``catch_ups`` gets each step's
    reported draft catch-up."""
    result = runner.execute(StepPlan(0, [NewRequestData("r", prompt, GREEDY, BLOCKS)],
                                     [ScheduledRequest("r", len(prompt))]))
    tokens, steps = list(result.sampled_token_ids), []
    for step_id, num_slots in enumerate(slots, start=1):
        result = runner.execute(StepPlan(step_id, [], [ScheduledRequest(
            "r", 1 + num_slots, num_drafts=num_slots)]))
        [kept] = result.accepted_draft_ids
        assert len(kept) <= num_slots
        tokens += kept + result.sampled_token_ids
        steps.append((num_slots, len(kept)))
        if catch_ups is not None:
            catch_ups.append(result.num_draft_catch_up_tokens)
        state = runner._requests["r"]
        assert state.token_ids == prompt + tokens
        assert state.num_computed_tokens == len(prompt) + len(tokens) - 1
        assert state.num_draft_computed <= len(state.token_ids) - 1
    return tokens, steps


def test_the_served_model_drafting_for_itself_proposes_its_greedy_continuation(dummy_model):
    expected = greedy_tokens(build_runner(config(), dummy_model), PROMPT, 40)
    assert expected[18:20] == [8, 6457]
    runner = build_runner(config(draft=dummy_model), dummy_model)
    catch_ups: list[int] = []
    tokens, steps = drafted_tokens(runner, PROMPT, [4, 2, 1, 4, 4, 4, 4], catch_ups)
    assert tokens == expected[:len(tokens)] and len(tokens) == 1 + 5 + 3 + 2 + 5 * 4
    # the first drafted step computes the prompt's 6 tokens besides the sampled one; later
    # ones at most the last draft, never an input (the scheduler times only those steps)
    assert catch_ups[0] == len(PROMPT) and max(catch_ups[1:]) <= 1, catch_ups
    assert all(kept == num_slots for num_slots, kept in steps)
    # every draft kept: the last one was never an input to the draft model, so the next step
    # computes it and the bonus token in its first pass
    assert runner._requests["r"].num_draft_computed == len(PROMPT) + len(tokens) - 2


def test_a_draft_model_that_disagrees_changes_what_is_kept_never_the_tokens(
        dummy_model, tmp_path_factory):
    # an untied random head: it does not just repeat the last token
    other = tiny_variant(tmp_path_factory, "other-draft", num_hidden_layers=1,
                         tie_word_embeddings=False)
    expected = greedy_tokens(build_runner(config(), dummy_model), PROMPT, 45)
    runner = build_runner(config(draft=other), dummy_model)
    tokens, steps = drafted_tokens(runner, PROMPT, [4] * 8)
    assert tokens == expected[:len(tokens)]
    assert sum(kept for _, kept in steps) < sum(num_slots for num_slots, _ in steps) // 2


def test_a_catch_up_beyond_the_token_budget_runs_in_pieces(dummy_model):
    """A 40-token prompt's first draft with a 16-token budget: three catch-up forwards, the
    drafts still the greedy continuation."""
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    expected = greedy_tokens(build_runner(config(), dummy_model), prompt, 12)
    runner = build_runner(config(draft=dummy_model, max_num_batched_tokens=16, max_num_seqs=16),
                         dummy_model)
    tokens, steps = drafted_tokens(runner, prompt, [4, 4])
    assert tokens == expected[:len(tokens)]
    assert all(kept == num_slots for num_slots, kept in steps)


def test_a_batch_mixing_draft_slots_plain_decodes_and_a_prompt_equals_plain_decoding(
        dummy_model):
    prompts = {"a": PROMPT, "b": [21, 22, 23], "c": [31, 32, 33, 34, 35]}
    expected = {rid: greedy_tokens(build_runner(config(), dummy_model), p, 10)
                for rid, p in prompts.items()}
    runner = build_runner(config(draft=dummy_model), dummy_model)
    blocks = {"a": [0, 1], "b": [2, 3], "c": [4, 5]}
    news = [NewRequestData(rid, p, GREEDY, blocks[rid]) for rid, p in prompts.items()]
    first = runner.execute(StepPlan(0, news[:2], [ScheduledRequest("a", len(PROMPT)),
                                                  ScheduledRequest("b", 3)]))
    tokens = dict(zip(first.request_ids, ([t] for t in first.sampled_token_ids)))
    # a: 3 slots, b: a plain decode, c: its whole prompt, in one step
    result = runner.execute(StepPlan(1, news[2:], [
        ScheduledRequest("a", 4, num_drafts=3), ScheduledRequest("b", 1),
        ScheduledRequest("c", 5)]))
    assert result.accepted_draft_ids[1:] == [[], []]
    for rid, token, kept in zip(result.request_ids, result.sampled_token_ids,
                                result.accepted_draft_ids):
        tokens.setdefault(rid, [])
        tokens[rid] += kept + [token]
    assert result.num_accepted_drafts[0] == 3
    for rid, got in tokens.items():
        assert got == expected[rid][:len(got)], rid


def test_draft_slots_need_a_draft_model(dummy_model):
    runner = build_runner(config(), dummy_model)
    runner.execute(StepPlan(0, [NewRequestData("r", PROMPT, GREEDY, BLOCKS)],
                            [ScheduledRequest("r", len(PROMPT))]))
    with pytest.raises(ValueError, match="no draft model"):
        runner.execute(StepPlan(1, [], [ScheduledRequest("r", 3, num_drafts=2)]))


def test_a_draft_model_of_another_vocabulary_is_refused(dummy_model, tmp_path_factory):
    other = tiny_variant(tmp_path_factory, "small-vocab", vocab_size=1000)
    with pytest.raises(ValueError, match="vocabulary of 1000 tokens"):
        build_runner(config(draft=other), dummy_model)
