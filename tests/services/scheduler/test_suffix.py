"""Suffix drafts (``method: "suffix"``): the longest earlier match in the request's own tokens
or in recent responses, and more drafts the longer the match."""

from __future__ import annotations

import random

import pytest

from services.scheduler.request import Request
from services.scheduler.speculation import DraftPolicy, drafter
from services.scheduler.suffix import ResponseCache, SuffixIndex
from shared.messages import SamplingParams
from shared.sections.speculative import SpeculativeConfig, parse_speculative_config
from tests.services.scheduler.test_speculation import ngram_drafts

GREEDY = SamplingParams(temperature=0.0, max_tokens=64)


def suffix_drafter(**fields) -> DraftPolicy:
    config = SpeculativeConfig(method="suffix", num_speculative_tokens=8, **fields)
    return drafter(config)


def finished(request_id: str, prompt: list[int], output: list[int]) -> Request:
    return Request(request_id, prompt, GREEDY, output_subject="", sort_key=(0, 0),
                   output_token_ids=list(output))


def test_the_index_finds_what_a_scan_finds_for_the_longest_suffix():
    """With room for every occurrence, the longest (then latest) match is the scan's."""
    rng = random.Random(5)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(rng.randint(1, 30))]
        index = SuffixIndex(2, 6, max_candidates=64)
        for length in range(1, len(tokens) + 1):  # grown token by token, as a request is
            index.add("r", tokens[:length])
            found = index.match(tokens[:length], lambda _key: tokens[:length])
            expected = ngram_drafts(tokens[:length], 64, 2, 6)
            got = list(tokens[found[1]:length]) if found else []
            assert got == expected, (tokens[:length], found)


def test_only_the_latest_occurrences_are_candidates():
    tokens = [9, 1, 2, 5, 7, 1, 2, 6, 9, 1, 2]  # [9, 1, 2] matches 3 long at the start only
    latest_only = SuffixIndex(2, 6, max_candidates=1)
    latest_only.add("r", tokens)
    assert latest_only.match(tokens, lambda _key: tokens)[1:] == (7, 2)  # [1, 2] then 6
    both = SuffixIndex(2, 6, max_candidates=2)
    both.add("r", tokens)
    assert both.match(tokens, lambda _key: tokens)[1:] == (3, 3)  # [9, 1, 2] then 5


def test_a_longer_match_proposes_more_tokens():
    spec = suffix_drafter()
    phrase = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    # the suffix [11, 12] matched: 2 tokens, so 2 drafts (factor 1.0)
    assert spec.drafts("a", [1] + phrase + [5, 11, 12], GREEDY, 16).token_ids == [13, 14]
    # the suffix [5, 11, 12, 13, 14, 15] matched: 6 tokens, so 6 drafts
    tokens = [5] + phrase + [7, 5, 11, 12, 13, 14, 15]
    assert spec.drafts("b", tokens, GREEDY, 16).token_ids == [16, 17, 18, 19, 20, 7]
    # capped by num_speculative_tokens and by the step's limit
    long = phrase * 2 + phrase[:9]
    assert len(spec.drafts("c", long, GREEDY, 16).token_ids) == 8
    assert len(spec.drafts("d", long, GREEDY, 3).token_ids) == 3
    half = suffix_drafter(suffix_decoding_max_spec_factor=0.5)
    assert half.drafts("e", tokens, GREEDY, 16).token_ids == [16, 17, 18]  # ceil(6 * 0.5)


def test_a_finished_response_is_drafted_from_by_later_requests():
    spec = suffix_drafter()
    answer = [40, 41, 42, 43, 44, 45, 46, 47]
    assert spec.drafts("first", [1, 2, 3, 40, 41], GREEDY, 8).token_ids == []  # nothing to match yet
    spec.forget(finished("first", [1, 2, 3], answer))
    # a new request, another prompt, writing the same answer: drafts from the cached one
    assert spec.drafts("second", [9, 8, 7, 40, 41, 42], GREEDY, 8).token_ids == [43, 44, 45]
    # its own tokens win when they match longer
    own = [50, 43, 44, 45, 51, 52, 9, 50, 43, 44, 45]
    assert spec.drafts("third", own, GREEDY, 8).token_ids == [51, 52, 9, 50]


def test_the_response_cache_keeps_the_latest_and_drops_the_evicted():
    cache = ResponseCache(2, 4, max_responses=2)
    cache.add([1, 2, 3])
    cache.add([4, 5, 6])
    assert cache.continuation([9, 1, 2]) == ([3], 2)
    cache.add([7, 8, 9])  # evicts [1, 2, 3]
    assert cache.continuation([9, 1, 2]) == ([], 0)
    for start in range(10, 60, 3):  # many more: the index is rebuilt on the live ones
        cache.add([start, start + 1, start + 2])
    assert cache.continuation([0, 55, 56]) == ([57], 2)
    assert cache.continuation([0, 4, 5]) == ([], 0)
    assert len(cache.responses) == 2 and cache._indexed_tokens <= 2 * 6


def test_suffix_config_fields_are_checked():
    config = parse_speculative_config('{"method": "suffix", "num_speculative_tokens": 12, '
                                      '"suffix_decoding_max_tree_depth": 24}')
    assert config.method == "suffix" and config.suffix_decoding_max_tree_depth == 24
    for bad in ('{"method": "suffix", "suffix_decoding_max_tree_depth": 1}',
                '{"method": "suffix", "suffix_decoding_max_spec_factor": 0}',
                '{"method": "suffix", "suffix_decoding_max_cached_requests": -1}'):
        with pytest.raises(ValueError):
            parse_speculative_config(bad)
