"""kernels/step_inputs.py (Triton; Triton's interpreter on the CPU) against the torch copies
it replaces: DecodeGraphs.run's five copies and three padding fills, and the pending tokens'
gather and index copy."""

from __future__ import annotations

import pytest
import torch

from kernels.step_inputs import fill_graph_inputs, fill_pending_tokens

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _graph_buffers(size: int, query_len: int, graph_width: int) -> tuple:
    """Static buffers holding stale values from an earlier step, as a graph's do."""
    num_tokens = size * query_len
    gen = torch.Generator().manual_seed(5)
    return tuple(t.to(DEVICE) for t in (
        torch.randint(0, 1000, (num_tokens,), generator=gen),
        torch.randint(0, 1000, (num_tokens,), generator=gen),
        torch.randint(0, 1000, (num_tokens,), generator=gen),
        torch.randint(1, 1000, (size,), generator=gen, dtype=torch.int32),
        torch.randint(1, 1000, (size, graph_width), generator=gen, dtype=torch.int32)))


def _copied_as_before(buffers: tuple, step: tuple, bucket: int, query_len: int,
                      pending: tuple | None) -> tuple:
    """What DecodeGraphs.run's torch copies (and fill_pending_inputs before them) wrote."""
    input_ids, positions, slot_mapping, seq_lens, block_tables = (t.clone() for t in step)
    if pending is not None:
        source_rows, token_ids = pending
        rows = (source_rows >= 0).nonzero().squeeze(1)
        input_ids.index_copy_(0, rows, token_ids[source_rows[rows]])
    graph_ids, graph_positions, graph_slots, graph_lens, graph_tables = (t.clone() for t in buffers)
    num_tokens, (num_seqs, width) = input_ids.shape[0], block_tables.shape
    graph_ids[:num_tokens].copy_(input_ids)
    graph_positions[:num_tokens].copy_(positions)
    graph_slots[:num_tokens].copy_(slot_mapping)
    graph_tables[:num_seqs, :width].copy_(block_tables)
    graph_lens[:num_seqs].copy_(seq_lens)
    graph_slots[num_tokens:bucket * query_len].fill_(-1)
    graph_lens[num_seqs:bucket].fill_(query_len)
    graph_tables[num_seqs:bucket, 0].fill_(0)
    return graph_ids, graph_positions, graph_slots, graph_lens, graph_tables


@pytest.mark.parametrize("num_seqs,bucket,query_len,width,with_pending", [
    (1, 1, 1, 3, True), (3, 4, 1, 5, True), (5, 8, 1, 300, False), (2, 4, 5, 7, False),
    (8, 8, 1, 2, True)])
def test_fill_graph_inputs_writes_what_the_copies_wrote(num_seqs, bucket, query_len, width,
                                                        with_pending):
    gen = torch.Generator().manual_seed(num_seqs * 10 + width)
    num_tokens = num_seqs * query_len
    step = tuple(t.to(DEVICE) for t in (
        torch.randint(0, 50_000, (num_tokens,), generator=gen),
        torch.randint(0, 4096, (num_tokens,), generator=gen),
        torch.randint(-1, 9000, (num_tokens,), generator=gen),
        torch.randint(1, 4096, (num_seqs,), generator=gen, dtype=torch.int32),
        torch.randint(0, 500, (num_seqs, width), generator=gen, dtype=torch.int32)))
    pending = None
    if with_pending:  # every other sequence's token comes from the step in flight
        token_ids = torch.randint(0, 50_000, (num_seqs + 2,), generator=gen).to(DEVICE)
        source_rows = torch.full((num_tokens,), -1, dtype=torch.int64)
        source_rows[::2] = torch.arange(len(source_rows[::2])) + 2
        pending = (source_rows.to(DEVICE), token_ids)
    buffers = _graph_buffers(8, query_len, 320)
    expected = _copied_as_before(buffers, step, bucket, query_len, pending)
    fill_graph_inputs(*step, buffers, bucket, query_len, pending)
    for name, got, want in zip(("input_ids", "positions", "slots", "seq_lens", "tables"),
                               buffers, expected):
        assert torch.equal(got, want), name


def test_fill_graph_inputs_refuses_what_does_not_fit():
    step = (torch.zeros(4, dtype=torch.int64),) * 3 + (
        torch.ones(4, dtype=torch.int32), torch.zeros(4, 400, dtype=torch.int32))
    with pytest.raises(ValueError, match="do not fit"):
        fill_graph_inputs(*step, _graph_buffers(8, 1, 320), 4, 1)  # 400 blocks > 320
    with pytest.raises(ValueError, match="do not fit"):
        fill_graph_inputs(*step[:4], step[4][:, :3], _graph_buffers(8, 1, 320), 2, 1)
    with pytest.raises(ValueError, match="2 tokens"):
        fill_graph_inputs(*step[:4], step[4][:, :3], _graph_buffers(8, 2, 320), 4, 2)


def test_fill_pending_tokens_takes_the_in_flight_rows():
    input_ids = torch.arange(300, dtype=torch.int64, device=DEVICE)  # over one program's rows
    source_rows = torch.full((300,), -1, dtype=torch.int64)
    source_rows[[0, 7, 130, 299]] = torch.tensor([3, 0, 1, 2])
    token_ids = torch.tensor([1000, 1001, 1002, 1003], device=DEVICE)
    fill_pending_tokens(input_ids, source_rows.to(DEVICE), token_ids)
    expected = torch.arange(300)
    expected[[0, 7, 130, 299]] = torch.tensor([1003, 1000, 1001, 1002])
    assert torch.equal(input_ids.cpu(), expected)
    with pytest.raises(ValueError, match="source_rows"):
        fill_pending_tokens(input_ids, source_rows[:5].to(DEVICE), token_ids)
