"""Decode attention on CPU without re-gathering each sequence's context every step.

The torch reference (``kernels/paged_attention_ref.paged_attention_ref``) gathers the whole
context of every decoding sequence from the paged cache in every layer of every step: at 16
sequences x 300 tokens that copy was the largest op of a SmolLM2 decode step on two cores
(more than all the linear layers). Here each layer keeps a contiguous copy of its decoding
sequences' context (``DecodeContext``: one *slot* per sequence in ``[num_slots,
num_kv_heads, capacity, head_dim]`` buffers for K and V) from step to step. A sequence that
decodes again appends its one new token to its slot; a sequence new to the decodes is
gathered from the cache once, into a free slot; a slot whose sequence left is reused. Slots
never move, so a batch that changes costs only the newcomers' gathers. Attention is one SDPA
call over the slots in use (the step's queries placed in their sequences' slots).

Why a copy can be trusted: a slot is reused for a sequence only when its block ids for every
position already held are the same and it grew by exactly one token. While a sequence runs,
its blocks hold positions no other sequence writes (its own blocks, or full prefix-cache
blocks that are never rewritten while shared), so the cache's content at those positions is
still what was copied. Anything else (a different table, a length that moved by more than
one, a new sequence) is gathered from the cache again.

Prompt chunks (more than one query) and decodes that do not lead the batch go to the
reference. The output equals the reference's bit for bit: the same SDPA call over the same
values, padded to the same length, with MKL in its reproducibility mode
(shared/reproducible_cpu.py; without it, a row's last bit depends on its thread on some CPUs).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from kernels.paged_attention_ref import paged_attention_ref

CAPACITY_STEP = 256  # tokens: slots' capacity grows in these steps (rounded to whole blocks)


class DecodeContext:
    """One layer's contiguous copies of its decoding sequences' context, one slot each."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes  # larger batches fall back to the reference
        self.keys: torch.Tensor | None = None  # [num_slots, num_kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None
        self.slot_lens = np.zeros(0, np.int64)  # [num_slots] tokens held; 0: free
        self.slot_tables = np.zeros((0, 0), np.int64)  # [num_slots, blocks] their block ids
        self.row_slots = np.zeros(0, np.int64)  # [num_rows] the last step's slot per row
        self.num_gathered = 0  # sequences copied from the cache (first decode, or not trusted)

    def clear(self) -> None:
        self.keys = self.values = None
        self.slot_lens, self.slot_tables = np.zeros(0, np.int64), np.zeros((0, 0), np.int64)
        self.row_slots = np.zeros(0, np.int64)

    def forget_blocks(self, block_ids: list[int]) -> None:
        """These blocks were rewritten from outside the model (loaded from the kvstore): a
        slot whose table names any of them is gathered from the cache again when next used
        (a table's padding may name block 0 too: that costs a copy, never a wrong answer)."""
        if len(self.slot_lens) and block_ids:
            stale = np.isin(self.slot_tables, block_ids).any(axis=1)  # [num_slots]
            self.slot_lens[stale] = 0

    def attend(self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
               scale: float) -> torch.Tensor | None:
        """Attention of one query per sequence, or None when the slots would not fit.

        query: [num_seqs, num_heads, head_dim]; block_tables: [num_seqs, max_blocks] int;
        seq_lens: [num_seqs] int, including this step's token, already written at
        slot_mapping [num_seqs]. returns: [num_seqs, num_heads, head_dim]
        """
        num_seqs, num_heads, head_dim = query.shape
        block_size, num_kv_heads = key_cache.shape[1:3]
        lens = seq_lens.numpy().astype(np.int64)  # [num_seqs]
        tables = block_tables.numpy()  # [num_seqs, max_blocks]
        padded_len = -(-int(lens.max()) // block_size) * block_size
        row_slots = self._continuing_slots(lens, tables, block_size)  # [num_seqs], -1: new
        num_new = int((row_slots < 0).sum())
        num_slots = max(len(self.slot_lens), int(row_slots.max(initial=-1)) + 1) \
            if num_new == 0 else self._slots_needed(row_slots)
        capacity = _capacity(max(padded_len, 0 if self.keys is None else self.keys.shape[2]),
                             block_size)
        if 2 * num_slots * num_kv_heads * capacity * head_dim * key_cache.element_size() \
                > self.max_bytes:
            self.clear()
            return None
        self._reserve(num_slots, capacity, key_cache)
        continuing = row_slots >= 0
        if continuing.any():  # append this step's token, from its cache slot
            rows = torch.from_numpy(np.flatnonzero(continuing))
            slots = torch.from_numpy(row_slots[continuing])
            positions = torch.from_numpy(lens[continuing] - 1)
            cache_slots = slot_mapping[rows]
            self.keys[slots, :, positions] = key_cache.flatten(0, 1)[cache_slots]
            self.values[slots, :, positions] = value_cache.flatten(0, 1)[cache_slots]
        if num_new:
            row_slots = self._gather_new(row_slots, lens, tables, key_cache, value_cache)
        num_blocks = -(-padded_len // block_size)
        self.slot_lens[:] = 0  # slots not in this step are free again
        self.slot_lens[row_slots] = lens
        if self.slot_tables.shape[1] < num_blocks:
            self.slot_tables = np.pad(self.slot_tables,
                                      ((0, 0), (0, num_blocks - self.slot_tables.shape[1])))
        self.slot_tables[row_slots, :num_blocks] = tables[:, :num_blocks]
        self.row_slots = row_slots
        return self._sdpa(query, row_slots, seq_lens, padded_len, num_kv_heads, scale)

    def _continuing_slots(self, lens: np.ndarray, tables: np.ndarray,
                          block_size: int) -> np.ndarray:
        """Per row, the slot holding its sequence one token shorter, or -1."""
        if self.keys is None:
            return np.full(len(lens), -1, np.int64)
        held_blocks = self.slot_tables.shape[1]
        if len(lens) == len(self.row_slots) and tables.shape[1] >= held_blocks:
            slots = self.row_slots  # the common step: the same sequences in the same order
            held = self.slot_lens[slots]
            if np.array_equal(lens, held + 1) and _same_blocks(
                    tables[:, :held_blocks], self.slot_tables[slots], held, block_size).all():
                return slots.copy()
        # candidates by (first block, length), then checked block by block; two slots with
        # the same key (siblings on a shared prefix, same length) leave one to be gathered
        # again, which costs a copy, never a wrong answer
        by_key = {(first, length): slot for slot, (first, length) in enumerate(
            zip(self.slot_tables[:, 0].tolist(), self.slot_lens.tolist())) if length}
        candidates = np.array([by_key.get((first, length - 1), -1) for first, length in
                               zip(tables[:, 0].tolist(), lens.tolist())], np.int64)
        if tables.shape[1] < held_blocks:
            tables = np.pad(tables, ((0, 0), (0, held_blocks - tables.shape[1])))
        held = self.slot_lens[candidates]
        ok = (candidates >= 0) & (lens == held + 1) & _same_blocks(
            tables[:, :held_blocks], self.slot_tables[candidates], held, block_size)
        _, first_rows = np.unique(candidates, return_index=True)
        once = np.zeros(len(lens), bool)
        once[first_rows] = True
        return np.where(ok & once, candidates, -1)

    def _slots_needed(self, row_slots: np.ndarray) -> int:
        """Slots in use once the new rows take the lowest free ones."""
        num_free_needed = int((row_slots < 0).sum())
        used = set(row_slots[row_slots >= 0].tolist())
        slot = 0
        for _ in range(num_free_needed):
            while slot in used:
                slot += 1
            used.add(slot)
        return max(used) + 1

    def _reserve(self, num_slots: int, capacity: int, key_cache: torch.Tensor) -> None:
        """Buffers of at least num_slots x capacity, the held tokens kept."""
        old = self.keys
        if old is not None and old.shape[0] >= num_slots and old.shape[2] >= capacity:
            return
        num_kv_heads, head_dim = key_cache.shape[2:]
        if old is not None:
            num_slots = max(num_slots, old.shape[0])
            capacity = max(capacity, old.shape[2])
        shape = (num_slots, num_kv_heads, capacity, head_dim)
        # zeroed once: a position past a slot's length is read (with weight 0 after the mask)
        # and 0 x NaN would poison the sum; later it holds only finite values from the cache
        keys = torch.zeros(shape, dtype=key_cache.dtype)
        values = torch.zeros(shape, dtype=key_cache.dtype)
        if old is not None:
            keys[:old.shape[0], :, :old.shape[2]] = old
            values[:old.shape[0], :, :old.shape[2]] = self.values
        self.keys, self.values = keys, values
        self.slot_lens = np.pad(self.slot_lens, (0, num_slots - len(self.slot_lens)))
        self.slot_tables = np.pad(self.slot_tables,
                                  ((0, num_slots - len(self.slot_tables)), (0, 0)))

    def _gather_new(self, row_slots: np.ndarray, lens: np.ndarray, tables: np.ndarray,
                    key_cache: torch.Tensor, value_cache: torch.Tensor) -> np.ndarray:
        """Give each new row the lowest free slot and copy its context (this step's token
        included) from the cache."""
        block_size, num_kv_heads, head_dim = key_cache.shape[1:]
        row_slots = row_slots.copy()
        used = set(row_slots[row_slots >= 0].tolist())
        free = (slot for slot in range(len(self.slot_lens)) if slot not in used)
        for row in np.flatnonzero(row_slots < 0).tolist():
            slot = next(free)
            row_slots[row] = slot
            num_blocks = -(-int(lens[row]) // block_size)
            span = num_blocks * block_size
            block_ids = torch.from_numpy(tables[row, :num_blocks].astype(np.int64))
            for cache, buffer in ((key_cache, self.keys), (value_cache, self.values)):
                # [num_kv_heads, span, head_dim]; positions past the length are finite
                context = cache.index_select(0, block_ids).view(span, num_kv_heads, head_dim)
                buffer[slot, :, :span].copy_(context.transpose(0, 1))
            self.num_gathered += 1
        return row_slots

    def _sdpa(self, query: torch.Tensor, row_slots: np.ndarray, seq_lens: torch.Tensor,
              padded_len: int, num_kv_heads: int, scale: float) -> torch.Tensor:
        num_seqs, num_heads, head_dim = query.shape
        group = num_heads // num_kv_heads
        # the query heads sharing a KV head are rows of one problem (as in the reference)
        grouped = query.view(num_seqs, num_kv_heads, group, head_dim)
        num_slots = int(row_slots.max()) + 1
        in_order = num_slots == num_seqs and np.array_equal(row_slots, np.arange(num_seqs))
        slot_lens = seq_lens
        if not in_order:  # queries into their slots; a free slot attends to position 0 only
            slots = torch.from_numpy(row_slots)
            grouped = grouped.new_zeros((num_slots,) + grouped.shape[1:]) \
                .index_copy_(0, slots, grouped)
            slot_lens = torch.ones(num_slots, dtype=seq_lens.dtype).index_copy_(0, slots, seq_lens)
        # [num_slots, 1, 1, padded_len]: True where the key position exists
        valid = (torch.arange(padded_len)[None, :] < slot_lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            grouped, self.keys[:num_slots, :, :padded_len],
            self.values[:num_slots, :, :padded_len], attn_mask=valid, scale=scale)
        if not in_order:
            out = out.index_select(0, torch.from_numpy(row_slots))
        return out.reshape(num_seqs, num_heads, head_dim)


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
