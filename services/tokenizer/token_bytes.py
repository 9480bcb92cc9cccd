"""The exact bytes and the text of single tokens, for logprobs.

A byte-level BPE token (GPT-2, Llama 3, Qwen, SmolLM) is a string over a 256-character
alphabet standing for bytes; a SentencePiece token uses "▁" for a space and ``<0xHH>`` for
raw bytes. Either way a token may hold part of a UTF-8 character, so its bytes are the
truth and its text is those bytes decoded with U+FFFD for an incomplete character.
"""

from __future__ import annotations

import re
from functools import lru_cache

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
