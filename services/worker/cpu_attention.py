"""Decode attention on CPU without re-gathering each sequence's context every step.

The torch reference (``kernels/paged_attention.paged_attention_ref``) gathers the whole
context of every decoding sequence from the paged cache in every layer of every step: at 16
sequences x 300 tokens that copy was the largest op of a SmolLM2 decode step on two cores
(more than all the linear layers). Here each layer keeps a contiguous copy of its decode rows'
context (``DecodeContext``, ``[rows, num_kv_heads, capacity, head_dim]`` for K and for V) from
step to step: a sequence that decodes again in the next step only appends its new token, and
attention runs on the copy with one SDPA call. Rows are rebuilt (copied from the old buffer,
or gathered from the cache for sequences new to it) only when the batch changes.

Why a copy can be trusted: a row is reused for a sequence only when its block ids for every
position already held are the same and it grew by exactly one token. While a sequence runs,
its blocks hold positions no other sequence writes (its own blocks, or full prefix-cache
blocks that are never rewritten while shared), so the cache's content at those positions is
still what was copied. Anything else (a different table, a length that moved by more than
one, a new sequence) is gathered from the cache again.

Prompt chunks (more than one query) and decodes that do not lead the batch go to the
reference. The output equals the reference's: the same SDPA call over the same values, padded
to the same length.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_attention_ref

CAPACITY_STEP = 256  # tokens: a row's capacity grows in these steps (rounded to whole blocks)


class DecodeContext:
    """One layer's contiguous copy of the context of the decode rows of the last step."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # larger batches fall back to the reference
        self.keys: torch.Tensor | None = None  # [rows, num_kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.lens = np.zeros(0, np.int64)  # [rows] tokens held per row
        self.tables = np.zeros((0, 0), np.int64)  # [rows, blocks] block ids behind those tokens
        self.num_rebuilds = 0  # steps whose rows did not all continue the step before

    def clear(self) -> None:
        self.keys = self.values = None
        self.lens, self.tables = np.zeros(0, np.int64), np.zeros((0, 0), np.int64)

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
               scale: float) -> torch.Tensor | None:
        """Attention of one query per sequence, or None when the rows would not fit.

        query: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int;
        seq_lens: [num_seqs] int, including this step's token, already written at
        slot_mapping [num_seqs]. returns: [num_seqs, num_heads, head_dim]
        """
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1:3]
        lens = seq_lens.numpy().astype(np.int64)  # [num_seqs]
        tables = block_tables.numpy()  # [num_seqs, max_blocks]
        padded_len = -(-int(lens.max()) // block_size) * block_size
        if not self._fits(num_seqs, num_kv_heads, padded_len, head_dim, key_cache.element_size()):
            self.clear()
            return None
        if not self._continues(lens, tables, block_size):
            self._rebuild(lens, tables, key_cache, value_cache, padded_len)
        elif self.keys.shape[2] < padded_len:
            self._grow(padded_len, block_size)
        # [num_seqs, num_kv_heads, head_dim]: this step's token, from the cache slots
        rows = torch.arange(num_seqs)
        positions = torch.from_numpy(lens - 1)
        fresh = self.lens < lens  # rows still missing their newest token
        if fresh.any():
            pick = torch.from_numpy(np.flatnonzero(fresh))
            slots = slot_mapping[pick]
            self.keys[rows[pick], :, positions[pick]] = key_cache.flatten(0, 1)[slots]
            self.values[rows[pick], :, positions[pick]] = value_cache.flatten(0, 1)[slots]
        self.lens, self.tables = lens, tables[:, :-(-padded_len // block_size)].copy()
        # [num_seqs, 1, 1, padded_len]: True where the key position exists
        valid = (torch.arange(padded_len)[None, :] < seq_lens[:, None])[:, None, None, :]
        group = num_heads // num_kv_heads
        # the query heads sharing a KV head are rows of one problem (as in the reference)
        grouped = query.view(num_seqs, num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(
            grouped, self.keys[:, :, :padded_len], self.values[:, :, :padded_len],
            attn_mask=valid, scale=scale)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _fits(self, num_seqs: int, num_kv_heads: int, padded_len: int, head_dim: int,
              element_size: int) -> bool:
        capacity = max(padded_len, 0 if self.keys is None else self.keys.shape[2])
        capacity = _capacity(capacity, 1)
        return 2 * num_seqs * num_kv_heads * capacity * head_dim * element_size <= self.max_bytes

    def _continues(self, lens: np.ndarray, tables: np.ndarray, block_size: int) -> bool:
        """Every row is the same sequence as the step before's row, one token longer."""
        if self.keys is None or len(lens) != len(self.lens) \
                or not np.array_equal(lens, self.lens + 1):
            return False
        held_blocks = self.tables.shape[1]
        if tables.shape[1] < held_blocks:
            return False
        return _same_blocks(tables[:, :held_blocks], self.tables, self.lens, block_size).all()

    def _rebuild(self, lens: np.ndarray, tables: np.ndarray, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, padded_len: int) -> None:
        """New rows in this step's order: a continuing sequence's copy moves over, any other
        row is gathered from the cache (its whole context, this step's token included)."""
        self.num_rebuilds += 1
        block_size, num_kv_heads, head_dim = key_cache.shape[1:]
        num_seqs = len(lens)
        capacity = _capacity(padded_len, block_size)
        if self.keys is not None:
            capacity = max(capacity, self.keys.shape[2])
        shape = (num_seqs, num_kv_heads, capacity, head_dim)
        # zeroed: masked positions must not hold NaN (0 x NaN would poison the weighted sum)
        keys = torch.zeros(shape, dtype=key_cache.dtype)
        values = torch.zeros(shape, dtype=value_cache.dtype)
        held = self._previous_rows(lens, tables, block_size)  # [num_seqs] old row or -1
        new_lens = np.where(held >= 0, lens - 1, lens)
        # positions past a row's length hold finite values from the cache or zeros: the mask
        # gives them weight 0, and a row's next token overwrites its position
        moved = np.flatnonzero(held >= 0)
        if len(moved):
            old_held = int(self.lens.max())
            index = torch.from_numpy(held[moved])
            rows = torch.from_numpy(moved)
            keys[rows, :, :old_held] = self.keys[:, :, :old_held].index_select(0, index)
            values[rows, :, :old_held] = self.values[:, :, :old_held].index_select(0, index)
        gathered = np.flatnonzero(held < 0)
        if len(gathered):
            num_blocks = -(-int(lens[gathered].max()) // block_size)
            # [len(gathered) * num_blocks] block ids; padding rows of tables hold valid ids
            block_ids = torch.from_numpy(tables[gathered, :num_blocks].astype(np.int64)).flatten()
            context = (len(gathered), num_blocks * block_size, num_kv_heads, head_dim)
            span = num_blocks * block_size
            rows = torch.from_numpy(gathered)
            keys[rows, :, :span] = key_cache.index_select(0, block_ids).view(context) \
                .transpose(1, 2)
            values[rows, :, :span] = value_cache.index_select(0, block_ids).view(context) \
                .transpose(1, 2)
        self.keys, self.values, self.lens = keys, values, new_lens

    def _previous_rows(self, lens: np.ndarray, tables: np.ndarray, block_size: int) -> np.ndarray:
        """Per row of this step, the old row holding its sequence one token shorter, or -1."""
        held = np.full(len(lens), -1, np.int64)
        if self.keys is None:
            return held
        by_key = {}
        for row, (length, table) in enumerate(zip(self.lens.tolist(), self.tables)):
            by_key[(length, tuple(table[:-(-length // block_size)].tolist()))] = row
        for row, (length, table) in enumerate(zip(lens.tolist(), tables)):
            previous = length - 1
            if previous > 0:
                key = (previous, tuple(table[:-(-previous // block_size)].tolist()))
                held[row] = by_key.get(key, -1)
        return held

    def _grow(self, padded_len: int, block_size: int) -> None:
        capacity = _capacity(padded_len, block_size)
        old_capacity = self.keys.shape[2]
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_zeros(old.shape[:2] + (capacity,) + old.shape[3:])
            new[:, :, :old_capacity] = old
            setattr(self, name, new)


def _same_blocks(tables: np.ndarray, held_tables: np.ndarray, held_lens: np.ndarray,
                 block_size: int) -> np.ndarray:
    """[rows] bool: the block ids behind each row's held tokens are unchanged."""
    used = np.arange(held_tables.shape[1])[None, :] < -(-held_lens[:, None] // block_size)
    return ((tables == held_tables) | ~used).all(axis=1)


def _capacity(padded_len: int, block_size: int) -> int:
    step = -(-CAPACITY_STEP // block_size) * block_size
    return -(-padded_len // step) * step


def attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
              metadata, scale: float, context: DecodeContext | None) -> torch.Tensor:
    """Causal paged attention on CPU: the leading decodes through ``context``, the rest (and
    everything when there is no context or it would not fit) through the reference.

    query: [num_tokens, num_heads, head_dim]; returns the same shape.
    """
    num_decodes = metadata.num_decodes
    decoded = None
    if context is not None and num_decodes > 0:
        decoded = context.attend(query[:num_decodes], key_cache, value_cache,
                                 metadata.block_tables[:num_decodes],
                                 metadata.seq_lens[:num_decodes],
                                 metadata.slot_mapping[:num_decodes], scale)
    if decoded is None:
        return paged_attention_ref(query, key_cache, value_cache, metadata.block_tables,
                                   metadata.seq_lens, metadata.query_start_loc, scale)
    if num_decodes == query.shape[0]:
        return decoded
    # the prompt chunks after the decodes: the reference on that part of the batch
    rest = paged_attention_ref(
        query[num_decodes:], key_cache, value_cache, metadata.block_tables[num_decodes:],
        metadata.seq_lens[num_decodes:],
        metadata.query_start_loc[num_decodes:] - num_decodes, scale)
    return torch.cat([decoded, rest])
