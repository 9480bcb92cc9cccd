"""A step's inputs moved on the device in one launch (Triton), where torch takes one copy per
tensor.

Between two decode steps on a GPU the device runs, besides the step's CUDA graph, the copies
that bring the step's inputs: its two host-to-device copies, the tokens the step in flight
sampled put into place (a gather and an index copy), and five copies into the graph's static
buffers. Each is a few microseconds, mostly the gap between dependent launches (one H200, a
batch-1 decode of Llama-3.1-8B: ~34 us a step before the graph starts).

- ``fill_pending_tokens``: every input row whose token the step in flight samples gets it
  (``source_rows`` [num_tokens], -1 where the row has its own token).
- ``fill_graph_inputs``: a whole-step graph's static buffers from a step's inputs: token ids
  (pending ones taken from the step in flight), positions and slots of every token, length and
  block table of every sequence, and the bucket's padding rows (slot -1, so their keys and
  values go nowhere; length ``query_len`` over block 0), as ``DecodeGraphs.run`` copied them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_TOKENS = 128  # token rows per program of fill_pending_tokens
BLOCK_COLUMNS = 256  # block-table entries per loop step of fill_graph_inputs
# Triton compiles a variant per value class of an int (1, a multiple of 16, other) and per
# 16-byte alignment of a pointer. A step's counts vary, and its inputs are views at varying
# offsets into one copy: each new class would compile mid-serving (about a second each), so
# these kernels take every such argument unspecialized (one variant each).
_STEP_INTS = ["num_tokens", "num_seqs", "width", "graph_width"]
_STEP_POINTERS = ["input_ids_ptr", "positions_ptr", "slot_mapping_ptr", "seq_lens_ptr",
                  "block_tables_ptr", "source_rows_ptr", "token_ids_ptr"]


@triton.jit
def _pending_tokens(input_ids_ptr, source_rows_ptr, token_ids_ptr, tokens, mask):
    """The input token ids of rows ``tokens``: the in-flight step's token where a source row
    is given, else the row's own."""
    source = tl.load(source_rows_ptr + tokens, mask=mask, other=-1)
    own = tl.load(input_ids_ptr + tokens, mask=mask, other=0)
    sampled = tl.load(token_ids_ptr + source, mask=mask & (source >= 0), other=0)
    return tl.where(source >= 0, sampled, own)


@triton.jit(do_not_specialize=_STEP_INTS[:1],
            do_not_specialize_on_alignment=["input_ids_ptr", "source_rows_ptr", "token_ids_ptr"])
def _fill_pending_kernel(input_ids_ptr, source_rows_ptr, token_ids_ptr, num_tokens,
                         BLOCK: tl.constexpr):
    tokens = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = tokens < num_tokens
    ids = _pending_tokens(input_ids_ptr, source_rows_ptr, token_ids_ptr, tokens, mask)
    tl.store(input_ids_ptr + tokens, ids, mask=mask)


def fill_pending_tokens(input_ids: torch.Tensor, source_rows: torch.Tensor,
                        token_ids: torch.Tensor) -> None:
    """input_ids [num_tokens] int64, in place: row t takes ``token_ids[source_rows[t]]``
    where ``source_rows`` [num_tokens] int64 is >= 0. token_ids: [num_sampled] int64."""
    num_tokens = input_ids.shape[0]
    if source_rows.shape != (num_tokens,):
        raise ValueError(f"source_rows {tuple(source_rows.shape)} for {num_tokens} tokens")
    if num_tokens:
        _fill_pending_kernel[(triton.cdiv(num_tokens, BLOCK_TOKENS),)](
            input_ids, source_rows, token_ids, num_tokens, BLOCK=BLOCK_TOKENS)


@triton.jit(do_not_specialize=_STEP_INTS[1:], do_not_specialize_on_alignment=_STEP_POINTERS)
def _fill_graph_inputs_kernel(
    input_ids_ptr, positions_ptr, slot_mapping_ptr, seq_lens_ptr, block_tables_ptr,
    source_rows_ptr, token_ids_ptr,
    graph_input_ids_ptr, graph_positions_ptr, graph_slot_mapping_ptr, graph_seq_lens_ptr,
    graph_block_tables_ptr,
    num_seqs, width, graph_width,
    QUERY_LEN: tl.constexpr, BLOCK_Q: tl.constexpr, HAS_PENDING: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program per sequence row of the bucket: its QUERY_LEN tokens and its table row."""
    seq = tl.program_id(0)
    offs = tl.arange(0, BLOCK_Q)
    tokens = seq * QUERY_LEN + offs
    token_mask = offs < QUERY_LEN
    table_row = graph_block_tables_ptr + seq.to(tl.int64) * graph_width
    if seq < num_seqs:
        if HAS_PENDING:
            ids = _pending_tokens(input_ids_ptr, source_rows_ptr, token_ids_ptr, tokens,
                                  token_mask)
        else:
            ids = tl.load(input_ids_ptr + tokens, mask=token_mask)
        tl.store(graph_input_ids_ptr + tokens, ids, mask=token_mask)
        tl.store(graph_positions_ptr + tokens, tl.load(positions_ptr + tokens, mask=token_mask),
                 mask=token_mask)
        tl.store(graph_slot_mapping_ptr + tokens,
                 tl.load(slot_mapping_ptr + tokens, mask=token_mask), mask=token_mask)
        tl.store(graph_seq_lens_ptr + seq, tl.load(seq_lens_ptr + seq))
        columns = tl.arange(0, BLOCK)
        for start in range(0, width, BLOCK):
            mask = start + columns < width
            entries = tl.load(block_tables_ptr + seq.to(tl.int64) * width + start + columns,
                              mask=mask)
            tl.store(table_row + start + columns, entries, mask=mask)
    else:  # padding: writes nowhere, attends to its own QUERY_LEN slots of block 0
        tl.store(graph_slot_mapping_ptr + tokens, tl.full([BLOCK_Q], -1, tl.int64),
                 mask=token_mask)
        tl.store(graph_seq_lens_ptr + seq, QUERY_LEN)
        tl.store(table_row, 0)


def fill_graph_inputs(input_ids: torch.Tensor, positions: torch.Tensor,
                      slot_mapping: torch.Tensor, seq_lens: torch.Tensor,
                      block_tables: torch.Tensor, graph_buffers: tuple, bucket: int,
                      query_len: int, pending: tuple | None = None) -> None:
    """A step of ``num_seqs`` sequences with ``query_len`` tokens each into the first
    ``bucket`` rows of a graph's static buffers, in one launch.

    input_ids, positions, slot_mapping: [num_seqs * query_len] int64; seq_lens: [num_seqs]
    int32; block_tables: [num_seqs, width] int32, contiguous.
    graph_buffers: the graph's (input_ids, positions, slot_mapping, seq_lens, block_tables),
    the same dtypes, at least ``bucket`` sequences long, block_tables [.., graph_width >=
    width] contiguous.
    pending: (source_rows [num_tokens] int64, token_ids [num_sampled] int64) as
    ``fill_pending_tokens`` takes them, or None.
    """
    num_seqs, width = block_tables.shape
    graph_input_ids, graph_positions, graph_slots, graph_seq_lens, graph_tables = graph_buffers
    if input_ids.shape != (num_seqs * query_len,) or seq_lens.shape != (num_seqs,):
        raise ValueError(f"{num_seqs} sequences of {query_len} tokens, but input_ids "
                         f"{tuple(input_ids.shape)} and seq_lens {tuple(seq_lens.shape)}")
    if not (num_seqs <= bucket <= graph_seq_lens.shape[0] and width <= graph_tables.shape[1]
            and block_tables.is_contiguous() and graph_tables.is_contiguous()):
        raise ValueError(f"{num_seqs} sequences of {width} blocks do not fit bucket {bucket} of "
                         f"graph buffers {tuple(graph_tables.shape)}")
    source_rows, token_ids = pending if pending is not None else (input_ids, input_ids)
    _fill_graph_inputs_kernel[(bucket,)](
        input_ids, positions, slot_mapping, seq_lens, block_tables, source_rows, token_ids,
        graph_input_ids, graph_positions, graph_slots, graph_seq_lens, graph_tables,
        num_seqs, width, graph_tables.shape[1],
        QUERY_LEN=query_len, BLOCK_Q=triton.next_power_of_2(query_len),
        HAS_PENDING=pending is not None, BLOCK=BLOCK_COLUMNS,
    )
