"""A step's inputs: its sequences' chunks flattened into input ids, positions and attention
metadata, and which rows of its logits belong to which chunk (prompt logprobs, sampling).
Host code: numpy, one or two host-to-device copies per step."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from kernels.step_inputs import fill_pending_tokens
from services.worker.model import AttentionMetadata
from services.worker.staging import HostStaging, aligned_starts, pack


@dataclass
class SequenceChunk:
    """One sequence's share of a step: tokens [start, start + len(token_ids)) of it."""

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool  # this chunk reaches the end of the known tokens: sample the next one
    # leading positions of the chunk whose logits are wanted too (prompt logprobs)
    num_logprob_rows: int = 0
    # the chunk's last token is the one the step in flight samples: token_ids holds a
    # placeholder there, filled on the device from that step's output row
    pending_row: int | None = None
    # speculative decoding: token_ids ends with this many drafts after the last known
    # token; each of those positions' logits verifies the token after it
    num_drafts: int = 0
    # the drafts are slots the worker's draft model fills (draft_model.py) before the forward
    draft_slots: bool = False


@dataclass(frozen=True)
class LogitsLayout:
    """Which rows of a step's logits belong to which chunk.

    A chunk contributes its first ``num_logprob_rows`` tokens, then its last token if it
    samples (unless already among them); a chunk with drafts, its last known token and
    every draft (the rows that verify them).
    """

    token_indices: list[int]  # per row: the step token it comes from
    sample_rows: list[int]  # per sampled chunk: its row (with drafts: the first verify row)
    first_rows: list[int]  # per chunk: its first row (its prompt-logprob rows start there)


def logits_layout(chunks: list[SequenceChunk]) -> LogitsLayout:
    token_indices: list[int] = []
    sample_rows: list[int] = []
    first_rows: list[int] = []
    first = 0
    for chunk in chunks:
        num_tokens = len(chunk.token_ids)
        first_rows.append(len(token_indices))
        token_indices.extend(range(first, first + chunk.num_logprob_rows))
        if chunk.num_drafts:  # (no prompt logprobs with drafts)
            sample_rows.append(len(token_indices))
            token_indices.extend(range(first + num_tokens - 1 - chunk.num_drafts,
                                       first + num_tokens))
        elif chunk.sample:
            if chunk.num_logprob_rows < num_tokens:
                token_indices.append(first + num_tokens - 1)
            sample_rows.append(len(token_indices) - 1)
        first += num_tokens
    return LogitsLayout(token_indices, sample_rows, first_rows)


def build_step_inputs(chunks: list[SequenceChunk], block_size: int, device: torch.device,
                      layout: LogitsLayout | None = None, staging: HostStaging | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Flatten a step's chunks into (input_ids [num_tokens], positions [num_tokens], metadata);
    ``layout`` is ``logits_layout(chunks)`` when the caller has it already.

    Vectorized with numpy: one pass over the chunks to gather their lists, no per-sequence
    tensor ops (at 256 sequences a step, per-sequence torch calls cost milliseconds)."""
    num_seqs = len(chunks)
    q_lens = np.fromiter((len(chunk.token_ids) for chunk in chunks), np.int64, num_seqs)
    starts = np.fromiter((chunk.start for chunk in chunks), np.int64, num_seqs)
    seq_lens = starts + q_lens  # [num_seqs]
    num_blocks_per_seq = -(-seq_lens // block_size)  # [num_seqs]
    max_blocks = int(num_blocks_per_seq.max())
    block_tables = np.zeros((num_seqs, max_blocks), np.int32)  # [num_seqs, max_blocks]
    used = np.arange(max_blocks) < num_blocks_per_seq[:, None]  # row-major, as the flat list
    block_tables[used] = [block_id for chunk, n in zip(chunks, num_blocks_per_seq.tolist())
                          for block_id in chunk.block_table[:n]]
    num_tokens = int(q_lens.sum())
    input_ids = np.fromiter(itertools.chain.from_iterable(chunk.token_ids for chunk in chunks),
                            np.int64, num_tokens)  # [num_tokens]
    ends = np.cumsum(q_lens)  # [num_seqs]: where each sequence's tokens end in the step
    seq_index = np.repeat(np.arange(num_seqs), q_lens)  # [num_tokens]
    positions = np.arange(num_tokens) + np.repeat(starts - (ends - q_lens), q_lens)  # [num_tokens]
    slot_mapping = (block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)  # [num_tokens]
    query_start_loc = np.zeros(num_seqs + 1, np.int32)
    query_start_loc[1:] = ends
    # [num_logit_rows]: the last token of each sampled chunk, and prompt-logprob positions
    layout = layout or logits_layout(chunks)
    longer = np.flatnonzero(q_lens > 1)
    # [num_tokens]: the row of the step in flight whose sampled token is this token, -1: none
    pending = [(end - 1, chunk.pending_row) for chunk, end in zip(chunks, ends.tolist())
               if chunk.pending_row is not None]
    source_rows = np.full(num_tokens if pending else 0, -1, np.int64)
    if pending:
        source_rows[[row for row, _ in pending]] = [source for _, source in pending]
    # Two host-to-device copies per step, one per dtype, from pinned memory: a copy from
    # pageable memory waits for every kernel queued before it, which would stall the host
    # behind the step in flight.
    longs = to_device([input_ids, positions, slot_mapping,
                        np.asarray(layout.token_indices, np.int64), source_rows], np.int64,
                       device, staging)
    ints = to_device([block_tables.ravel(), seq_lens.astype(np.int32), query_start_loc],
                      np.int32, device, staging)
    metadata = AttentionMetadata(
        slot_mapping=longs[2], block_tables=ints[0].view(num_seqs, max_blocks), seq_lens=ints[1],
        query_start_loc=ints[2], logits_indices=longs[3],
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
        num_decodes=int(longer[0]) if len(longer) else num_seqs,
        pending_source_rows=longs[4] if pending else None)
    return longs[0], longs[1], metadata


def to_device(arrays: list[np.ndarray], dtype: type, device: torch.device,
               staging: HostStaging | None = None) -> list[torch.Tensor]:
    """``arrays`` as views of one tensor on ``device``, copied in one go (to CUDA:
    asynchronously, through ``staging``'s pinned buffers, or a freshly pinned one)."""
    if staging is not None and device.type == "cuda":
        return staging.to_device(arrays, dtype)
    _, length = aligned_starts([len(a) for a in arrays], np.dtype(dtype).itemsize)
    host = np.empty(length, dtype)
    views = pack(arrays, host)
    flat = torch.from_numpy(host)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return [flat[start:start + size] for start, size in views]


def select_rows(values: torch.Tensor, rows: list[int], staging: HostStaging | None = None
                ) -> torch.Tensor:
    """``values[rows]`` for rows listed on the host, without waiting for the device: indexing
    a CUDA tensor with a list copies it from pageable memory, which waits for every kernel
    queued before (a step's whole forward, before the draw behind it is even queued); this
    index goes the way of the step's inputs."""
    if not values.is_cuda:
        return values[rows]
    index = to_device([np.asarray(rows, np.int64)], np.int64, values.device, staging)[0]
    return values.index_select(0, index)


def fill_pending_inputs(input_ids: torch.Tensor, source_rows: torch.Tensor,
                        in_flight_token_ids: torch.Tensor) -> None:
    """Put the tokens the step in flight samples (``in_flight_token_ids`` [num_sampled], on
    the device) into this step's ``input_ids`` [num_tokens] where ``source_rows``
    (``AttentionMetadata.pending_source_rows``) names their row, on the device (CUDA: one
    launch; a whole-step graph does it in ``DecodeGraphs.run``'s instead)."""
    if input_ids.is_cuda:
        fill_pending_tokens(input_ids, source_rows, in_flight_token_ids)
        return
    pending = source_rows >= 0
    input_ids[pending] = in_flight_token_ids[source_rows[pending]]
