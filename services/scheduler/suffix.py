"""Suffix lookup for speculative decoding's ``method: "suffix"`` (speculation.py), pure.

Where n-gram lookup tries a few fixed lengths in the request's own tokens, suffix lookup finds
the *longest* suffix of the request's tokens (up to ``max_depth``) that occurred before, in its
own prompt and output or in the responses of recent requests, and proposes what followed it;
the longer the match, the more tokens it proposes (``max_spec_factor`` per matched token). A
server answering similar requests (agent loops, templated tools, repeated edits) then drafts
from earlier answers as well as from the prompt. The idea is Arctic Inference's suffix
decoding; this is not its suffix tree but an index of ``min_n``-grams (one dictionary insert per
token) whose latest occurrences are extended backwards at lookup, and it proposes the
continuation of the longest (then latest) match, with no frequency statistics.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class SuffixIndex:
    """Token sequences' ``min_n``-grams -> the last ``max_candidates`` places each ended (one
    dictionary insert per token). A lookup extends each candidate backwards, token by token,
    to the longest match up to ``max_n``: the longest suffix match among the latest
    occurrences of the sequence's last ``min_n`` tokens. Sequences only ever grow."""

    def __init__(self, min_n: int, max_n: int, max_candidates: int = 8) -> None:
        self.min_n, self.max_n, self.max_candidates = min_n, max_n, max_candidates
        self.ends: dict[tuple[int, ...], list[tuple[object, int]]] = {}
        self.num_indexed: dict[object, int] = {}  # per sequence: its tokens indexed so far

    def add(self, key: object, token_ids: Sequence[int]) -> None:
        """Index the n-grams not indexed yet that a token follows (a continuation must follow a
        match, so the one ending the sequence waits for the next token)."""
        n, start = self.min_n, self.num_indexed.get(key, 0)
        for stop in range(max(start, n), len(token_ids)):  # the n-gram ending before ``stop``
            places = self.ends.setdefault(tuple(token_ids[stop - n:stop]), [])
            places.append((key, stop))
            if len(places) > self.max_candidates:
                del places[0]
        self.num_indexed[key] = max(start, len(token_ids))

    def match(self, token_ids: Sequence[int],
              sequence: Callable[[object], Sequence[int] | None]) -> tuple[object, int, int] | None:
        """(key, end, length) of the longest match of ``token_ids``' suffix, the latest of equal
        ones; ``sequence(key)`` gives a key's tokens (None: gone). None when nothing matches."""
        if len(token_ids) < self.min_n:
            return None
        best = None
        for key, stop in reversed(self.ends.get(tuple(token_ids[-self.min_n:]), ())):
            tokens = sequence(key)
            if tokens is None:
                continue
            length = self.min_n
            while (length < self.max_n and length < stop and length < len(token_ids)
                   and tokens[stop - length - 1] == token_ids[-length - 1]):
                length += 1
            if best is None or length > best[2]:
                best = (key, stop, length)
        return best


class ResponseCache:
    """The outputs of the last ``max_responses`` finished requests, indexed for lookup. An
    evicted response's index entries go when the index is rebuilt (once it holds twice the
    live tokens), so lookups skip them until then."""

    def __init__(self, min_n: int, max_n: int, max_responses: int) -> None:
        self.min_n, self.max_n, self.max_responses = min_n, max_n, max_responses
        self.responses: OrderedDict[int, list[int]] = OrderedDict()
        self.index = SuffixIndex(min_n, max_n)
        self._next_key = 0
        self._indexed_tokens = 0  # in the index, evicted responses' included
        self._live_tokens = 0  # in the responses kept

    def add(self, token_ids: Sequence[int]) -> None:
        if self.max_responses == 0 or len(token_ids) <= self.min_n:
            return
        key, self._next_key = self._next_key, self._next_key + 1
        self.responses[key] = list(token_ids)
        self.index.add(key, self.responses[key])
        self._indexed_tokens += len(token_ids)
        self._live_tokens += len(token_ids)
        while len(self.responses) > self.max_responses:
            self._live_tokens -= len(self.responses.popitem(last=False)[1])
        if self._indexed_tokens > 2 * self._live_tokens:
            self._rebuild()

    def _rebuild(self) -> None:
        self.index = SuffixIndex(self.min_n, self.max_n)
        for key, tokens in self.responses.items():
            self.index.add(key, tokens)
        self._indexed_tokens = self._live_tokens

    def continuation(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """(the tokens after the longest cached match of ``token_ids``' suffix, its length)."""
        found = self.index.match(token_ids, self.responses.get)
        if found is None:
            return [], 0
        key, end, n = found
        return self.responses[key][end:], n
