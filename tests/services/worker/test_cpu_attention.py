"""The CPU attention path (services/worker/cpu_attention.py) against the reference
(kernels/paged_attention_ref.paged_attention_ref), step after step: decodes that keep their
contiguous copy, sequences joining and leaving, prompt chunks after cached prefixes, mixed
decode + chunk batches, different lengths, block tables with holes, a batch too large for
the copy's budget."""

from __future__ import annotations

import random

import pytest
import torch

from kernels.paged_attention_ref import paged_attention_ref, write_kv_cache_ref
from services.worker.cpu_attention import DecodeContext, attention
from services.worker.model import AttentionMetadata

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 6, 2, 16
SCALE = HEAD_DIM ** -0.5


class Cache:
    """A paged cache and the sequences in it; ``step`` writes their new tokens' K/V and
    returns the metadata of the step, decodes first as the scheduler orders them."""

    def __init__(self, num_blocks: int, block_size: int, seed: int = 0):
        self.block_size = block_size
        shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
        self.key_cache, self.value_cache = torch.zeros(shape), torch.zeros(shape)
        self.rng = random.Random(seed)
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)  # tables with holes: blocks in no particular order
        self.tables: dict[str, list[int]] = {}
        self.lens: dict[str, int] = {}

    def add(self, name: str, shared_from: str | None = None, num_shared_blocks: int = 0) -> None:
        """A new sequence, optionally starting on another's first full blocks (a prefix hit)."""
        self.tables[name] = list(self.tables[shared_from][:num_shared_blocks]) if shared_from else []
        self.lens[name] = num_shared_blocks * self.block_size

    def drop(self, name: str) -> None:
        """Free the sequence's blocks that no other sequence holds (as the scheduler's
        reference counts do: a shared prefix block is never rewritten while in use)."""
        del self.lens[name]
        in_use = {b for table in self.tables.values() if table is not self.tables[name]
                  for b in table}
        self.free += [b for b in self.tables.pop(name) if b not in in_use]

    def step(self, new_tokens: dict[str, int]) -> tuple[torch.Tensor, AttentionMetadata]:
        names = sorted(new_tokens, key=lambda n: new_tokens[n] > 1)  # decodes first
        slots, q_lens = [], []
        for name in names:
            start, end = self.lens[name], self.lens[name] + new_tokens[name]
            while len(self.tables[name]) * self.block_size < end:
                self.tables[name].append(self.free.pop())
            slots += [self.tables[name][p // self.block_size] * self.block_size
                      + p % self.block_size for p in range(start, end)]
            self.lens[name], q_lens = end, q_lens + [new_tokens[name]]
        num_tokens = len(slots)
        key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        value = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        slot_mapping = torch.tensor(slots)
        write_kv_cache_ref(key, value, self.key_cache, self.value_cache, slot_mapping)
        max_blocks = max(len(self.tables[n]) for n in names)
        block_tables = torch.tensor([self.tables[n] + [0] * (max_blocks - len(self.tables[n]))
                                     for n in names], dtype=torch.int32)
        query_start_loc = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        longer = [i for i, q in enumerate(q_lens) if q > 1]
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping, block_tables=block_tables,
            seq_lens=torch.tensor([self.lens[n] for n in names], dtype=torch.int32),
            query_start_loc=query_start_loc, logits_indices=torch.empty(0, dtype=torch.long),
            max_query_len=max(q_lens), max_seq_len=max(self.lens[n] for n in names),
            num_decodes=longer[0] if longer else len(names))
        return torch.randn(num_tokens, NUM_HEADS, HEAD_DIM), metadata

    def check(self, context: DecodeContext | None, new_tokens: dict[str, int]) -> None:
        query, metadata = self.step(new_tokens)
        expected = paged_attention_ref(query, self.key_cache, self.value_cache,
                                       metadata.block_tables, metadata.seq_lens,
                                       metadata.query_start_loc, SCALE)
        got = attention(query, self.key_cache, self.value_cache, metadata, SCALE, context)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_decodes_keep_their_rows_and_equal_the_reference(block_size):
    cache = Cache(num_blocks=128, block_size=block_size)
    context = DecodeContext(max_bytes=1 << 30)
    for name, prompt_len in (("a", 5), ("b", 17), ("c", 40)):
        cache.add(name)
        cache.check(context, {name: prompt_len})  # whole prompts: the reference
    cache.check(context, dict.fromkeys("abc", 1))  # first decodes: gathered once
    rebuilds = context.num_gathered
    for _ in range(3 * block_size):  # crossing block boundaries, different lengths
        cache.check(context, dict.fromkeys("abc", 1))
    assert context.num_gathered == rebuilds  # continuing rows only append
    assert context.keys.shape[2] >= max(cache.lens.values())


def test_joining_leaving_and_mixed_batches_equal_the_reference():
    cache = Cache(num_blocks=256, block_size=8, seed=1)
    context = DecodeContext(max_bytes=1 << 30)
    rng = random.Random(2)
    cache.add("s0")
    cache.check(context, {"s0": 21})
    running = ["s0"]
    decoded = set()
    for step in range(60):
        new_tokens = dict.fromkeys(running, 1)
        if step % 7 == 3:  # a newcomer, sometimes on a running sequence's cached prefix
            name = f"s{step}"
            donor = rng.choice(running)
            shared = cache.lens[donor] // cache.block_size if step % 2 else 0
            cache.add(name, donor if shared else None, shared)
            new_tokens[name] = rng.randint(2, 30)  # its prompt, or a chunk after the prefix
            running.append(name)
        if step % 11 == 5 and len(running) > 2:  # one leaves
            gone = running.pop(rng.randrange(len(running) - 1))
            del new_tokens[gone]
            cache.drop(gone)
        cache.check(context, new_tokens)
        decoded |= {name for name, n in new_tokens.items() if n == 1}
    # each sequence was copied from the cache once, at its first decode: survivors keep their
    # slots when others leave or join
    assert context.num_gathered == len(decoded) > 3


def test_chunked_prompt_after_a_prefix_then_decodes():
    cache = Cache(num_blocks=64, block_size=8, seed=3)
    context = DecodeContext(max_bytes=1 << 30)
    cache.add("a")
    cache.check(context, {"a": 24})
    cache.add("b", shared_from="a", num_shared_blocks=3)  # 24 tokens cached
    cache.check(context, {"a": 1, "b": 5})  # a decodes, b's chunk after its prefix
    cache.check(context, {"a": 1, "b": 6})
    cache.check(context, {"a": 1, "b": 1})  # b joins the decodes
    cache.check(context, {"a": 1, "b": 1})


def test_a_different_sequence_on_the_same_length_is_gathered_again():
    cache = Cache(num_blocks=64, block_size=4, seed=4)
    context = DecodeContext(max_bytes=1 << 30)
    cache.add("a")
    cache.check(context, {"a": 9})
    cache.check(context, {"a": 1})
    cache.drop("a")
    cache.add("b")  # b is a at the same length, in other blocks (a's freed ones, reordered)
    cache.check(context, {"b": 10})
    rebuilds = context.num_gathered
    cache.check(context, {"b": 1})
    assert context.num_gathered == rebuilds + 1


def test_a_batch_over_budget_falls_back_to_the_reference():
    cache = Cache(num_blocks=64, block_size=8, seed=5)
    context = DecodeContext(max_bytes=1024)
    for name in "ab":
        cache.add(name)
        cache.check(context, {name: 12})
    cache.check(context, {"a": 1, "b": 1})
    assert context.keys is None


def test_decodes_behind_a_chunk_go_to_the_reference():
    cache = Cache(num_blocks=64, block_size=8, seed=6)
    context = DecodeContext(max_bytes=1 << 30)
    for name in "ab":
        cache.add(name)
        cache.check(context, {name: 12})
    query, metadata = cache.step({"a": 3, "b": 1})
    # put b's decode after a's chunk
    order = [1, 0]
    metadata.block_tables = metadata.block_tables[order]
    metadata.seq_lens = metadata.seq_lens[order]
    metadata.query_start_loc = torch.tensor([0, 3, 4], dtype=torch.int32)
    metadata.num_decodes = 0
    query = torch.cat([query[1:], query[:1]])
    expected = paged_attention_ref(query, cache.key_cache, cache.value_cache,
                                   metadata.block_tables, metadata.seq_lens,
                                   metadata.query_start_loc, SCALE)
    got = attention(query, cache.key_cache, cache.value_cache, metadata, SCALE, context)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
