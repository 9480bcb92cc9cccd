"""Prompts with exactly the asked-for token counts, on the default model's tokenizer."""

from __future__ import annotations

import random

import pytest

from cli.bench.datasets import (DatasetError, fit_prompt, length_range, random_requests,
                                shared_prefix_requests)


def encoded_len(tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False))


def test_random_prompts_encode_to_exactly_the_input_length(tokenizer):
    requests = random_requests(tokenizer, num_prompts=24, input_len=100, output_len=7, seed=3)
    assert [encoded_len(tokenizer, r.prompt) for r in requests] == [100] * 24
    assert all(r.prompt_len == 100 and r.output_len == 7 for r in requests)
    assert len({r.prompt for r in requests}) == 24
    special = set(tokenizer.all_special_ids)
    assert not any(special & set(r.prompt_ids) for r in requests)


def test_random_lengths_stay_in_the_range_and_follow_the_seed(tokenizer):
    requests = random_requests(tokenizer, 40, input_len=50, output_len=20, range_ratio=0.5, seed=1)
    input_lens = [r.prompt_len for r in requests]
    output_lens = [r.output_len for r in requests]
    assert 25 <= min(input_lens) and max(input_lens) <= 75 and len(set(input_lens)) > 5
    assert 10 <= min(output_lens) and max(output_lens) <= 30 and len(set(output_lens)) > 5
    assert [encoded_len(tokenizer, r.prompt) for r in requests] == input_lens
    again = random_requests(tokenizer, 40, input_len=50, output_len=20, range_ratio=0.5, seed=1)
    assert again == requests
    other = random_requests(tokenizer, 40, input_len=50, output_len=20, range_ratio=0.5, seed=2)
    assert other != requests


@pytest.mark.parametrize("length, ratio, expected", [
    (100, 0.0, (100, 100)), (100, 0.25, (75, 125)), (3, 0.5, (1, 5)), (1, 0.9, (1, 2))])
def test_length_range(length, ratio, expected):
    assert length_range(length, ratio) == expected


def test_range_ratio_of_one_is_refused():
    with pytest.raises(DatasetError, match="range-ratio"):
        length_range(10, 1.0)


def test_fit_prompt_keeps_the_head_and_hits_the_target(tokenizer):
    rng = random.Random(0)
    allowed = list(range(100, 40000))
    text, ids = fit_prompt(tokenizer, "The head stays. ", rng.choices(allowed, k=5), 40, allowed, rng)
    assert text.startswith("The head stays. ")
    assert len(ids) == 40 == encoded_len(tokenizer, text)


def test_shared_prefix_groups_interleave(tokenizer):
    requests = shared_prefix_requests(tokenizer, num_prompts=9, num_groups=3, prefix_len=48,
                                      suffix_len=16, output_len=5, seed=0)
    assert [r.prompt_len for r in requests] == [64] * 9
    prefixes = [requests[g].prompt[:100] for g in range(3)]
    assert len(set(prefixes)) == 3
    for i, request in enumerate(requests):
        assert request.prompt.startswith(requests[i % 3].prompt[:100])
        # the prefix's tokens are shared up to the join with the suffix
        assert request.prompt_ids[:40] == requests[i % 3].prompt_ids[:40]
    assert len({r.prompt for r in requests}) == 9


def test_shared_prefix_needs_groups(tokenizer):
    with pytest.raises(DatasetError):
        shared_prefix_requests(tokenizer, 4, num_groups=0, prefix_len=8, suffix_len=8, output_len=4)


def test_runs_and_warm_ups_never_share_a_cached_block(tokenizer):
    """A server's prefix cache works in blocks (16 tokens in flotilla): a sweep's runs and
    the warm-up must not share one, or later runs would skip prefill work."""
    from cli.bench.workload import build_requests, warmup_requests
    from cli.main import build_parser

    args = build_parser().parse_args(["bench", "serve", "--num-prompts", "6", "--input-len", "32",
                                      "--output-len", "4"])
    runs = [build_requests(args, tokenizer, seed) for seed in (0, 1)]
    warmups = warmup_requests(tokenizer, 2, seed=0)
    assert [r.prompt_len for r in warmups] == [16, 16] and runs[0] == build_requests(args, tokenizer, 0)
    first_blocks = [tuple(r.prompt_ids[:16]) for batch in (*runs, warmups) for r in batch]
    assert len(set(first_blocks)) == len(first_blocks)
