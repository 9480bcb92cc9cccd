"""The prefix-cache key follows docs/prefix-hash.md exactly."""

from __future__ import annotations

import hashlib
import random
import struct

import pytest

from shared.prefix_hash import (
    ROOT_PARENT, block_hash, extend_block_hashes, extra_keys, image_keys, usable_block_hashes,
)

MODEL = "model:SmolLM2-135M-Instruct"
FIRST = "6cfc9e9f39640b05668c7e39d8bef8c16c466064900748a8d73df2ffb080ae83"


@pytest.mark.parametrize("parent,tokens,extra,expected", [
    (None, [1, 2, 3, 4], [MODEL], FIRST),
    (FIRST, [5, 6, 7, 8], [MODEL], "229a14a817380b1e0a17e9a2040992af45c72ff94342b3cb8a1d7feae179ab46"),
    (None, [1, 2, 3, 4], [MODEL, "salt:tenant-a"],
     "09f3daecf10a769a6cf7a39729012b06a2cc4dbe7d8eb66345d132f8e2c4cc2e"),
    (None, [], [], "ed54245c7f1d89619ab8eafe65552bd8b39f50a4e4b11e89f2e7a5cd129855ed"),
    (None, [49151, 0, 65536, 4294967295], ["model:ünï"],
     "ca3801aff9b4fc0d58a60a972a79f802c7d705d44dce064ce59241f4c02ce672"),
])
def test_vectors(parent, tokens, extra, expected):
    parent_bytes = bytes.fromhex(parent) if parent else ROOT_PARENT
    assert block_hash(parent_bytes, tokens, extra).hex() == expected
    # the same bytes, built by hand from the spec
    data = b"flotilla-prefix-v1" + parent_bytes + struct.pack("<I", len(tokens))
    data += b"".join(struct.pack("<I", t) for t in tokens) + struct.pack("<I", len(extra))
    for key in extra:
        data += struct.pack("<I", len(key.encode())) + key.encode()
    assert hashlib.sha256(data).hexdigest() == expected


def test_keys_chain_over_full_blocks_only():
    hashes: list[bytes] = []
    tokens = list(range(10))
    extend_block_hashes(hashes, tokens, 10, 4, [MODEL])
    assert len(hashes) == 2  # the 2 leftover tokens are not a full block
    assert hashes[1] == block_hash(hashes[0], tokens[4:8], [MODEL])
    extend_block_hashes(hashes, tokens + [10, 11], 12, 4, [MODEL])
    assert len(hashes) == 3 and hashes[2] == block_hash(hashes[1], [8, 9, 10, 11], [MODEL])


def test_a_different_earlier_block_changes_every_later_key():
    a, b = [], []
    extend_block_hashes(a, [1, 2, 3, 4, 5, 6, 7, 8], 8, 4, [MODEL])
    extend_block_hashes(b, [9, 2, 3, 4, 5, 6, 7, 8], 8, 4, [MODEL])
    assert a[0] != b[0] and a[1] != b[1]


def test_extra_keys_name_the_model_then_the_salt():
    assert extra_keys("SmolLM2-135M-Instruct") == (MODEL,)
    assert extra_keys("SmolLM2-135M-Instruct", "tenant-a") == (MODEL, "salt:tenant-a")
    assert extra_keys("m", "") == ("model:m",)  # an empty salt is no salt


def test_usable_blocks_leave_out_the_last_tokens_block():
    """The block holding the last token is always computed, so it is never a hit: the
    scheduler's lookups and the gateway's routing both key only the blocks before it."""
    keys = extra_keys("m")
    assert len(usable_block_hashes(list(range(8)), 4, keys)) == 1
    assert len(usable_block_hashes(list(range(9)), 4, keys)) == 2
    expected: list[bytes] = []
    extend_block_hashes(expected, list(range(9)), 8, 4, keys)
    assert usable_block_hashes(list(range(9)), 4, keys) == expected
    assert usable_block_hashes([], 4, keys) == []


@pytest.mark.parametrize("block_size, extra", [
    (16, [MODEL]), (4, [MODEL, "salt:tenant-a"]), (1, ["model:ünï"]), (3, []),
])
def test_a_run_of_blocks_gets_block_hashs_keys(block_size, extra):
    """extend_block_hashes builds the bytes of many blocks at once: each key must be the
    one block_hash gives block by block, from any starting point and in pieces."""
    rng = random.Random(block_size)
    tokens = [rng.randrange(0, 2**32) for _ in range(40 * block_size + 3)] + [0, 2**32 - 1]
    expected, parent = [], ROOT_PARENT
    for index in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[index * block_size:(index + 1) * block_size], extra)
        expected.append(parent)
    at_once: list[bytes] = []
    extend_block_hashes(at_once, tokens, len(tokens), block_size, extra)
    in_pieces: list[bytes] = []
    for num_tokens in (0, block_size - 1, 5 * block_size + 1, 5 * block_size + 2, len(tokens)):
        extend_block_hashes(in_pieces, tuple(tokens), num_tokens, block_size, tuple(extra))
    assert at_once == in_pieces == expected


def test_an_image_key_joins_the_block_of_its_first_placeholder():
    """A block before an image is a text prompt's; the block where an image starts adds its
    key (so other pixels behind the same placeholder tokens never share it), and the blocks
    after carry it through their parents; two images starting in one block add both."""
    tokens = list(range(100, 132))  # 8 blocks of 4
    text: list[bytes] = []
    extend_block_hashes(text, tokens, 32, 4, [MODEL])
    images = image_keys([(9, b"\x01" * 16), (21, b"\x02" * 16), (22, b"\x03" * 16)])
    assert images[0] == (9, "image:" + "01" * 16)
    with_images: list[bytes] = []
    extend_block_hashes(with_images, tokens, 32, 4, [MODEL], images)
    expected, parent = [], ROOT_PARENT
    for block in range(8):
        keys = [MODEL] + [key for position, key in images if position // 4 == block]
        parent = block_hash(parent, tokens[4 * block:4 * block + 4], keys)
        expected.append(parent)
    assert with_images == expected
    assert with_images[:2] == text[:2] and with_images[2] != text[2]
    other: list[bytes] = []
    extend_block_hashes(other, tokens, 32, 4, [MODEL], image_keys([(9, b"\x09" * 16)]))
    assert other[:2] == text[:2] and other[2:] != with_images[2:]
    grown: list[bytes] = with_images[:3]  # extended later, from the middle
    extend_block_hashes(grown, tokens, 32, 4, [MODEL], images)
    assert grown == with_images
    assert usable_block_hashes(tokens + [0], 4, [MODEL], images) == with_images
