"""Incremental detokenization with stop strings, as pure functions.

The caller carries a ``DetokState`` per request and sends it back with each batch of
new token ids, so any tokenizer replica can continue any request. The state stays
small: a few recent token ids, how many of them are already text, and the text held
back because it could still be the start of a stop string.

Decoding works on a short window of tokens: decode the already-read part and the
whole window, and emit the difference. The read context keeps spacing right for
SentencePiece-style tokenizers (which drop a word's leading space when it is the
first token decoded) and lets byte-level tokens that split a character wait until
the character is complete.

Stop strings match in character order: the first stop string to be *completed* in
the text wins (ties go to the longest), and only the text before it is released.
This makes the result independent of how tokens are grouped into calls.

This module must stay free of transformers imports: the gateway may use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shared.messages import DetokItem, DetokResult, DetokState

NUM_PROMPT_CONTEXT_TOKENS = 5  # prompt tokens that seed the window
NUM_CONTEXT_TOKENS = 5  # read tokens kept in the window after each emission
# A UTF-8 character needs at most 4 bytes, so valid text waits on a few tokens at
# most; past this many unread tokens the bytes are garbage: emit them as U+FFFD
# rather than let the state grow.
MAX_UNREAD_TOKENS = 16
REPLACEMENT_CHAR = "\ufffd"


class TokenDecoder(Protocol):
    """The part of a Hugging Face tokenizer this module needs."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def initial_state(prompt_token_ids: Sequence[int]) -> DetokState:
    """The state before the first output token: the prompt's last tokens as read
    context, so the first output word gets its leading space."""
    context = list(prompt_token_ids[-NUM_PROMPT_CONTEXT_TOKENS:]) if prompt_token_ids else []
    return DetokState(window_ids=context, read_offset=len(context), held_text="")


def detokenize_step(tokenizer: TokenDecoder, item: DetokItem) -> DetokResult:
    """Turn ``item.new_token_ids`` into newly released text and the next state."""
    state = item.state
    window = list(state.window_ids)
    read_offset = min(max(state.read_offset, 0), len(window))  # tolerate a bad state
    stops = [s for s in item.stop if s]
    skip = item.skip_special_tokens
    released: list[str] = []
    pending = state.held_text  # text not yet released
    # One token at a time, so a stop string's match is tied to the token completing it.
    for num_used, token_id in enumerate(item.new_token_ids, start=1):
        window.append(token_id)
        new_text, window, read_offset = _decode_unread(tokenizer, window, read_offset, skip)
        pending += new_text
        stop_at = find_stop(pending, stops)
        if stop_at is not None:
            return _stopped(item, released, pending[:stop_at], window, read_offset, num_used)
        num_held = partial_stop_len(pending, stops)
        released.append(pending[:len(pending) - num_held])
        pending = pending[len(pending) - num_held:]
    num_used = len(item.new_token_ids)
    if item.finished:  # nothing more will come: decode what waits, release all
        new_text, window, read_offset = _decode_unread(tokenizer, window, read_offset, skip,
                                                       force=True)
        pending += new_text
        stop_at = find_stop(pending, stops)
        if stop_at is not None:
            return _stopped(item, released, pending[:stop_at], window, read_offset, num_used)
        released.append(pending)
        pending = ""
    return DetokResult(
        request_id=item.request_id,
        text="".join(released),
        state=DetokState(window_ids=window, read_offset=read_offset, held_text=pending),
        stopped=False,
        num_tokens_used=num_used,
    )


def _stopped(item: DetokItem, released: list[str], last_text: str, window: list[int],
             read_offset: int, num_used: int) -> DetokResult:
    released.append(last_text)
    return DetokResult(
        request_id=item.request_id,
        text="".join(released),
        state=DetokState(window_ids=window, read_offset=read_offset, held_text=""),
        stopped=True,
        num_tokens_used=num_used,
    )


def _decode_unread(tokenizer: TokenDecoder, window: list[int], read_offset: int,
                   skip_special_tokens: bool, force: bool = False,
                   ) -> tuple[str, list[int], int]:
    """Text of the window's unread tokens, and the shrunk window after reading them.

    Returns no text, keeping the tokens unread, while the text ends in U+FFFD: the
    last token most likely ends part-way through a multi-byte character.
    """
    num_unread = len(window) - read_offset
    if num_unread <= 0:
        return "", window, read_offset
    prefix_text = tokenizer.decode(window[:read_offset], skip_special_tokens=skip_special_tokens)
    full_text = tokenizer.decode(window, skip_special_tokens=skip_special_tokens)
    new_text = full_text[len(prefix_text):]
    if new_text.endswith(REPLACEMENT_CHAR) and not force and num_unread < MAX_UNREAD_TOKENS:
        return "", window, read_offset
    window = window[-NUM_CONTEXT_TOKENS:]
    return new_text, window, len(window)


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
