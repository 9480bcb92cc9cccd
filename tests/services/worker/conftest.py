"""Fixtures shared by the worker's tests."""

from __future__ import annotations

import json
import shutil

import pytest

from shared.models import DUMMY_MARKER, PRESETS_DIR, ModelFiles


@pytest.fixture(scope="module")
def dummy_model(tmp_path_factory) -> ModelFiles:
    """A 2-layer Llama with random weights: the preset's config and the dummy marker (the
    runner needs no tokenizer), with no EOS so runs last their max_tokens."""
    path = tmp_path_factory.mktemp("tiny-llama")
    shutil.copy(PRESETS_DIR / "tiny-llama.json", path / "config.json")
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = None
    (path / "config.json").write_text(json.dumps(config))
    (path / DUMMY_MARKER).write_text("random weights\n")
    return ModelFiles(name="tiny-llama", path=path)

