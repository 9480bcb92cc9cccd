"""Fixtures for the CLI's unit tests: the default model's real tokenizer (no NATS)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.models import resolve_model

    return AutoTokenizer.from_pretrained(str(resolve_model("smollm2").path))
