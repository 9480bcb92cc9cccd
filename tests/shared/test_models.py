from __future__ import annotations

import json

import pytest

from shared.models import resolve_model


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
