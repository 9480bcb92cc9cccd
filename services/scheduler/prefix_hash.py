"""Prefix-cache block hashes: a versioned, deterministic spec (docs/prefix-hash.md).

A full block's key is SHA-256 over a canonical byte string chaining the parent block's
key, the block's token ids and the request's extra keys (model identity, cache salt).
No per-process seed: the same tokens give the same key in every process, on every
machine, after every restart, in any language that follows the spec.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

SPEC_VERSION = b"flotilla-prefix-v1"
ROOT_PARENT = bytes(32)  # the parent of a sequence's first block


def block_hash(parent: bytes, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
    """SHA-256( version tag || parent (32 bytes) || u32le count || u32le token ids
    || u32le number of extra keys || for each: u32le byte length || UTF-8 bytes )."""
    digest = hashlib.sha256(SPEC_VERSION)
    digest.update(parent)
    digest.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    digest.update(struct.pack("<I", len(extra_keys)))
    for key in extra_keys:
        encoded = key.encode("utf-8")
        digest.update(struct.pack("<I", len(encoded)))
        digest.update(encoded)
    return digest.digest()


def extend_block_hashes(block_hashes: list[bytes], token_ids: Sequence[int], num_tokens: int,
                        block_size: int, extra_keys: Sequence[str]) -> None:
    """Append the keys of the full blocks among the first ``num_tokens`` tokens that
    ``block_hashes`` does not have yet (in place)."""
    for index in range(len(block_hashes), num_tokens // block_size):
        parent = block_hashes[-1] if block_hashes else ROOT_PARENT
        block_tokens = token_ids[index * block_size:(index + 1) * block_size]
        block_hashes.append(block_hash(parent, block_tokens, extra_keys))
