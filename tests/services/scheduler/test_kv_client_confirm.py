"""The client's check of a pinned hit's tokens (a hash alone is no proof), on replies read
as it reads them: each block's tokens left encoded, compared at once when all are alike,
else block by block, as a decoded reply is."""

from __future__ import annotations

import msgspec
import pytest

from services.scheduler.kv_client import KvClient, LookupReply, PinReply
from shared.messages import decode, encode
from shared.kv_messages import KvLookupReply, KvPinReply

SIZE = 4


def client() -> KvClient:
    made = KvClient.__new__(KvClient)  # only the block size is used here
    made.block_size = SIZE
    return made


def blocks(first: int, count: int) -> list[tuple[int, ...]]:
    return [tuple(range(i * SIZE, (i + 1) * SIZE)) for i in range(first, first + count)]


TOKENS = [t for block in blocks(0, 8) for t in block] + [1]  # 8 full blocks, then one more


def replies(slot_ids: list[int], token_ids: list[tuple[int, ...]]):
    """The same reply as the client reads it and fully decoded, for lookups and pins."""
    lookup = KvLookupReply(store_id="s", tiers=["host"] * len(slot_ids),
                           slot_ids=slot_ids, token_ids=token_ids)
    pin = KvPinReply(store_id="s", slot_ids=slot_ids, token_ids=token_ids,
                     tiers=["host"] * len(slot_ids))
    return [decode(encode(lookup), LookupReply), decode(encode(lookup), KvLookupReply),
            decode(encode(pin), PinReply), decode(encode(pin), KvPinReply)]


def changed(token_ids: list[tuple[int, ...]], index: int) -> list[tuple[int, ...]]:
    return token_ids[:index] + [(99_999,) * SIZE] + token_ids[index + 1:]


@pytest.mark.parametrize("first, slot_ids, token_ids, request_tokens, expected", [
    (0, [0, 1, 2], blocks(0, 3), TOKENS, 3),  # all alike
    (2, [5, 6, 7], blocks(2, 3), TOKENS, 3),  # after a GPU prefix of 2 blocks
    (0, [0, 1, 2], changed(blocks(0, 3), 1), TOKENS, 1),  # the run ends at a differing block
    (0, [0, 1, 2], changed(blocks(0, 3), 0), TOKENS, 0),
    (0, [0, 1, 2], blocks(0, 3), TOKENS[:2 * SIZE + 1], 2),  # the request ends within
    (0, [0, 1], blocks(0, 3), TOKENS, 2),  # tokens of more blocks than pinned: those count
    (0, [], [], TOKENS, 0),
    (0, [0, 1], blocks(0, 2), tuple(TOKENS), 2),  # any sequence of ids
])
def test_confirmed_blocks_are_the_leading_ones_alike(first, slot_ids, token_ids,
                                                     request_tokens, expected):
    for reply in replies(slot_ids, token_ids):
        assert client()._num_confirmed(reply, first, request_tokens) == expected, reply


def test_the_client_reads_every_field_of_the_replies():
    for view, message in ((LookupReply, KvLookupReply), (PinReply, KvPinReply)):
        assert [f.name for f in msgspec.structs.fields(view)] == \
            [f.name for f in msgspec.structs.fields(message)]
    defaults = decode(encode(KvLookupReply(store_id="s", tiers=[])), LookupReply)
    assert defaults.slot_ids == [] and bytes(defaults.token_ids) == encode([])
