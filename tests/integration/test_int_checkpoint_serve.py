"""An integer weight-only checkpoint through the whole stack: ``flotilla serve --model DIR`` on
SmolLM2 written as AWQ (4-bit, group 64, round to nearest: int_packing.py) gives, on concurrent
requests, the greedy text of transformers running the dequantized fp32 copy of the same
weights."""

from __future__ import annotations

import pytest

from tests.integration.model_dirs import (served_greedy_texts, start_stack_on,
                                          transformers_greedy_texts)
from tests.services.worker.int_packing import write_int_checkpoint, write_plain

pytestmark = pytest.mark.integration
NUM_NEW_TOKENS = 16
PROMPTS = ["The capital of France is", "def add(a, b):",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who"]


@pytest.fixture(scope="module")
def awq_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("awq")
    plain = write_int_checkpoint(root / "smollm2-awq", "awq", bits=4, group_size=64)
    return root / "smollm2-awq", write_plain(root / "plain", plain, root / "smollm2-awq")


def test_awq_checkpoint_served_gives_transformers_greedy_text(tmp_path, awq_dirs):
    awq_dir, plain_dir = awq_dirs
    expected = transformers_greedy_texts(plain_dir, PROMPTS, NUM_NEW_TOKENS)
    assert "Paris" in expected[0]
    stack = start_stack_on(awq_dir, tmp_path / "logs")
    try:
        assert served_greedy_texts(stack, PROMPTS, NUM_NEW_TOKENS) == expected
        worker_log = "".join(p.read_text() for p in (tmp_path / "logs").glob("*worker*"))
        assert "int_checkpoint_dequantized" in worker_log  # said once, with method and bits
    finally:
        stack.stop()
