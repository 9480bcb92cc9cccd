"""Fixtures shared by the worker's tests."""

from __future__ import annotations

import json

import pytest

from shared.models import DUMMY_MARKER, PRESETS_DIR, ModelFiles


@pytest.fixture(scope="module")
def dummy_model(tmp_path_factory) -> ModelFiles:
    """A 2-layer Llama with random weights: the preset's config and the dummy marker (the
    runner needs no tokenizer), with no EOS so runs last their max_tokens."""
    return dummy_preset(tmp_path_factory, "tiny-llama")


def dummy_preset(tmp_path_factory, preset: str) -> ModelFiles:
    """A preset's config and the dummy marker, no EOS, no tokenizer (so no default model is
    needed: the GPU machine has none)."""
    path = tmp_path_factory.mktemp(preset)
    config = json.loads((PRESETS_DIR / f"{preset}.json").read_text())
    config["eos_token_id"] = None
    (path / "config.json").write_text(json.dumps(config))
    (path / DUMMY_MARKER).write_text("random weights\n")
    return ModelFiles(name=preset, path=path)

