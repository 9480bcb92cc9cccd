"""Mixture-of-Experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) from Hub-layout checkpoints built from
SmolLM2's real weights (moe_checkpoints.py), against transformers on the same files: every
token's logits over chunked, paged steps, and greedy text on a batch of mixed prompt sizes. An
upcycled checkpoint (every expert SmolLM2's MLP) gives SmolLM2's own greedy text. Bad
checkpoints fail at load naming the tensor or field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from cli.engine import Engine
from services.scheduler.config import SchedulerConfig
from services.worker.config import WorkerConfig
from services.worker.model import ModelConfig
from services.worker.moe import take_expert_counts
from services.worker.weights import load_model
from shared.messages import NewRequestData, SamplingParams, ScheduledRequest, StepPlan
from shared.models import ModelFiles, resolve_model
from shared.sections.speculative import parse_speculative_config
from tests.services.worker.model_checks import (assert_chunked_logits_match_hf, hf_greedy,
                                                make_runner, runner_greedy)
from tests.services.worker.moe_checkpoints import build_moe_checkpoint

NUM_LAYERS = 6  # enough to mix attention, experts and a dense layer; fast on two cores
SHARED = [1, 504, 3458, 282, 1834, 314, 216, 1973, 28, 4418, 30, 216, 4589, 28]
ENGINE_PROMPTS = [SHARED + [253, 2118], SHARED + [351, 1834, 29], list(range(400, 419)),
                  SHARED + [9, 9, 9]]
PROMPTS = [[1, 504, 3458, 282, 1834, 314, 216], [1, 1973], list(range(100, 133)),
           [1, 9, 4418, 30, 216, 4589, 28, 253, 2118, 351, 1834, 29]]


def hf_model_of(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe", "qwen2_moe"])
def checkpoint(request, tmp_path_factory):
    family = request.param
    dense = (1,) if family == "qwen3_moe" else ()
    top_k = 1 if family == "qwen2_moe" else 2
    path = build_moe_checkpoint(tmp_path_factory.mktemp(family), family, num_experts=4,
                                top_k=top_k, num_layers=NUM_LAYERS, dense_layers=dense)
    return family, path


def test_config_reads_each_family_moe_fields(checkpoint):
    family, path = checkpoint
    config = ModelConfig.from_path(path)
    assert config.family == family and config.moe.num_experts == 4
    expected_sparse = tuple(i for i in range(NUM_LAYERS) if family != "qwen3_moe" or i != 1)
    assert config.moe.sparse_layers == expected_sparse
    assert config.moe.renormalize == (family != "qwen2_moe")
    assert bool(config.moe.shared_expert_intermediate_size) == (family == "qwen2_moe")


def test_every_token_logits_match_transformers(checkpoint):
    _, path = checkpoint
    assert_chunked_logits_match_hf(path, hf_model_of(path))


def test_greedy_batch_of_mixed_sizes_matches_transformers(checkpoint):
    """... and every sparse layer counted each token's top-k experts once (for /metrics)."""
    family, path = checkpoint
    expected = hf_greedy(hf_model_of(path), PROMPTS, 12)
    runner = make_runner(path, "2MiB")
    runner.expert_counts.period_s = float("inf")  # (no report takes the counts meanwhile)
    take_expert_counts(runner.model)
    assert runner_greedy(runner, PROMPTS, 12) == expected
    config = runner.model.config
    counts = take_expert_counts(runner.model)
    num_rows = sum(map(len, PROMPTS)) + len(PROMPTS) * 11
    assert [sum(layer) for layer in counts] == [num_rows * config.moe.top_k] * len(
        config.moe.sparse_layers)
    assert take_expert_counts(runner.model) == [[0] * 4] * len(config.moe.sparse_layers)


def test_upcycled_experts_give_smollm2_greedy_text(tmp_path):
    """Identical experts, renormalized top-2 weights: each block is SmolLM2's MLP, so all 30
    layers give SmolLM2's greedy tokens."""
    path = build_moe_checkpoint(tmp_path / "upcycled", "mixtral", num_experts=3, top_k=2,
                                upcycled=True)
    prompts = PROMPTS[:2]
    smol = runner_greedy(make_runner(resolve_model("smollm2").path, "8MiB"), prompts, 16)
    assert runner_greedy(make_runner(path, "8MiB"), prompts, 16) == smol


def test_a_step_result_carries_the_counts_when_a_report_is_due(small_mixtral):
    runner = make_runner(small_mixtral, "2MiB")
    runner.expert_counts.period_s = 0.0  # every result is due
    take_expert_counts(runner.model)
    prompt = PROMPTS[0]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    result = runner.execute(StepPlan(0, [NewRequestData("r", prompt, params, [0, 1])],
                                     [ScheduledRequest("r", len(prompt))]))
    assert [sum(layer) for layer in result.expert_token_counts] == [len(prompt) * 2] * 2
    runner.expert_counts.period_s = float("inf")  # none due: nothing attached, nothing taken
    result = runner.execute(StepPlan(1, [], [ScheduledRequest("r", 1)]))
    assert result.expert_token_counts == []
    assert [sum(layer) for layer in take_expert_counts(runner.model)] == [2, 2]


def _engine_tokens(path, batched_tokens: int, kv_cache_memory: str, spec: str = ""):
    engine = Engine(SchedulerConfig(max_num_batched_tokens=batched_tokens, max_num_seqs=4,
                                    admission_reserve=False,  # (so requests are preempted)
                                    speculative_config=parse_speculative_config(spec)),
                    WorkerConfig(device="cpu", kv_cache_memory=kv_cache_memory, block_size=8),
                    ModelFiles(name="moe", path=path))
    try:
        completions, stats = engine.generate(ENGINE_PROMPTS, [SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True)] * len(ENGINE_PROMPTS))
        return [c.output_token_ids for c in completions], stats, engine.scheduler
    finally:
        engine.close()


def test_chunks_prefix_hits_preemption_and_drafts_keep_the_greedy_text(checkpoint):
    """The scheduler's paths over an MoE model: 16-token chunks, a 512 KiB cache (preemption),
    prompts sharing a prefix (prefix-cache hits), n-gram drafts and the model drafting for
    itself give the tokens of one roomy run."""
    _, path = checkpoint
    roomy, _, _ = _engine_tokens(path, 512, "8MiB")
    tight, stats, scheduler = _engine_tokens(path, 16, "512KiB")
    assert stats.num_preemptions > 0 and scheduler.num_prefix_hits > 0
    assert tight == roomy
    ngram, _, _ = _engine_tokens(path, 16, "512KiB",
                                 '{"method": "ngram", "num_speculative_tokens": 3}')
    assert ngram == roomy
    drafted, _, scheduler = _engine_tokens(path, 64, "4MiB", json.dumps(
        {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}))
    assert drafted == roomy
    assert scheduler.draft_books.num_accepted_drafts > 0


@pytest.fixture(scope="module")
def small_mixtral(tmp_path_factory):
    return build_moe_checkpoint(tmp_path_factory.mktemp("small"), "mixtral", num_experts=4,
                                top_k=2, num_layers=2)


def rewritten(tmp_path, source, edit_tensors=None, edit_config=None):
    """A copy of the checkpoint at ``source`` with its tensors or config.json edited."""
    target = tmp_path / "edited"
    target.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    if edit_tensors:
        edit_tensors(tensors)
    if edit_config:
        edit_config(config)
    save_file(tensors, str(target / "model.safetensors"))
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_a_missing_expert_tensor_fails_naming_it(tmp_path, small_mixtral):
    name = "model.layers.1.block_sparse_moe.experts.3.w3.weight"
    path = rewritten(tmp_path, small_mixtral, edit_tensors=lambda t: t.pop(name))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_model(path, torch.device("cpu"), torch.float32)


def test_a_router_of_the_wrong_shape_fails_naming_it(tmp_path, small_mixtral):
    name = "model.layers.0.block_sparse_moe.gate.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:3].contiguous()

    path = rewritten(tmp_path, small_mixtral, edit_tensors=shrink)
    with pytest.raises(ValueError, match=r"router model\.layers\.0\.mlp\.gate\.weight has shape "
                                         r"\[3, 576\].*\[4, 576\]"):
        load_model(path, torch.device("cpu"), torch.float32)


def test_more_experts_per_token_than_experts_fails_naming_the_field(tmp_path, small_mixtral):
    path = rewritten(tmp_path, small_mixtral,
                     edit_config=lambda c: c.update(num_experts_per_tok=5))
    with pytest.raises(ValueError, match="num_experts_per_tok 5 .*4"):
        ModelConfig.from_path(path)
