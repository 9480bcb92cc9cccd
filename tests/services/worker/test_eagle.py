"""EAGLE heads in the worker (eagle_head.py, hidden_capture.py, eagle_proposer.py): a step
with draft slots drafts from the served model's own hidden states; whatever the head
proposes, the tokens are the greedy ones without drafts; a head that does not fit the served
model is refused at start, the field named; the features the target's forward writes are
fc(concat(Hugging Face's hidden_states at the three layers)) (EAGLE-3) and its last normed
hidden state (EAGLE-1)."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.worker.hidden_capture import FeatureCapture
from services.worker.runner_build import build_runner
from services.worker.step_inputs import SequenceChunk, build_step_inputs
from services.worker.weights import load_model
from shared.models import _write_dummy_head, resolve_model
from shared.sections.speculative import SpeculativeConfig, parse_speculative_config
from tests.services.worker.test_draft_model import (
    PROMPT, config, drafted_tokens, greedy_tokens)

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1, "vocab_size": 49152,
        "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
        "model_type": "llama"}


def head_dir(tmp_path: Path, method: str, **changes) -> Path:
    """A random head of the tiny model's shapes (eagle3: a 1,024-token draft vocabulary)."""
    path = tmp_path / f"{method}-head"
    path.mkdir()
    head_config = {**TINY, "architectures": [
        "LlamaForCausalLMEagle3" if method == "eagle3" else "LlamaForCausalLM"]}
    if method == "eagle3":  # (the tiny model has two layers: one named twice)
        head_config["draft_vocab_size"] = 1024
        head_config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 1, 1]}
    _write_dummy_head({**head_config, **changes}, path)
    return path


def eagle_config(path: Path, method: str = "eagle3", **overrides):
    spec = SpeculativeConfig(method=method, model=str(path), num_speculative_tokens=4)
    return msgspec.structs.replace(config(**overrides), speculative_config=spec)


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_an_eagle_head_changes_what_is_kept_never_the_tokens(dummy_model, tmp_path, method):
    expected = greedy_tokens(build_runner(config(), dummy_model), PROMPT, 40)
    runner = build_runner(eagle_config(head_dir(tmp_path, method), method), dummy_model)
    catch_ups: list[int] = []
    tokens, steps = drafted_tokens(runner, PROMPT, [4, 2, 1, 4, 4, 4, 4, 4], catch_ups)
    assert tokens == expected[:len(tokens)]
    # the first drafted step computes the prompt's positions but its last (the head's KV at
    # position i needs token i + 1); later ones what the step before kept
    assert catch_ups[0] == len(PROMPT) - 1 and max(catch_ups[1:]) <= 4, catch_ups
    state = runner._requests["r"]
    assert state.num_draft_computed == len(state.token_ids) - 2 - steps[-1][1]


def test_a_catch_up_beyond_the_token_budget_runs_in_pieces(dummy_model, tmp_path):
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    expected = greedy_tokens(build_runner(config(), dummy_model), prompt, 12)
    runner = build_runner(eagle_config(head_dir(tmp_path, "eagle3"), max_num_batched_tokens=16,
                                       max_num_seqs=16), dummy_model)
    tokens, _ = drafted_tokens(runner, prompt, [4, 4])
    assert tokens == expected[:len(tokens)]


def test_drafts_are_target_ids_through_d2t(dummy_model, tmp_path):
    path = head_dir(tmp_path, "eagle3")
    tensors = load_file(str(path / "model.safetensors"))
    t2d = torch.zeros(49152, dtype=torch.bool)
    t2d[5000:6024] = True  # draft id i is target id 5000 + i
    save_file({**tensors, "d2t": torch.full((1024,), 5000), "t2d": t2d},
              str(path / "model.safetensors"))
    head = build_runner(eagle_config(path), dummy_model).proposer.model
    assert head.draft_ids(torch.eye(1024)[[0, 7, 1023]]).tolist() == [5000, 5007, 6023]


@pytest.mark.parametrize(("changes", "field"), [
    ({"hidden_size": 32}, "hidden_size"),
    ({"vocab_size": 32000}, "vocab_size"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}},
     "eagle_aux_hidden_state_layer_ids"),  # the tiny model has 2 layers
    ({"num_hidden_layers": 2}, "num_hidden_layers"),
])
def test_a_head_that_does_not_fit_the_served_model_is_refused_at_start(
        dummy_model, tmp_path, changes, field):
    path = head_dir(tmp_path, "eagle3")
    head_config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**head_config, **changes}))
    with pytest.raises(ValueError, match=field):
        build_runner(eagle_config(path), dummy_model)


def test_vocabulary_maps_that_do_not_fit_are_refused_naming_the_map(dummy_model, tmp_path):
    path = head_dir(tmp_path, "eagle3")
    tensors = load_file(str(path / "model.safetensors"))
    for name, value, match in (("d2t", torch.full((1024,), 49000), "d2t"),
                               ("d2t", torch.zeros(512, dtype=torch.int64), "d2t"),
                               ("d2t", -torch.arange(1024), "two onto one"),
                               ("t2d", torch.ones(49152, dtype=torch.bool), "t2d")):
        save_file({**tensors, name: value}, str(path / "model.safetensors"))
        with pytest.raises(ValueError, match=match):
            build_runner(eagle_config(path), dummy_model)


def test_methods_eagle_need_a_head():
    with pytest.raises(ValueError, match="model goes with methods"):
        parse_speculative_config('{"method": "eagle3", "num_speculative_tokens": 4}')
    assert parse_speculative_config(
        '{"method": "eagle", "model": "DIR"}').method == "eagle"


@pytest.fixture(scope="module")
def smollm2_and_hf():
    from transformers import AutoModelForCausalLM

    files = resolve_model("smollm2")
    hf = AutoModelForCausalLM.from_pretrained(str(files.path), dtype=torch.float32).eval()
    return files, hf


def test_the_captured_features_are_the_hidden_states_transformers_gives(smollm2_and_hf):
    files, hf = smollm2_and_hf
    prompt = [1, 504, 3458, 282, 4649, 314, 253, 1345, 28, 198] * 3
    with torch.no_grad():
        states = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    model = load_model(files.path, torch.device("cpu"), torch.float32)
    from services.worker.runner_build import _allocate_cache

    model.bind_kv_cache(_allocate_cache(model, 4, 16, torch.float32, torch.device("cpu")))
    fc = torch.randn(576, 3 * 576) * 0.02
    for capture, expected in (
            (FeatureCapture(64, 576, torch.float32, torch.device("cpu"), (2, 15, 27), fc),
             torch.cat([states[2][0], states[15][0], states[27][0]], -1) @ fc.T),
            (FeatureCapture(64, 576, torch.float32, torch.device("cpu")), states[-1][0])):
        model.hidden_capture = capture
        chunk = SequenceChunk(token_ids=prompt, start=0, block_table=[2, 0], sample=True)
        input_ids, positions, metadata = build_step_inputs([chunk], 16, torch.device("cpu"))
        with torch.no_grad():
            model(input_ids, positions, metadata)
        # block 2 then block 0: slots 32..47 then 0..13
        got = capture.gather(metadata.slot_mapping)
        assert metadata.slot_mapping.tolist()[:2] == [32, 33]
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("eagle3", [True, False])
def test_steps_in_pieces_capture_what_the_whole_forward_captures(dummy_model, eagle3):
    """The piecewise graphs' pieces (run uncaptured on the CPU) write the features the
    eager forward writes, padding rows into the spare row only."""
    from services.worker.cuda_graphs import PiecewiseGraphs
    from services.worker.runner_build import _allocate_cache

    model = load_model(dummy_model.path, torch.device("cpu"), torch.float32)
    chunks = [SequenceChunk(token_ids=[5, 9, 300, 41, 8, 8, 17], start=0, block_table=[1],
                            sample=True),
              SequenceChunk(token_ids=[77, 78], start=0, block_table=[3], sample=True)]
    captured = {}
    for mode in ("eager", "pieces"):
        model.bind_kv_cache(_allocate_cache(model, 4, 16, torch.float32, torch.device("cpu")))
        fc = torch.randn(64, 3 * 64, generator=torch.Generator().manual_seed(1))
        capture = FeatureCapture(64, 64, torch.float32, torch.device("cpu"),
                                 *(((0, 1, 1), fc) if eagle3 else ()))
        model.hidden_capture = capture
        input_ids, positions, metadata = build_step_inputs(chunks, 16, torch.device("cpu"))
        with torch.no_grad():
            if mode == "eager":
                model(input_ids, positions, metadata)
            else:  # (a 16-token bucket: 7 padding rows)
                PiecewiseGraphs(model, 16, torch.device("cpu"), use_graphs=False).run(
                    input_ids, positions, metadata)
        captured[mode] = capture.cache.clone()
    torch.testing.assert_close(captured["pieces"][:64], captured["eager"][:64],
                               atol=1e-5, rtol=1e-5)
    written = captured["eager"][:64].abs().sum(-1) > 0
    assert written.nonzero().flatten().tolist() == [16, 17, 18, 19, 20, 21, 22, 48, 49]
