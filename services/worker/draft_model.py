"""Speculative decoding's draft model (issue 28, method ``draft_model``): a smaller model with
the served model's tokenizer proposes the drafts of the requests a step gives draft slots
(``ScheduledRequest.num_drafts`` with no tokens), right before the step's forward verifies
them. It is the worker's proposer (``WorkerProposer``); ``NoDraftModel`` the null one.

KV. The draft model has its own paged cache, indexed by the served model's block ids, so a
request's block table and slot mapping serve both. Each request's state counts the
positions whose draft KV is written (``RequestState.num_draft_computed``); a step's first
draft pass computes what the request lacks: the whole prompt at its first draft, a kept
draft the draft model never saw. Requests that are never drafted, prefix-cache hits and
kvstore loads cost it nothing until they are drafted. Stale draft KV can only make drafts
worse, never the output: the served model verifies every draft.

Per step, over the requests with draft slots (ordered by slot count, most first, so each
later pass runs a prefix of the rows):

1. one forward over each request's tokens from its first uncomputed one to its last known
   one; the argmax at the last is draft 1. (A catch-up larger than the step's token budget
   first runs in budget-sized forwards.)
2. passes 2..K: one token a request still wanting drafts, the previous pass's argmax as its
   input (a decode step: a CUDA graph on the GPU). Every pass's positions are known on the
   host beforehand, so all of them go to the device in one copy and no pass waits for the
   host.
3. the drafts are scattered into the step's input ids on the device (``fill``), and read
   back (``read_back``) once the served model's forward is queued, for verification.

The draft model drafts greedily (its argmax): a proposal with certainty, which the
verification (speculation.py), greedy or by rejection sampling, takes as it takes n-gram
drafts.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np
import torch

from services.worker import ops
from services.worker.config import WorkerConfig
from services.worker.cuda_graphs import DecodeGraphs
from services.worker.model import AttentionMetadata, ModelConfig, Transformer
from services.worker.staging import HostStaging, to_host
from services.worker.step_inputs import (
    SequenceChunk, build_step_inputs, fill_pending_inputs, to_device,
)
from services.worker.step_state import RequestState
from services.worker.warmup import warm_up_attention
from services.worker.weights import check_quantization, load_model
from shared.messages import ScheduledRequest
from shared.models import resolve_model

# (source rows, the step in flight's tokens): a step's inputs still to be put in place
Pending = tuple[torch.Tensor, torch.Tensor]

MAX_GRAPH_BATCH = 64  # draft passes of more rows run eagerly (drafts are for small batches)


def load_draft_model(config: WorkerConfig, target: ModelConfig, max_model_len: int,
                     device: torch.device, dtype: torch.dtype) -> Transformer:
    """``config.draft_model``, with the served model's (``target``) vocabulary and at least
    ``max_model_len`` of context; in --quantization where the checkpoint allows. Whole on every
    tensor-parallel rank: each rank drafts the same tokens itself, with no collective."""
    files = resolve_model(config.draft_model, config.cache_dir)
    draft = load_model(files.path, device, dtype, seed=config.seed,
                       quantization=check_quantization(files.path, config.quantization, device),
                       batch_invariant=config.batch_invariant)
    if draft.config.vocab_size != target.vocab_size:
        raise ValueError(f"draft model {config.draft_model}: a vocabulary of "
                         f"{draft.config.vocab_size} tokens, the served model's has "
                         f"{target.vocab_size}")
    if draft.config.usable_context_len(max_model_len) < max_model_len:
        raise ValueError(f"draft model {config.draft_model}: a context shorter than "
                         f"max_model_len {max_model_len}")
    return draft


class Proposal(NamedTuple):
    """A step's drafts, on the device until read back."""

    drafts: torch.Tensor  # [num_rows, max_slots] int64: row r's drafts in its first slots
    chunk_indices: list[int]  # per row: the step chunk it drafts for
    num_slots: list[int]  # per row
    gather: torch.Tensor  # [num_slots total] int64: indices into drafts.view(-1)
    target_positions: torch.Tensor  # [num_slots total] int64: where they go in the step's input
    # tokens the first pass computed besides each row's last known one: a row drafted in the
    # step before has 0 or 1; a row new to drafts (or back after a pause) its whole context
    num_catch_up_tokens: int
    host_drafts: torch.Tensor  # drafts on its way to the host (CUDA: pinned, once ``copied``)
    copied: torch.cuda.Event | None  # CUDA: the copy to host_drafts is done


class WorkerProposer(Protocol):
    """The worker's side of the speculation seam, chosen once when the runner is built: what
    fills the draft slots a plan gives (``ScheduledRequest.num_drafts`` without tokens).
    ``NoDraftModel`` (none: drafts come with their tokens) or ``DraftModel``. The runner calls
    each step's hooks in order: ``propose`` before the forward, ``fill`` while building its
    inputs, ``read_back`` after queuing it, ``settle`` once the kept drafts are known."""

    def check(self, request_id: str, scheduled: ScheduledRequest) -> None: ...
    def warm_up(self, block_size: int) -> None: ...
    def capture_graphs(self, max_batch_size: int, max_model_len: int) -> None: ...
    def propose(self, chunks: list[SequenceChunk], states: list[RequestState]
                ) -> Proposal | None: ...
    def fill(self, input_ids: torch.Tensor, proposal: Proposal | None,
             pending: Pending | None) -> Pending | None: ...
    def read_back(self, proposal: Proposal | None, chunks: list[SequenceChunk]) -> None: ...
    def settle(self, proposal: Proposal | None, states: list[RequestState]) -> int: ...


class NoDraftModel:
    """No draft model: a plan's drafts come with their tokens (the scheduler proposed them);
    draft slots are refused. Every step hook does nothing."""

    name = ""

    def check(self, request_id: str, scheduled: ScheduledRequest) -> None:
        if scheduled.num_drafts and not scheduled.draft_token_ids:
            raise ValueError(f"request {request_id}: {scheduled.num_drafts} draft slots need "
                             f"a worker with a draft model (this one has no draft model)")

    def warm_up(self, block_size: int) -> None:
        pass

    def capture_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        pass

    def propose(self, chunks: list[SequenceChunk], states: list[RequestState]
                ) -> Proposal | None:
        return None

    def fill(self, input_ids: torch.Tensor, proposal: Proposal | None,
             pending: Pending | None) -> Pending | None:
        return pending

    def read_back(self, proposal: Proposal | None, chunks: list[SequenceChunk]) -> None:
        pass

    def settle(self, proposal: Proposal | None, states: list[RequestState]) -> int:
        return 0


class DraftModel:
    """The draft model: it fills every draft slot of a step (a plan's drafts never come with
    tokens), greedily, right before the step's forward. ``token_shift``: the draft KV at
    position i is computed from token i + token_shift (an EAGLE head's is 1: the token after
    the target's hidden state there, eagle_proposer.py)."""

    token_shift = 0

    def __init__(self, model: Transformer, name: str, kv_cache: torch.Tensor, block_size: int,
                 max_num_tokens: int, staging: HostStaging | None) -> None:
        """``kv_cache``: the draft model's [num_layers, 2, num_blocks, block_size, heads, dim]
        cache, the served model's number of blocks; ``max_num_tokens``: the most tokens one
        catch-up forward computes."""
        self.model, self.name = model, name
        self.block_size, self.max_num_tokens = block_size, max_num_tokens
        self.staging = staging
        self.device = kv_cache.device
        model.bind_kv_cache(kv_cache)
        self.graphs: DecodeGraphs | None = None

    def check(self, request_id: str, scheduled: ScheduledRequest) -> None:
        if scheduled.draft_token_ids:
            raise ValueError(f"request {request_id}: drafts came with their tokens, but this "
                             f"worker's draft model fills draft slots")

    def warm_up(self, block_size: int) -> None:
        """CUDA: compile the draft model's attention variants (warmup.py)."""
        warm_up_attention(self.model, block_size)

    def capture_graphs(self, max_batch_size: int, max_model_len: int) -> None:
        self.graphs = DecodeGraphs(self.model, min(max_batch_size, MAX_GRAPH_BATCH),
                                   -(-max_model_len // self.block_size), max_model_len,
                                   self.device)
        self.graphs.capture()

    def propose(self, chunks: list[SequenceChunk], states: list[RequestState]
                ) -> Proposal | None:
        """Queue the draft passes for the chunks with draft slots (``states``: per chunk)."""
        rows = sorted((i for i, chunk in enumerate(chunks) if chunk.draft_slots),
                      key=lambda i: -chunks[i].num_drafts)
        if not rows:
            return None
        num_slots = [chunks[i].num_drafts for i in rows]
        known = [(chunks[i], states[i], chunks[i].start + len(chunks[i].token_ids)
                  - chunks[i].num_drafts) for i in rows]  # (chunk, state, known tokens)
        drafts = torch.zeros(len(rows), num_slots[0], dtype=torch.int64, device=self.device)
        first_drafts, num_catch_up = self._first_pass(known)
        drafts[:, 0] = first_drafts
        for index, (input_ids, positions, metadata) in enumerate(
                self._decode_passes(known, num_slots)):
            count = len(input_ids)
            input_ids.copy_(drafts[:count, index])
            drafts[:count, index + 1] = self._draft_ids(
                self._forward(input_ids, positions, metadata))
        for (_, state, num_known), slots in zip(known, num_slots):
            state.num_draft_computed = self._computed_after(num_known, slots)
        gather, target_positions = self._scatter_indices(chunks, rows, num_slots)
        # read back beside the served model's forward, which is queued next: the host then
        # verifies and queues the draw while that forward runs
        host_drafts, copied = to_host(drafts, self.staging and self.staging.read_back)
        return Proposal(drafts, rows, num_slots, gather, target_positions, num_catch_up,
                        host_drafts, copied)

    def _first_pass(self, known: list[tuple[SequenceChunk, RequestState, int]]
                    ) -> tuple[torch.Tensor, int]:
        """Each row's uncomputed tokens up to its last known one -> draft 1 [num_rows], and
        how many tokens it computed besides the rows' last ones."""
        shift = self.token_shift
        spans = [(min(state.num_draft_computed, num_known - 1 - shift), num_known - shift,
                  chunk, state) for chunk, state, num_known in known]
        num_catch_up = sum(end - start - 1 for start, end, _, _ in spans)
        if num_catch_up + len(spans) > self.max_num_tokens:
            self._catch_up([(start, end - 1, chunk, state) for start, end, chunk, state in spans])
            spans = [(end - 1, end, chunk, state) for _, end, chunk, state in spans]
        pass_chunks = [SequenceChunk(token_ids=state.token_ids[start + shift:end + shift],
                                     start=start, block_table=chunk.block_table, sample=True)
                       for start, end, chunk, state in spans]
        input_ids, positions, metadata = build_step_inputs(
            pass_chunks, self.block_size, self.device, staging=self.staging)
        return self._draft_ids(self._first_forward(input_ids, positions, metadata)), num_catch_up

    def _first_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       metadata: AttentionMetadata) -> torch.Tensor:
        return self._forward(input_ids, positions, metadata)

    def _draft_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafts of a pass's logits [num_rows] (token ids of the served model)."""
        return ops.greedy_token_ids(logits)

    def _computed_after(self, num_known: int, num_slots: int) -> int:
        """A drafted row's positions with draft KV once its passes are queued."""
        return num_known + num_slots - 1

    def _catch_up(self, spans: list[tuple[int, int, SequenceChunk, RequestState]]) -> None:
        """Compute the draft KV of [start, end) of every span, in forwards of at most
        ``max_num_tokens`` tokens (a span may be split between two)."""
        pieces: list[SequenceChunk] = []
        room = self.max_num_tokens
        for start, end, chunk, state in spans:
            while start < end:
                count = min(end - start, room)
                first = start + self.token_shift
                pieces.append(SequenceChunk(token_ids=state.token_ids[first:first + count],
                                            start=start, block_table=chunk.block_table,
                                            sample=True))
                start, room = start + count, room - count
                if room == 0:
                    self._run_pieces(pieces)
                    pieces, room = [], self.max_num_tokens
        if pieces:
            self._run_pieces(pieces)

    def _run_pieces(self, pieces: list[SequenceChunk]) -> None:
        input_ids, positions, metadata = build_step_inputs(
            pieces, self.block_size, self.device, staging=self.staging)
        self.model(input_ids, positions, metadata)  # (the logits of each piece's end: unused)

    def _decode_passes(self, known: list[tuple[SequenceChunk, RequestState, int]],
                       num_slots: list[int]
                       ) -> list[tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]:
        """Inputs of passes 2..K: pass p computes draft p - 1 of the rows with at least p
        slots, at position num_known - 2 + p, into draft p. One copy to the device for all
        of them; the input ids are left for the pass before to fill."""
        counts = [sum(slots >= p for slots in num_slots) for p in range(2, num_slots[0] + 1)]
        if not counts:
            return []
        num_known = np.array([n - self.token_shift for _, _, n in known], np.int64)  # [num_rows]
        needed = -(-(num_known + np.array(num_slots) - 1) // self.block_size)  # [num_rows]
        tables = np.zeros((len(known), int(needed.max())), np.int64)  # [num_rows, max_blocks]
        for row, (chunk, _, _) in enumerate(known):
            tables[row, :needed[row]] = chunk.block_table[:needed[row]]
        positions = np.concatenate([num_known[:count] - 2 + p
                                    for p, count in zip(range(2, num_slots[0] + 1), counts)])
        rows = np.concatenate([np.arange(count) for count in counts])  # [num pass rows]
        slots = tables[rows, positions // self.block_size] * self.block_size \
            + positions % self.block_size
        longs = to_device([positions, slots, np.zeros(len(positions), np.int64),
                           np.arange(counts[0], dtype=np.int64)], np.int64, self.device,
                          self.staging)
        ints = to_device([tables.ravel(), (positions + 1).astype(np.int32),
                          np.arange(counts[0] + 1, dtype=np.int32)], np.int32, self.device,
                         self.staging)
        block_tables = ints[0].view(len(known), tables.shape[1])
        passes, offset = [], 0
        for count in counts:
            end = offset + count
            metadata = AttentionMetadata(
                slot_mapping=longs[1][offset:end], block_tables=block_tables[:count],
                seq_lens=ints[1][offset:end], query_start_loc=ints[2][:count + 1],
                logits_indices=longs[3][:count], max_query_len=1,
                max_seq_len=int(positions[offset:end].max()) + 1, num_decodes=count)
            # (input ids: zeros, each filled by the pass before)
            passes.append((longs[2][offset:end], longs[0][offset:end], metadata))
            offset = end
        return passes

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata) -> torch.Tensor:
        """-> logits [num_sampled, vocab_size]; a decode graph when one fits."""
        if self.graphs is not None and metadata.max_query_len == 1 \
                and self.graphs.bucket_for(len(input_ids)) is not None:
            return self.graphs.run(input_ids, positions, metadata)
        return self.model(input_ids, positions, metadata)

    def _scatter_indices(self, chunks: list[SequenceChunk], rows: list[int],
                         num_slots: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Where each draft is in ``drafts.view(-1)``, and where it goes in the step's flat
        input ids (a chunk's drafts are its last tokens)."""
        ends = np.cumsum([len(chunk.token_ids) for chunk in chunks])  # [num_chunks]
        width = num_slots[0]
        gather = np.concatenate([row * width + np.arange(slots)
                                 for row, slots in enumerate(num_slots)])
        targets = np.concatenate([ends[index] - slots + np.arange(slots)
                                  for index, slots in zip(rows, num_slots)])
        on_device = to_device([gather, targets], np.int64, self.device, self.staging)
        return on_device[0], on_device[1]

    def fill(self, input_ids: torch.Tensor, proposal: Proposal | None,
             pending: Pending | None) -> Pending | None:
        """Put the proposal's drafts into the step's ``input_ids`` [num_tokens], on the
        device; the tokens in flight (``pending``) go in place first -> None: nothing left
        pending (a step without drafts: ``pending`` as it was)."""
        if proposal is None:
            return pending
        if pending is not None:
            fill_pending_inputs(input_ids, *pending)
        input_ids.index_copy_(0, proposal.target_positions,
                              proposal.drafts.view(-1)[proposal.gather])
        return None

    def read_back(self, proposal: Proposal | None, chunks: list[SequenceChunk]) -> None:
        """Wait for the drafts (not for the forward queued after them) and write them into
        their chunks' token ids, for verification."""
        if proposal is None:
            return
        if proposal.copied is not None:
            proposal.copied.synchronize()
        host = proposal.host_drafts.tolist()  # [num_rows][max_slots]
        for row, (index, slots) in enumerate(zip(proposal.chunk_indices, proposal.num_slots)):
            chunk = chunks[index]
            chunk.token_ids[len(chunk.token_ids) - slots:] = host[row][:slots]

    def settle(self, proposal: Proposal | None, states: list[RequestState]) -> int:
        """After the step kept what it kept (``states``: per chunk, their token ids updated):
        draft KV past a drafted request's known tokens is of rejected drafts. -> the step's
        catch-up tokens (``Proposal.num_catch_up_tokens``), for its result."""
        if proposal is None:
            return 0
        for index in proposal.chunk_indices:
            state = states[index]
            state.num_draft_computed = min(state.num_draft_computed, len(state.token_ids))
        return proposal.num_catch_up_tokens
