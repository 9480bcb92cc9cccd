"""Integration fixtures: a real nats-server on a random port and every real service,
started the way ``flotilla serve`` starts them."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from cli.stack import Stack, StackOptions, free_port
from shared.models import resolve_model

MODEL = "smollm2"


def wait_for(condition, timeout_s: float = 20.0) -> bool:
    """Poll ``condition`` until it holds or the time is up (metrics follow stats events)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.2)
    return False


def start_stack(log_dir: Path, **overrides) -> Stack:
    options = StackOptions(model=MODEL, host="127.0.0.1", port=free_port(), log_dir=log_dir,
                           **overrides)
    stack = Stack(options)
    stack.start(timeout_s=300)
    return stack


@pytest.fixture(scope="session")
def model_files():
    return resolve_model(MODEL)


@pytest.fixture(scope="session")
def stack(tmp_path_factory, model_files):
    """One shared stack for tests that do not break anything. Its worker overlaps steps as
    on a GPU (step N+1 queued before step N is read back), so the tests here check that path."""
    stack = start_stack(tmp_path_factory.mktemp("stack-logs"),
                        service_args={"worker": ["--kv-cache-memory", "512MiB",
                                                 "--overlap-steps", "on"]})
    yield stack
    stack.stop()


@pytest.fixture(scope="session")
def model_name(model_files) -> str:
    return model_files.name


@pytest.fixture(scope="session")
def hf_model(model_files):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_files.path), dtype=torch.float32)
    model.eval()
    return model


@pytest.fixture(scope="session")
def hf_tokenizer(model_files):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_files.path))
