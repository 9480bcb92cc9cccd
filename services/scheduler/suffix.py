"""Suffix lookup for speculative decoding's ``method: "suffix"`` (speculation.py), pure.

Where n-gram lookup tries a few fixed lengths in the request's own tokens, suffix lookup finds
the *longest* suffix of the request's tokens (up to ``max_depth``) that occurred before, in its
own prompt and output or in the responses of recent requests, and proposes what followed it;
the longer the match, the more tokens it proposes (``max_spec_factor`` per matched token). A
server answering similar requests (agent loops, templated tools, repeated edits) then drafts
from earlier answers as well as from the prompt. The idea is Arctic Inference's suffix
decoding; this is a hash index of suffixes, not its suffix tree, and proposes the continuation
of the latest occurrence (no frequency statistics).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class SuffixIndex:
    """Token sequences' n-grams (``min_n``..``max_n`` tokens) -> (sequence key, where the latest
    occurrence ends), grown as sequences are appended to (they only ever are)."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.sizes = range(max_n, min_n - 1, -1)
        self.ends: dict[tuple[int, ...], tuple[object, int]] = {}
        self.num_indexed: dict[object, int] = {}  # per sequence: its tokens indexed so far

    def add(self, key: object, token_ids: Sequence[int], upto: int | None = None) -> None:
        """Index the n-grams of ``token_ids[:upto]`` not indexed yet (a continuation must
        follow an n-gram, so one ending at ``upto`` is indexed once a token follows it)."""
        end = len(token_ids) if upto is None else upto
        start = self.num_indexed.get(key, 0)
        for stop in range(max(start, 1), end):  # n-grams ending before index ``stop``
            for n in self.sizes:
                if stop - n >= 0:
                    self.ends[tuple(token_ids[stop - n:stop])] = (key, stop)
        self.num_indexed[key] = max(start, end)

    def match(self, token_ids: Sequence[int]) -> tuple[object, int, int] | None:
        """(key, end, n) of the longest suffix of ``token_ids`` indexed, or None."""
        for n in self.sizes:
            if len(token_ids) >= n:
                found = self.ends.get(tuple(token_ids[-n:]))
                if found is not None:
                    return found[0], found[1], n
        return None


class ResponseCache:
    """The outputs of the last ``max_responses`` finished requests, indexed for lookup. An
    evicted response's index entries go when the index is rebuilt (once it holds twice the
    live tokens), so lookups skip them until then."""

    def __init__(self, min_n: int, max_n: int, max_responses: int) -> None:
        self.min_n, self.max_n, self.max_responses = min_n, max_n, max_responses
        self.responses: OrderedDict[int, list[int]] = OrderedDict()
        self.index = SuffixIndex(min_n, max_n)
        self._next_key = 0
        self._indexed_tokens = 0

    def add(self, token_ids: Sequence[int]) -> None:
        if self.max_responses == 0 or len(token_ids) <= self.min_n:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self.responses[key] = list(token_ids)
        self.index.add(key, self.responses[key])
        self._indexed_tokens += len(token_ids)
        while len(self.responses) > self.max_responses:
            self.responses.popitem(last=False)
        live = sum(map(len, self.responses.values()))
        if self._indexed_tokens > 2 * live:
            self._rebuild(live)

    def _rebuild(self, live: int) -> None:
        self.index = SuffixIndex(self.min_n, self.max_n)
        for key, tokens in self.responses.items():
            self.index.add(key, tokens)
        self._indexed_tokens = live

    def continuation(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """(the tokens after the longest cached match of ``token_ids``' suffix, its length)."""
        found = self.index.match(token_ids)
        if found is None or found[0] not in self.responses:
            return [], 0
        key, end, n = found
        return self.responses[key][end:], n
