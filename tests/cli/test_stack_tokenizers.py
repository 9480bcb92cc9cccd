"""``flotilla serve --tokenizer-workers N``: N tokenizer processes (one NATS queue group),
started before the rest, each with the tokenizer's own flags."""

from __future__ import annotations

import pytest

from cli.main import build_parser, serve_options
from cli.stack import Stack
from shared.config import ConfigError


def test_tokenizer_workers_start_that_many_tokenizers_with_their_flags():
    args = build_parser().parse_args(["serve", "--device", "cpu", "--tokenizer-workers", "3",
                                      "--image-workers", "4"])
    stack = Stack(serve_options(args))
    stack.nats_url = "nats://127.0.0.1:1"
    names = stack.service_names()
    tokenizers = [name for name in names if name.startswith("tokenizer")]
    assert tokenizers == ["tokenizer", "tokenizer-1", "tokenizer-2"]
    assert max(map(names.index, tokenizers)) < names.index("worker")
    for name in tokenizers:
        command = stack.service_command(name)
        assert command[2] == "services.tokenizer"
        assert command[command.index("--image-workers") + 1] == "4"


def test_one_tokenizer_by_default_and_none_refused():
    stack = Stack(serve_options(build_parser().parse_args(["serve", "--device", "cpu"])))
    assert [n for n in stack.service_names() if n.startswith("tokenizer")] == ["tokenizer"]
    with pytest.raises(ConfigError, match="--tokenizer-workers must be at least 1"):
        serve_options(build_parser().parse_args(["serve", "--device", "cpu",
                                                 "--tokenizer-workers", "0"]))
