"""Token ids back to text, as the client sees it: incremental detokenization with stop
strings, and the exact text and bytes of single tokens (logprobs).

This is the one place that logic lives. The gateway keeps one ``IncrementalDetokenizer``
per sequence (so the text of a step's tokens costs no bus round trip); nothing else
needs it. Plain synchronous code, free of NATS.

Decoding works on a short window of tokens: decode the already-read part and the
whole window, and emit the difference. The read context keeps spacing right for
SentencePiece-style tokenizers (which drop a word's leading space when it is the
first token decoded) and lets byte-level tokens that split a character wait until
the character is complete.

Stop strings match in character order: the first stop string to be *completed* in
the text wins (ties go to the one starting first), and only the text before it is
released. This makes the result independent of how tokens are grouped into steps.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Protocol

NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens that seed the window
NUM_CONTEXT_TOKENS = 5  # read tokens kept in the window after each emission
# A UTF-8 character needs at most 4 bytes, so valid text waits on a few tokens at
# most; past this many unread tokens the bytes are garbage: emit them as U+FFFD
# rather than let the window grow.
MAX_UNREAD_TOKENS = 16
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer this module needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def fast_decoder(tokenizer) -> TokenDecoder:
    """What decodes exactly as ``tokenizer.decode`` at the least cost: a fast tokenizer's
    Rust backend (a third of the wrapper's time), unless the wrapper post-processes."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer
    return backend


@dataclass(frozen=True, slots=True)
class DetokStep:
    text: str  # newly released text
    stopped: bool = False  # a stop string matched: text ends before it, nothing follows
    num_tokens_used: int = 0  # of the step's new tokens: all of them unless stopped


class IncrementalDetokenizer:
    """One sequence's text, released as its tokens arrive.

    ``window_ids`` are the last few token ids (starting a little before the unread ones,
    so decoding keeps the right spacing); the first ``read_offset`` of them are already
    text. ``held_text`` is decoded text not yet released because it could be the start
    of a stop string.
    """

    __slots__ = ("tokenizer", "stop", "skip_special_tokens", "window_ids", "read_offset",
                 "held_text", "stopped")

    def __init__(self, tokenizer: TokenDecoder, prompt_token_ids: Sequence[int] = (),
                 stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        # The prompt's last tokens as read context: the first output word gets its space.
        self.window_ids = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:])
        self.read_offset = len(self.window_ids)
        self.held_text = ""
        self.stopped = False

    def step(self, new_token_ids: Sequence[int], finished: bool = False) -> DetokStep:
        """Text released by ``new_token_ids``; ``finished``: nothing more will come, so
        decode what waits and release everything (short of a stop string)."""
        if self.stopped:
            return DetokStep("", True, 0)
        stops = self.stop
        released: list[str] = []
        pending = self.held_text
        # One token at a time, so a stop string's match is tied to the token completing it.
        for num_used, token_id in enumerate(new_token_ids, start=1):
            self.window_ids.append(token_id)
            pending += self._decode_unread()
            if not stops:
                continue
            stop_at = find_stop(pending, stops)
            if stop_at is not None:
                return self._stop(released, pending[:stop_at], num_used)
            num_held = partial_stop_len(pending, stops)
            released.append(pending[:len(pending) - num_held])
            pending = pending[len(pending) - num_held:]
        num_used = len(new_token_ids)
        if finished:
            pending += self._decode_unread(force=True)
            stop_at = find_stop(pending, stops) if stops else None
            if stop_at is not None:
                return self._stop(released, pending[:stop_at], num_used)
        elif stops:
            self.held_text = pending
            return DetokStep("".join(released), False, num_used)
        released.append(pending)
        self.held_text = ""
        return DetokStep("".join(released), False, num_used)

    def _stop(self, released: list[str], last_text: str, num_used: int) -> DetokStep:
        released.append(last_text)
        self.held_text = ""
        self.stopped = True
        return DetokStep("".join(released), True, num_used)

    def _decode_unread(self, force: bool = False) -> str:
        """Text of the window's unread tokens; shrinks the window after reading them.

        Returns no text, keeping the tokens unread, while the text ends in U+FFFD: the
        last token most likely ends part-way through a multi-byte character.
        """
        window, read_offset = self.window_ids, self.read_offset
        num_unread = len(window) - read_offset
        if num_unread <= 0:
            return ""
        skip = self.skip_special_tokens
        prefix_text = self.tokenizer.decode(window[:read_offset], skip_special_tokens=skip) \
            if read_offset else ""
        full_text = self.tokenizer.decode(window, skip_special_tokens=skip)
        new_text = full_text[len(prefix_text):]
        if new_text.endswith(REPLACEMENT_CHAR) and not force and num_unread < MAX_UNREAD_TOKENS:
            return ""
        self.window_ids = window[-NUM_CONTEXT_TOKENS:]
        self.read_offset = len(self.window_ids)
        return new_text


def find_stop(text: str, stops: Sequence[str]) -> int | None:
    """Where the first stop string to be completed in ``text`` starts, or None.

    Ties (two matches ending at the same character) go to the one starting first.
    """
    best: tuple[int, int] | None = None  # (end, start)
    for stop in stops:
        start = text.find(stop)
        if start >= 0 and (best is None or (start + len(stop), start) < best):
            best = (start + len(stop), start)
    return None if best is None else best[1]


def partial_stop_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop
    string: that much must be held back until the next characters decide."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


# ----------------------------------------------------------------- token names (logprobs)
# A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM) is a string over a 256-character
# alphabet standing for bytes; a SentencePiece token uses "▁" for a space and ``<0xHH>``
# for raw bytes. Either way a token may hold part of a UTF-8 character, so its bytes are
# the truth and its text is those bytes decoded with U+FFFD for an incomplete character.
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's byte -> printable character table."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


class TokenBytes:
    """Token id -> (text, bytes), cached, for one Hugging Face tokenizer."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._special_ids = set(tokenizer.all_special_ids)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def lookup(self, token_ids: list[int]) -> tuple[list[str], list[bytes]]:
        missing = [t for t in dict.fromkeys(token_ids) if t not in self._cache]
        if missing:
            pieces = self._tokenizer.convert_ids_to_tokens(missing)
            for token_id, piece in zip(missing, pieces):
                data = self._bytes(token_id, piece or "")
                self._cache[token_id] = (data.decode("utf-8", errors="replace"), data)
        entries = [self._cache[t] for t in token_ids]
        return [text for text, _ in entries], [data for _, data in entries]

    def _bytes(self, token_id: int, piece: str) -> bytes:
        if token_id in self._special_ids:
            return piece.encode()
        if self._byte_level:
            table = _unicode_to_byte()
            if all(char in table for char in piece):
                return bytes(table[char] for char in piece)
            return piece.encode()  # an added token written as plain text
        match = _BYTE_TOKEN.match(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        return piece.replace("\u2581", " ").encode()
