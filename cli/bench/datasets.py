"""Benchmark prompts: ``random`` and ``shared-prefix`` (ShareGPT is in sharegpt.py).

Prompts are sent as text, so any OpenAI-compatible server can take them. To make a
prompt really have N tokens we draw N token ids, decode them, re-encode the text and
add or drop ids until the text encodes to exactly N tokens (as vLLM's benchmark does).
Special tokens are never drawn, so the text cannot smuggle in an end-of-sequence.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Protocol

MAX_FIT_ROUNDS = 20  # in practice 1-3 rounds; the cap only bounds a pathological tokenizer


class Tokenizer(Protocol):
    """What the datasets need of a Hugging Face tokenizer."""

    all_special_ids: list[int]

    def __len__(self) -> int: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(frozen=True)
class BenchRequest:
    prompt: str
    prompt_ids: list[int]  # what the benchmark's tokenizer makes of prompt (HF generate's input)
    output_len: int
    # a chat (multi-turn): the messages the chat endpoint sends; ``prompt`` is then their
    # templated text, which the completions endpoint sends instead
    messages: tuple[dict, ...] | None = None
    user: str | None = None  # the request's ``user`` field (a session id), when set
    model: str | None = None  # the request's ``model`` (a LoRA adapter's name), when set

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


class DatasetError(ValueError):
    """A dataset that cannot be built as asked; the message says what to do."""


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Lengths are drawn uniformly from [length * (1 - r), length * (1 + r)] (vLLM's
    convention), never below one token."""
    if not 0 <= range_ratio < 1:
        raise DatasetError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    return (max(1, math.floor(length * (1 - range_ratio))),
            max(1, math.ceil(length * (1 + range_ratio))))


def drawable_ids(tokenizer: Tokenizer) -> list[int]:
    special = set(tokenizer.all_special_ids)
    return [i for i in range(len(tokenizer)) if i not in special]


def fit_prompt(tokenizer: Tokenizer, head: str, tail_ids: list[int], target_len: int,
               allowed_ids: list[int], rng: random.Random) -> tuple[str, list[int]]:
    """Text ``head + decode(tail_ids)``, with tail ids added or dropped until the text
    encodes to ``target_len`` tokens. Returns the text and its ids; if it never fits
    (rare), the last try, whose true length the caller records."""
    tail_ids = list(tail_ids)
    for _ in range(MAX_FIT_ROUNDS):
        text = head + tokenizer.decode(tail_ids)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        missing = target_len - len(prompt_ids)
        if missing == 0:
            break
        if missing > 0:
            tail_ids += rng.choices(allowed_ids, k=missing)
        elif len(tail_ids) > -missing:
            tail_ids = tail_ids[:missing]
        else:
            tail_ids = rng.choices(allowed_ids, k=1)  # the head alone is too long
    return text, prompt_ids


def random_requests(tokenizer: Tokenizer, num_prompts: int, input_len: int, output_len: int,
                    range_ratio: float = 0.0, seed: int = 0) -> list[BenchRequest]:
    rng = random.Random(seed)
    allowed_ids = drawable_ids(tokenizer)
    input_range = length_range(input_len, range_ratio)
    output_range = length_range(output_len, range_ratio)
    requests = []
    for _ in range(num_prompts):
        num_input = rng.randint(*input_range)
        text, prompt_ids = fit_prompt(tokenizer, "", rng.choices(allowed_ids, k=num_input),
                                      num_input, allowed_ids, rng)
        requests.append(BenchRequest(text, prompt_ids, rng.randint(*output_range)))
    return requests


def shared_prefix_requests(tokenizer: Tokenizer, num_prompts: int, num_groups: int,
                           prefix_len: int, suffix_len: int, output_len: int,
                           seed: int = 0) -> list[BenchRequest]:
    """``num_groups`` random prefixes of ``prefix_len`` tokens; request i uses prefix
    i % num_groups plus its own random suffix of ``suffix_len`` tokens, so groups
    interleave and a prefix cache must hold all of them to help."""
    if num_groups < 1 or prefix_len < 1 or suffix_len < 1:
        raise DatasetError("shared-prefix needs --shared-prefix-groups, --shared-prefix-len "
                           "and --shared-prefix-suffix-len of at least 1")
    rng = random.Random(seed)
    allowed_ids = drawable_ids(tokenizer)
    prefixes = [fit_prompt(tokenizer, "", rng.choices(allowed_ids, k=prefix_len), prefix_len,
                           allowed_ids, rng)[0] for _ in range(num_groups)]
    requests = []
    for i in range(num_prompts):
        text, prompt_ids = fit_prompt(tokenizer, prefixes[i % num_groups],
                                      rng.choices(allowed_ids, k=suffix_len),
                                      prefix_len + suffix_len, allowed_ids, rng)
        requests.append(BenchRequest(text, prompt_ids, output_len))
    return requests
