"""The worker's compute core: model weights, the paged KV cache, and one step per StepPlan.

Synchronous and free of I/O so tests drive it step by step; ``service.py`` wraps it for the bus.
Per request the runner keeps its token list, sampling parameters, block table and
``num_computed_tokens``; a step computes tokens ``[num_computed, num_computed + num_new_tokens)`` of
each scheduled request and samples the ones that reach the end of their known tokens.

On CUDA a step's host work overlaps the GPU: ``submit`` queues a step's kernels and returns
without reading its sampled tokens; the next step takes those tokens straight from the device
(no sync before launching it), and only then is the earlier step read back. A step whose
sampling needs its requests' previous tokens on the host (logprobs, structured output,
penalties, prompt logprobs) waits for the step before it instead. ``execute`` is one step,
start to end.

With a kvstore attached (``attach_kv``), a plan's ``kv_loads`` are copied into their blocks
beside its forward (on CUDA, a load stream; a step touching blocks still loading, e.g. the
loading request's own first chunk, waits for them on the device; a step's result is read
back only once its loads are complete, since the scheduler then lets the requests that only
loaded in it compute; a load it cannot make, e.g. from a
restarted kvstore, is computed instead) and its ``kv_stores`` copied out around it
(``kv_offload.py``).
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from kernels.paged_attention import allocate_kv_cache
from kernels.sampling import draw_seed
from services.worker.config import WorkerConfig
from services.worker.cuda_copy import check_memcpy_2d
from services.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from services.worker.kv_offload import BlocksToStore, KvOffload, recompute_unusable_loads
from services.worker.kv_tiers import LoadTiming
from services.worker.memory import kv_bytes_per_block, profile_kv_cache_bytes
from services.worker.model import AttentionMetadata, load_model
from services.worker.sampler import Sampler, make_generator, token_logprobs
from services.worker.staging import HostStaging
from services.worker.warmup import warm_up_attention
from shared.config import parse_size
from shared.messages import (
    KvLayout, KvLoad, NewRequestData, SamplingParams, ScheduledRequest, StepPlan, StepResult,
    TokenLogprobs,
)
from shared.models import ModelFiles, read_eos_token_ids

log = structlog.get_logger()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class RequestState:
    token_ids: list[int]  # prompt, then every sampled token
    sampling: SamplingParams
    block_table: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None
    num_prompt_tokens: int
    # prompt logprobs still to compute: the request asked and had no outputs when it arrived
    wants_prompt_logprobs: bool = False
    # tokens sampled by the step in flight, not read back yet (they follow token_ids)
    num_pending_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        """Known tokens and the one being sampled by the step in flight."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_outputs(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    def seed_next_draw(self) -> None:
        """A seeded draw depends only on (seed, output index), so a request preempted and
        recomputed draws exactly what it would have drawn, whatever the batch."""
        if self.generator is not None:
            self.generator.manual_seed(draw_seed(self.sampling.seed, self.num_outputs))


def needs_host_tokens(sampling: SamplingParams) -> bool:
    """Sampling this request reads its earlier tokens on the host, or reports host values."""
    return sampling.logprobs is not None or sampling.prompt_logprobs is not None \
        or sampling.structured is not None or sampling.has_penalties


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


@dataclass(frozen=True)
class LogitsLayout:
    """Which rows of a step's logits belong to which chunk.

    A chunk contributes its first ``num_logprob_rows`` tokens, then its last token if it
    samples (unless already among them).
    """

    token_indices: list[int]  # per row: the step token it comes from
    sample_rows: list[int]  # per sampled chunk: its row
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
        if chunk.sample:
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
    # Two host-to-device copies per step, one per dtype, from pinned memory: a copy from
    # pageable memory waits for every kernel queued before it, which would stall the host
    # behind the step in flight.
    longs = _to_device([input_ids, positions, slot_mapping,
                        np.asarray(layout.token_indices, np.int64)], np.int64, device, staging)
    ints = _to_device([block_tables.ravel(), seq_lens.astype(np.int32), query_start_loc],
                      np.int32, device, staging)
    metadata = AttentionMetadata(
        slot_mapping=longs[2], block_tables=ints[0].view(num_seqs, max_blocks), seq_lens=ints[1],
        query_start_loc=ints[2], logits_indices=longs[3],
        max_query_len=int(q_lens.max()), max_seq_len=int(seq_lens.max()),
        num_decodes=int(longer[0]) if len(longer) else num_seqs)
    return longs[0], longs[1], metadata


def _to_device(arrays: list[np.ndarray], dtype: type, device: torch.device,
               staging: HostStaging | None = None) -> list[torch.Tensor]:
    """``arrays`` as views of one tensor on ``device``, copied in one go (to CUDA:
    asynchronously, through ``staging``'s pinned buffers, or a freshly pinned one)."""
    if staging is not None and device.type == "cuda":
        return staging.to_device(arrays, dtype)
    flat = torch.from_numpy(np.concatenate([a.astype(dtype, copy=False) for a in arrays]))
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(flat.split([len(a) for a in arrays]))


@dataclass
class StepInFlight:
    """A step whose kernels are queued and whose sampled tokens are still on the device."""

    plan: StepPlan
    start_time: float
    request_ids: list[str]  # per sampled row
    states: list[RequestState]  # per sampled row: the state the token belongs to
    token_ids: torch.Tensor  # [num_sampled] int64, on the device
    host_token_ids: torch.Tensor  # [num_sampled] int64 on the host (CUDA: pinned, async copy)
    copied: torch.cuda.Event | None  # CUDA: the copy to host_token_ids is done
    rows: dict[str, int]  # request id -> its row
    kv_load: LoadTiming | None = None  # the plan's loads from the kvstore

    @classmethod
    def start(cls, plan: StepPlan, start_time: float, request_ids: list[str],
              states: list[RequestState], token_ids: torch.Tensor | None,
              device: torch.device) -> StepInFlight:
        if token_ids is None:  # nothing scheduled: an empty step
            token_ids = torch.empty(0, dtype=torch.int64, device=device)
        host_token_ids, copied = token_ids, None
        if device.type == "cuda":
            host_token_ids = torch.empty(token_ids.shape, dtype=torch.int64, pin_memory=True)
            host_token_ids.copy_(token_ids, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return cls(plan, start_time, request_ids, states, token_ids, host_token_ids, copied,
                   {request_id: row for row, request_id in enumerate(request_ids)})

    def done(self) -> bool:
        """Its tokens are on the host and its loads complete (the scheduler takes the result
        to mean the loaded blocks are ready)."""
        return (self.copied is None or self.copied.query()) and \
            (self.kv_load is None or self.kv_load.end is None or self.kv_load.end.query())

    def wait(self) -> None:
        if self.copied is not None:
            self.copied.synchronize()
        if self.kv_load is not None and self.kv_load.end is not None:
            self.kv_load.end.synchronize()

    def row_of(self, request_id: str, state: RequestState) -> int | None:
        """The row holding ``state``'s pending token (None: this step samples none for it)."""
        row = self.rows.get(request_id)
        return row if row is not None and self.states[row] is state else None


class ModelRunner:
    def __init__(self, config: WorkerConfig, model_files: ModelFiles):
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        if config.block_size < 1:
            raise ValueError(f"block_size must be positive, got {config.block_size}")
        self._device = _resolve_device(config.device)
        self._dtype = _resolve_dtype(config.dtype, self._device)
        self.model_name: str = model_files.name
        self.model_path: Path = model_files.path
        self.seed: int = config.seed
        self.model = load_model(model_files.path, self._device, self._dtype, seed=config.seed)
        model_config = self.model.config
        self.block_size: int = config.block_size
        self.max_model_len: int = model_config.usable_context_len(config.max_model_len)
        self.eos_token_ids: list[int] = read_eos_token_ids(model_files.path)
        bytes_per_block = kv_bytes_per_block(self.model, config.block_size, self._dtype)
        self.num_blocks: int = self._kv_cache_budget(config) // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no block "
                             f"({bytes_per_block} bytes each)")
        self.kv_cache_bytes: int = self.num_blocks * bytes_per_block
        # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
        self.kv_cache = allocate_kv_cache(model_config.num_layers, self.num_blocks, self.block_size,
                                          model_config.num_kv_heads, model_config.head_dim,
                                          self._dtype, self._device)
        self.model.bind_kv_cache(self.kv_cache)
        self._requests: dict[str, RequestState] = {}
        self._in_flight: StepInFlight | None = None
        # Leave steps in flight (submit): on CUDA, where it hides the host's work behind the
        # GPU's; on CPU nothing runs asynchronously, but tests turn it on to check the path.
        self.overlap_steps: bool = config.overlap_steps == "on" or (
            config.overlap_steps == "auto" and self._device.type == "cuda")
        self.num_overlapped_steps = 0  # steps queued while the one before was in flight
        self.kv_offload: KvOffload | None = None  # the kvstore's host tier, once attached
        self._staging = HostStaging(self._device) if self._device.type == "cuda" else None
        self.sampler = Sampler(model_config.vocab_size, self.eos_token_ids, self._device,
                               make_grammars=lambda: _grammar_bank(
                                   model_files.path, model_config.vocab_size, self.eos_token_ids))
        self._graphs: DecodeGraphs | None = None
        self._mixed_graphs: PiecewiseGraphs | None = None
        if self._device.type == "cuda":
            warm_up_attention(self.model, self.block_size)
            if config.kv_load_layer_groups > 1:  # fail now, not at the first load
                check_memcpy_2d(self._device)
        if self._device.type == "cuda" and not config.enforce_eager:
            self._graphs = DecodeGraphs(self.model, config.max_num_seqs,
                                        -(-self.max_model_len // self.block_size),
                                        self.max_model_len, self._device)
            self._graphs.capture()
            max_graph_tokens = mixed_graph_tokens(config)
            if max_graph_tokens:
                self._mixed_graphs = PiecewiseGraphs(self.model, max_graph_tokens, self._device)
                self._mixed_graphs.capture()
        log.info("model_runner_ready", model=self.model_name, device=self.device, dtype=self.dtype,
                 num_blocks=self.num_blocks, block_size=self.block_size,
                 kv_cache_bytes=self.kv_cache_bytes, max_model_len=self.max_model_len)

    def _kv_cache_budget(self, config: WorkerConfig) -> int:
        if config.kv_cache_memory != "auto":
            return parse_size(config.kv_cache_memory)
        if self._device.type != "cuda":
            return 1 << 30
        return profile_kv_cache_bytes(
            self.model, num_tokens=config.max_num_batched_tokens, num_sampled=config.max_num_seqs,
            max_model_len=self.max_model_len, block_size=config.block_size,
            gpu_memory_utilization=config.gpu_memory_utilization, device=self._device,
            dtype=self._dtype,
            graph_batch_size=None if config.enforce_eager else config.max_num_seqs,
            graph_num_tokens=0 if config.enforce_eager else mixed_graph_tokens(config)
        ).kv_cache_bytes

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def dtype(self) -> str:
        return str(self._dtype).removeprefix("torch.")

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def kv_layout(self, weights_version: str) -> KvLayout:
        """What this worker's KV blocks are, for the kvstore."""
        config = self.model.config
        return KvLayout(weights_version=weights_version, dtype=self.dtype,
                        num_layers=config.num_layers, block_size=self.block_size,
                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)

    def attach_kv(self, offload: KvOffload | None) -> None:
        """Use ``offload`` from the next step on (None: no kvstore); between steps only. The
        one before finishes its copies and is unmapped; its commits are dropped."""
        old, self.kv_offload = self.kv_offload, offload
        if old is not None and old is not offload:
            old.close()

    def reset(self) -> None:
        """Forget every request and the step in flight (a scheduler attached or a step
        failed); the cache memory stays."""
        self._in_flight = None
        for request_id in list(self._requests):
            self._forget(request_id)

    def _forget(self, request_id: str) -> None:
        if self._requests.pop(request_id, None) is not None:
            self.sampler.remove(request_id)

    @property
    def has_in_flight(self) -> bool:
        """A step's kernels are queued and its sampled tokens not read back yet."""
        return self._in_flight is not None

    def in_flight_done(self) -> bool:
        """The step in flight has finished on the device (reading it back will not wait)."""
        return self._in_flight is None or self._in_flight.done()

    def execute(self, plan: StepPlan) -> StepResult:
        """One step, start to end (nothing may be in flight)."""
        if self._in_flight is not None:
            raise RuntimeError("execute() with a step in flight: use submit() and flush()")
        results = self.submit(plan) + self.flush()
        return results[-1]

    def submit(self, plan: StepPlan) -> list[StepResult]:
        """Start ``plan``; return the results of the steps that completed meanwhile, in step
        order: the step in flight before it, and ``plan`` itself unless it is left in flight
        (CUDA, and its sampling needs no host tokens) for ``flush`` or the next ``submit``."""
        results: list[StepResult] = []
        overlap = self.overlap_steps and not self._needs_host_tokens(plan)
        if self._in_flight is not None and not overlap:
            results += self.flush()  # its tokens must be on the host before this step samples
        if self._in_flight is not None:
            self.num_overlapped_steps += 1
        step = self._launch(plan, defer=overlap)
        results += self.flush()  # the step before: read back while this one runs
        if isinstance(step, StepResult):
            results.append(step)
        else:
            self._in_flight = step
        if self.kv_offload is not None:
            self.kv_offload.end_submit()  # every token its stores hold is on the host now
        return results

    def flush(self) -> list[StepResult]:
        """Read back the step in flight, if any (waits for the device)."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        step.wait()
        token_ids = step.host_token_ids.tolist()
        for request_id, state, token_id in zip(step.request_ids, step.states, token_ids):
            if self._requests.get(request_id) is state:  # not forgotten or re-sent since
                state.token_ids.append(token_id)
                state.num_pending_tokens -= 1
        kv_load = step.kv_load
        return [StepResult(step_id=step.plan.step_id, request_ids=step.request_ids,
                           sampled_token_ids=token_ids,
                           step_time_s=time.perf_counter() - step.start_time,
                           kv_load_bytes=kv_load.num_bytes if kv_load else 0,
                           kv_load_bytes_per_s=kv_load.bytes_per_s() if kv_load else 0.0)]

    def _needs_host_tokens(self, plan: StepPlan) -> bool:
        if any(needs_host_tokens(new.sampling) for new in plan.new_requests):
            return True
        for scheduled in plan.scheduled:
            state = self._requests.get(scheduled.request_id)
            if state is not None and needs_host_tokens(state.sampling):
                return True
        return False

    def _launch(self, plan: StepPlan, defer: bool) -> StepResult | StepInFlight:
        """Queue the step's kernels; with ``defer``, leave its sampled tokens on the device."""
        start_time = time.perf_counter()
        kv = self.kv_offload
        plan, num_recomputed = recompute_unusable_loads(plan, kv, self.block_size)
        if num_recomputed and kv is not None:
            kv.num_recomputed += num_recomputed
        finished = {}  # their stores may still be in this plan
        for request_id in plan.finished_request_ids:
            if request_id in self._requests:
                finished[request_id] = self._requests[request_id]
            self._forget(request_id)
        for new_request in plan.new_requests:
            self._add_request(new_request)
        if len({s.request_id for s in plan.scheduled}) != len(plan.scheduled):
            raise ValueError(f"step {plan.step_id} schedules a request twice")
        chunks = [self._chunk(scheduled) for scheduled in plan.scheduled]
        kv_load, late_stores, layer_waits = None, [], None
        if kv is not None:
            kv_load, late_stores, layer_waits = self._kv_before_forward(kv, plan, chunks,
                                                                        finished)
        sampled_ids = [s.request_id for s, chunk in zip(plan.scheduled, chunks) if chunk.sample]
        states = [self._requests[request_id] for request_id in sampled_ids]
        sampled_token_ids: list[int] = []
        sampled_logprobs: list[TokenLogprobs | None] = []
        prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
        device_token_ids: torch.Tensor | None = None
        if chunks:
            with torch.inference_mode():
                layout = logits_layout(chunks)
                input_ids, positions, metadata = build_step_inputs(
                    chunks, self.block_size, self._device, layout, self._staging)
                self._fill_pending_inputs(chunks, input_ids)
                logits = self._forward(input_ids, positions, metadata,
                                       all_sample=len(sampled_ids) == len(chunks),
                                       layer_waits=layer_waits)
                if late_stores:  # the blocks this step completes, copied out behind it
                    kv.store(late_stores)
                sample_rows = layout.sample_rows
                prompt_logprobs = self._prompt_logprobs(plan.scheduled, chunks, layout.first_rows,
                                                        logits)
                if len(sample_rows) != logits.shape[0]:
                    logits = logits[sample_rows]  # [num_sampled, vocab_size]
                for state in states:
                    state.seed_next_draw()
                params = [s.sampling for s in states]
                output_indices = [s.num_outputs for s in states]
                if defer:
                    device_token_ids = self.sampler.sample_on_device(  # [num_sampled]
                        logits, sampled_ids, params, output_indices,
                        [s.generator for s in states])
                else:
                    sampled_token_ids, sampled_logprobs = self.sampler.sample(
                        logits, sampled_ids, params, output_indices,
                        [s.generator for s in states])
        for scheduled, chunk in zip(plan.scheduled, chunks):
            state = self._requests[scheduled.request_id]
            state.block_table = chunk.block_table
            state.num_computed_tokens += scheduled.num_new_tokens
        if late_stores and not chunks:  # nothing ran: nothing to wait for
            kv.store(late_stores)
        if defer:
            for state in states:
                state.num_pending_tokens += 1
            step = StepInFlight.start(plan, start_time, sampled_ids, states, device_token_ids,
                                      self._device)
            step.kv_load = kv_load
            return step
        for state, token_id in zip(states, sampled_token_ids):
            state.token_ids.append(token_id)
        if kv_load is not None and kv_load.end is not None:
            kv_load.end.synchronize()  # the result says its loads are complete
        return StepResult(step_id=plan.step_id, request_ids=sampled_ids,
                          sampled_token_ids=sampled_token_ids,
                          step_time_s=time.perf_counter() - start_time,
                          logprobs=sampled_logprobs if any(sampled_logprobs) else [],
                          prompt_logprobs=prompt_logprobs,
                          kv_load_bytes=kv_load.num_bytes if kv_load else 0,
                          kv_load_bytes_per_s=kv_load.bytes_per_s() if kv_load else 0.0)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata, all_sample: bool,
                 layer_waits: list[list[torch.cuda.Event]] | None = None) -> torch.Tensor:
        """-> logits [num_logit_rows, vocab_size]: a decode graph when every sequence has one
        query and samples, piecewise graphs for other steps that fit them, else eagerly.
        ``layer_waits``: per layer, the load events its attention waits for (never with a
        decode graph, which cannot wait between layers)."""
        if self._takes_decode_graph(len(input_ids), metadata.max_query_len, all_sample):
            assert layer_waits is None, "a decode graph cannot wait between its layers"
            return self._graphs.run(input_ids, positions, metadata)
        if self._mixed_graphs is not None \
                and self._mixed_graphs.bucket_for(len(input_ids)) is not None:
            return self._mixed_graphs.run(input_ids, positions, metadata, layer_waits)
        return self.model(input_ids, positions, metadata, layer_waits)

    def _takes_decode_graph(self, num_tokens: int, max_query_len: int, all_sample: bool) -> bool:
        return self._graphs is not None and max_query_len == 1 and all_sample \
            and self._graphs.bucket_for(num_tokens) is not None

    def _kv_before_forward(self, kv: KvOffload, plan: StepPlan, chunks: list[SequenceChunk],
                           finished: dict[str, RequestState]
                           ) -> tuple[LoadTiming | None, list[BlocksToStore],
                                      list[list[torch.cuda.Event]] | None]:
        """Load the plan's blocks, copy out its stores of blocks complete already (before
        this step may write their ids again), and order the forward after the copies still
        reading blocks it writes and the loads still writing blocks it touches. Returns the
        loads' timing, the stores of blocks this step completes (copied out after its
        forward), and per layer the load events its attention waits for (loads in layer
        groups, when the forward can wait between layers; None: none)."""
        kv_load, read, by_layer = None, [], False
        if plan.kv_loads or kv.tiers.pending_loads:  # (steps without loads skip this)
            # per chunk, the blocks it reads (its context, its new tokens' blocks included)
            read = [chunk.block_table[:(chunk.start + len(chunk.token_ids) - 1)
                                      // self.block_size + 1] for chunk in chunks]
            by_layer = bool(chunks) and not self._takes_decode_graph(
                sum(len(chunk.token_ids) for chunk in chunks),
                max(len(chunk.token_ids) for chunk in chunks),
                all(chunk.sample for chunk in chunks))
        if plan.kv_loads:
            # Layer groups pay only when this step's forward reads the blocks (it then runs
            # its first layers under the copy of the later ones); a load read by a later step
            # goes in one group: G times fewer copies to issue (random slots: one per block).
            loaded = {block_id for load in plan.kv_loads for block_id in load.block_ids}
            read_now = by_layer and any(not loaded.isdisjoint(ids) for ids in read)
            kv_load = kv.load(plan.kv_loads, in_layer_groups=read_now)
            self._forget_decode_contexts(plan.kv_loads)
        stores: list[BlocksToStore] = []
        if plan.kv_stores:
            scheduled = {s.request_id: (s, chunk) for s, chunk in zip(plan.scheduled, chunks)}

            def lookup(request_id: str):
                state = self._requests.get(request_id) or finished.get(request_id)
                if state is None:
                    return None
                entry = scheduled.get(request_id) if self._requests.get(request_id) is state \
                    else None
                if entry is None:
                    return (state.token_ids, state.block_table, state.num_computed_tokens,
                            state.num_computed_tokens)
                return (state.token_ids, entry[1].block_table, state.num_computed_tokens,
                        state.num_computed_tokens + entry[0].num_new_tokens)

            stores = kv.resolve_stores(plan.kv_stores, lookup)
            kv.store([run for run in stores if run.computed_before])
        written = None
        if kv.tiers.has_pending or kv.tiers.pending_loads:
            written = [block_id for chunk in chunks for block_id in chunk.block_table[
                chunk.start // self.block_size:
                (chunk.start + len(chunk.token_ids) - 1) // self.block_size + 1]]
        if kv.tiers.has_pending:
            kv.tiers.wait_for_stores(written)
        layer_waits = None
        if kv.tiers.pending_loads:  # blocks still loading that this step reads or writes
            layer_waits = kv.tiers.wait_for_loads(
                (block_id for ids in read for block_id in ids), written, by_layer=by_layer)
        return kv_load, [run for run in stores if not run.computed_before], layer_waits

    def _forget_decode_contexts(self, loads: list[KvLoad]) -> None:
        """CPU: blocks written from outside the model must be gathered again by the decode
        contexts that may hold their old contents (a block freed and loaded into)."""
        if self._device.type == "cuda":
            return
        block_ids = [block_id for load in loads for block_id in load.block_ids]
        for layer in self.model.layers:
            context = layer.self_attn.decode_context
            if context is not None:
                context.forget_blocks(block_ids)

    def _fill_pending_inputs(self, chunks: list[SequenceChunk], input_ids: torch.Tensor) -> None:
        """Put the tokens the step in flight samples into this step's inputs, on the device."""
        positions, rows = [], []
        end = 0
        for chunk in chunks:
            end += len(chunk.token_ids)
            if chunk.pending_row is not None:
                positions.append(end - 1)
                rows.append(chunk.pending_row)
        if not positions:
            return
        assert self._in_flight is not None and self._in_flight.token_ids is not None
        index = _to_device([np.asarray(positions, np.int64), np.asarray(rows, np.int64)],
                           np.int64, self._device, self._staging)
        input_ids.index_copy_(0, index[0], self._in_flight.token_ids[index[1]])

    def _prompt_logprobs(self, scheduled: list[ScheduledRequest], chunks: list[SequenceChunk],
                         first_rows: list[int], logits: torch.Tensor
                         ) -> dict[str, list[TokenLogprobs]]:
        """Logprobs of the prompt tokens whose predicting positions ran this step, per request
        (the logits at position p give token p + 1)."""
        result: dict[str, list[TokenLogprobs]] = {}
        for entry, chunk, row in zip(scheduled, chunks, first_rows):
            if chunk.num_logprob_rows:
                state = self._requests[entry.request_id]
                rows = logits[row:row + chunk.num_logprob_rows].float().log_softmax(-1)
                next_ids = state.token_ids[chunk.start + 1:chunk.start + 1 + chunk.num_logprob_rows]
                result[entry.request_id] = token_logprobs(
                    rows, next_ids, [state.sampling.prompt_logprobs] * len(next_ids))
        return result

    def _add_request(self, new: NewRequestData) -> None:
        if not 0 <= new.num_computed_tokens <= len(new.token_ids):
            raise ValueError(f"request {new.request_id}: num_computed_tokens "
                             f"{new.num_computed_tokens} outside [0, {len(new.token_ids)}]")
        self._check_block_ids(new.request_id, new.block_ids)
        num_prompt_tokens = new.num_prompt_tokens or len(new.token_ids)
        self._forget(new.request_id)
        self.sampler.add(new.request_id, new.sampling, list(new.token_ids), num_prompt_tokens)
        self._requests[new.request_id] = RequestState(
            token_ids=list(new.token_ids), sampling=new.sampling, block_table=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=make_generator(new.sampling, self._device),
            num_prompt_tokens=num_prompt_tokens,
            wants_prompt_logprobs=new.sampling.prompt_logprobs is not None
            and num_prompt_tokens == len(new.token_ids))

    def _chunk(self, scheduled: ScheduledRequest) -> SequenceChunk:
        """Validate one scheduled entry and describe its work; no state changes yet."""
        request_id, num_new_tokens = scheduled.request_id, scheduled.num_new_tokens
        state = self._requests.get(request_id)
        if state is None:
            raise ValueError(f"unknown request id {request_id!r}")
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_new_tokens
        if num_new_tokens < 1 or end > state.num_tokens:
            raise ValueError(f"request {request_id}: {num_new_tokens} new tokens after {start} "
                             f"computed, but it has {state.num_tokens} tokens")
        if end > self.max_model_len:
            raise ValueError(f"request {request_id}: {end} tokens exceed max_model_len "
                             f"{self.max_model_len}")
        self._check_block_ids(request_id, scheduled.new_block_ids)
        block_table = state.block_table + list(scheduled.new_block_ids)
        if len(block_table) * self.block_size < end:
            raise ValueError(f"request {request_id}: too few blocks, {len(block_table)} of "
                             f"{self.block_size} tokens for {end} tokens")
        # positions start.. predicting prompt tokens (the last prompt position predicts an output)
        num_logprob_rows = max(0, min(end, state.num_prompt_tokens - 1) - start) \
            if state.wants_prompt_logprobs else 0
        token_ids = state.token_ids[start:end]
        pending_row = None
        if end > len(state.token_ids):  # its last token is being sampled by the step in flight
            in_flight = self._in_flight
            if in_flight is None or end - len(state.token_ids) != 1 \
                    or in_flight.row_of(request_id, state) is None:
                raise ValueError(f"request {request_id}: token {end - 1} is not known yet")
            pending_row = in_flight.row_of(request_id, state)
            token_ids.append(0)  # placeholder: _fill_pending_inputs writes it on the device
        return SequenceChunk(token_ids=token_ids, start=start, block_table=block_table,
                             sample=end == state.num_tokens, num_logprob_rows=num_logprob_rows,
                             pending_row=pending_row)

    def _check_block_ids(self, request_id: str, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"request {request_id}: block ids {bad} outside [0, {self.num_blocks})")


def mixed_graph_tokens(config: WorkerConfig) -> int:
    """The largest step the piecewise graphs take: no larger than a step can be."""
    return min(config.max_graph_tokens, config.max_num_batched_tokens)


def _grammar_bank(model_dir: Path, vocab_size: int, eos_token_ids: list[int]):
    from services.worker.structured import GrammarBank  # loads the grammar library on first use

    return GrammarBank(model_dir, vocab_size, eos_token_ids)


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"unknown dtype {name!r} (auto, {', '.join(_DTYPES)})")
    return _DTYPES[name]
