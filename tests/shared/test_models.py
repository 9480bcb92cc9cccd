from __future__ import annotations

import json

import pytest

from shared.models import PRESETS_DIR, resolve_model


def test_the_default_alias_resolves_to_a_converted_hf_directory():
    files = resolve_model("smollm2")
    assert files.name == "SmolLM2-135M-Instruct"
    assert files.config["model_type"] == "llama"
    assert "quantization_config" not in files.config
    assert (files.path / "tokenizer.json").is_file() and any(files.path.glob("*.safetensors"))


def test_a_hugging_face_directory_is_used_as_it_is(tmp_path):
    converted = resolve_model("smollm2").path
    model_dir = tmp_path / "my-model"
    model_dir.mkdir()
    for item in converted.iterdir():
        (model_dir / item.name).symlink_to(item)
    files = resolve_model(str(model_dir))
    assert files.name == "my-model" and files.path == model_dir.resolve()


def test_a_directory_without_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ValueError, match="safetensors"):
        resolve_model(str(tmp_path))


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))


def test_an_unknown_model_is_refused():
    with pytest.raises(ValueError, match="unknown model"):
        resolve_model("no-such-model-anywhere")


def test_a_dummy_preset_resolves_to_its_config_and_the_default_tokenizer():
    files = resolve_model("dummy:llama-3.1-8b")
    default = resolve_model("smollm2")
    preset = json.loads((PRESETS_DIR / "llama-3.1-8b.json").read_text())
    assert files.name == "dummy-llama-3.1-8b" and files.dummy and not default.dummy
    special = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert {k: v for k, v in files.config.items() if k not in special} == \
        {k: v for k, v in preset.items() if k not in special}
    assert [files.config[k] for k in special] == [default.config[k] for k in special]
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (files.path / name).read_bytes() == (default.path / name).read_bytes()
    assert not any(files.path.glob("*.safetensors"))
    assert resolve_model(str(files.path)).dummy  # a marked directory needs no weights


def test_every_preset_is_listed_in_an_unknown_model_error():
    with pytest.raises(ValueError, match="dummy:<preset>.*qwen3-0.6b"):
        resolve_model("no-such-model-anywhere")


def test_eos_token_ids_generation_config_first_then_config_then_tokenizer(tmp_path):
    from shared.models import read_eos_token_ids

    (tmp_path / "config.json").write_text('{"eos_token_id": [7, 2]}')
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 2}')
    assert read_eos_token_ids(tmp_path) == [2, 7]
    assert read_eos_token_ids(tmp_path, tokenizer_eos_id=9) == [2, 7, 9]
    assert read_eos_token_ids(tmp_path / "missing") == []
