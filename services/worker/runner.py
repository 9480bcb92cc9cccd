"""The worker's compute core: model weights, the paged KV cache, and one step per StepPlan.

Synchronous and free of I/O so tests drive it step by step; ``service.py`` wraps it for the bus.
Per request the runner keeps its token list, sampling parameters, block table and
``num_computed_tokens``; a step computes tokens ``[num_computed, num_computed + num_new_tokens)`` of
each scheduled request and samples the ones that reach the end of their known tokens.

On CUDA a step's host work overlaps the GPU: ``submit`` queues a step's kernels and returns
without reading its sampled tokens; the next step takes those tokens straight from the device
(no sync before launching it), and only then is the earlier step read back. A step that needs
earlier tokens on the host (logprobs, grammar, penalties, prompt logprobs) or verifies drafts
(speculation.py) waits for the step before it. ``execute`` is one step, start to end.

The kvstore enters through one hook per phase of a step (``self.kv``, kv_connector.py):
``prepare`` the plan, ``before_forward``, ``after_forward``, ``end_submit``; without a
kvstore it is ``NoKvConnector``, which computes a plan's loads instead.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import structlog
import torch

from kernels.paged_attention_ref import FP8_KV_DTYPE, allocate_kv_cache
from services.worker.config import WorkerConfig
from services.worker.cuda_graphs import DecodeGraphs, capture_step_graphs, mixed_graph_tokens
from services.worker import draft_model, ops
from services.worker.draft_model import DraftModel, NoDraftModel, Proposal, load_draft_model
from services.worker.kv_connector import KvConnector, NoKvConnector, usable_load_groups
from services.worker.kv_offload import KvOffload
from services.worker.kv_step import LayerWaits
from services.worker.kv_quant import kv_scales_tag, resolve_kv_cache_dtype, set_fp8_kv_scales
from services.worker.memory import kv_bytes_per_block, profile_kv_cache_bytes
from services.worker.model import AttentionMetadata
from services.worker.weights import check_quantization, load_model, resolve_device, resolve_dtype
from services.worker.sampler import Sampler, chunk_prompt_logprobs, make_generator
from services.worker.speculation import keep_accepted, verify_drafts
from services.worker.staging import HostStaging
from services.worker.step_inputs import (
    LogitsLayout, SequenceChunk, build_step_inputs, fill_pending_inputs, logits_layout,
    select_rows,
)
from services.worker.step_state import RequestState, StepInFlight, plan_needs_host_tokens
from services.worker.tp_ranks import SingleRank
from services.worker.warmup import warm_up_attention, warm_up_steps
from shared.config import parse_size
from shared.messages import NewRequestData, ScheduledRequest, StepPlan, StepResult, TokenLogprobs
from shared.kv_messages import KvLayout
from shared.models import ModelFiles, read_eos_token_ids

log = structlog.get_logger()

class ModelRunner:
    def __init__(self, config: WorkerConfig, model_files: ModelFiles,
                 ranks: SingleRank = SingleRank()):
        """``ranks``: this runner's tensor-parallel group (tp_group.py); rank 0 sends each
        call to the others, which run it too."""
        self.ranks = ranks
        if config.num_threads > 0:
            torch.set_num_threads(config.num_threads)
        if config.block_size < 1:
            raise ValueError(f"block_size must be positive, got {config.block_size}")
        self._device = resolve_device(config.device)
        self._dtype = resolve_dtype(config.dtype, self._device)
        if config.batch_invariant and self._device.type != "cuda":
            raise ValueError("batch_invariant needs a CUDA device (the CPU's GEMMs are torch's)")
        ops.batch_invariant = config.batch_invariant  # the process's kernels (ops.py)
        self.model_name: str = model_files.name
        self.model_path: Path = model_files.path
        self.seed: int = config.seed
        self.model = load_model(model_files.path, self._device, self._dtype, seed=config.seed,
                                quantization=check_quantization(model_files.path,
                                                                config.quantization, self._device),
                                tp=ranks.tp)
        model_config = self.model.config
        self.block_size: int = config.block_size
        self.max_model_len: int = model_config.usable_context_len(config.max_model_len)
        self.eos_token_ids: list[int] = read_eos_token_ids(model_files.path)
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self._dtype, self._device)
        if kv_dtype == FP8_KV_DTYPE:  # before the profile and graphs: they use the scales
            set_fp8_kv_scales(self.model, config.block_size, self._device, self._dtype)
        # speculative decoding's draft model (draft_model.py): loaded before the profile,
        # its cache (in --dtype) takes a share of each block's bytes
        self._draft = load_draft_model(config, self.model.config, self.max_model_len,
                                       self._device, self._dtype) if config.draft_model else None
        bytes_per_block = kv_bytes_per_block(self.model, config.block_size, kv_dtype) + (
            kv_bytes_per_block(self._draft, config.block_size, self._dtype) if self._draft else 0)
        # every rank the same block space: the fewest any rank's memory holds
        self.num_blocks: int = ranks.tp.agree_min(self._kv_cache_budget(config, kv_dtype)
                                                      // bytes_per_block)
        if self.num_blocks < 1:
            raise ValueError(f"kv_cache_memory {config.kv_cache_memory} holds no block "
                             f"({bytes_per_block} bytes each)")
        self.kv_cache_bytes: int = self.num_blocks * bytes_per_block
        self.kv_cache = self._allocate_cache(self.model, kv_dtype)
        self.model.bind_kv_cache(self.kv_cache)
        self._staging = HostStaging(self._device) if self._device.type == "cuda" else None
        self.drafts: NoDraftModel = NoDraftModel() if self._draft is None else DraftModel(
            self._draft, config.draft_model, self._allocate_cache(self._draft, self._dtype),
            self.block_size, config.max_num_batched_tokens, self._staging)
        self._requests: dict[str, RequestState] = {}
        self._in_flight: StepInFlight | None = None
        # Leave steps in flight (submit): on CUDA, where it hides the host's work behind the
        # GPU's; on CPU nothing runs asynchronously, but tests turn it on to check the path.
        self.overlap_steps: bool = config.overlap_steps == "on" or (
            config.overlap_steps == "auto" and self._device.type == "cuda")
        self.num_overlapped_steps = 0  # steps queued while the one before was in flight
        # the layer groups loads from the kvstore copy in (kv_load_groups.py)
        self.kv_load_groups = usable_load_groups(config, model_config.num_layers, self._device)
        self.kv: NoKvConnector = NoKvConnector(self.block_size)  # the kvstore's hooks
        self.sampler = Sampler(model_config.vocab_size, self.eos_token_ids, self._device,
                               make_grammars=lambda: _grammar_bank(
                                   model_files.path, model_config.vocab_size, self.eos_token_ids))
        if self._device.type == "cuda":
            warm_up_attention(self.model, self.block_size)
            if self._draft is not None:
                warm_up_attention(self._draft, self.block_size)
        # whole decode steps, verify steps (speculative decoding), steps in pieces
        self._graphs, self._verify_graphs, self._mixed_graphs = capture_step_graphs(
            self.model, config, self.max_model_len, self._device) \
            if self._device.type == "cuda" and not config.enforce_eager else (None, None, None)
        if isinstance(self.drafts, DraftModel) and self._graphs is not None:
            self.drafts.capture_graphs(config.max_num_seqs, self.max_model_len)
        if self._device.type == "cuda" and ranks.tp.size == 1:
            warm_up_steps(self)  # (a group's ranks take steps only once all are up)
            self.num_overlapped_steps = 0  # the counts are serving's
            if self._mixed_graphs is not None:
                self._mixed_graphs.num_steps = 0
        log.info("model_runner_ready", model=self.model_name, device=self.device, dtype=self.dtype,
                 num_blocks=self.num_blocks, block_size=self.block_size,
                 kv_cache_bytes=self.kv_cache_bytes, max_model_len=self.max_model_len,
                 kv_cache_dtype=self.kv_cache_dtype_name, draft_model=config.draft_model or None)

    def _allocate_cache(self, model, dtype: torch.dtype) -> torch.Tensor:
        """[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]"""
        config = model.config
        return allocate_kv_cache(config.num_layers, self.num_blocks, self.block_size,
                                 config.num_kv_heads, config.head_dim, dtype, self._device)

    def _kv_cache_budget(self, config: WorkerConfig, kv_dtype: torch.dtype) -> int:
        if config.kv_cache_memory != "auto":
            return parse_size(config.kv_cache_memory)
        if self._device.type != "cuda":
            return 1 << 30
        return profile_kv_cache_bytes(
            self.model, num_tokens=config.max_num_batched_tokens, num_sampled=config.max_num_seqs,
            max_model_len=self.max_model_len, block_size=config.block_size,
            gpu_memory_utilization=config.gpu_memory_utilization, device=self._device,
            dtype=self._dtype, kv_dtype=kv_dtype,
            graph_batch_size=None if config.enforce_eager else config.max_num_seqs,
            graph_num_tokens=0 if config.enforce_eager else mixed_graph_tokens(config),
            draft=self._draft, num_speculative_tokens=config.num_speculative_tokens
        ).kv_cache_bytes

    @property
    def device(self) -> str:
        return str(self._device)

    @property
    def dtype(self) -> str:
        return str(self._dtype).removeprefix("torch.")

    @property
    def kv_cache_dtype_name(self) -> str:
        return str(self.kv_cache.dtype).removeprefix("torch.")

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def kv_layout(self, weights_version: str) -> KvLayout:
        """What this worker's KV blocks are, for the kvstore."""
        config = self.model.config
        fp8 = self.kv_cache.dtype == FP8_KV_DTYPE
        return KvLayout(weights_version=weights_version, dtype=self.kv_cache_dtype_name,
                        num_layers=config.num_layers, block_size=self.block_size,
                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
                        kv_scales=kv_scales_tag(self.model) if fp8 else "")

    def attach_kv(self, offload: KvOffload | None) -> None:
        """Use ``offload`` from the next step on (None: no kvstore); between steps only. The
        one before finishes its copies and is unmapped; its commits are dropped."""
        old = self.kv
        self.kv = NoKvConnector(self.block_size) if offload is None else KvConnector(
            offload, self.block_size, self._no_whole_graph, self._forget_loaded_blocks)
        if old.offload is not offload:
            old.close()

    def reset(self) -> None:
        """Forget every request and the step in flight (a scheduler attached or a step
        failed); the cache memory stays."""
        with self.ranks.watch():  # (a rank that stopped reading fills its pipe)
            self.ranks.lead_reset()
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
        with self.ranks.watch():
            return self._submit(self.ranks.lead_step(plan))

    def _submit(self, plan: StepPlan) -> list[StepResult]:
        results: list[StepResult] = []
        overlap = self.overlap_steps and not plan_needs_host_tokens(plan, self._requests)
        if self._in_flight is not None and not overlap:
            results += self._flush()  # its tokens must be on the host before this step samples
        if self._in_flight is not None:
            self.num_overlapped_steps += 1
        step = self._launch(plan, defer=overlap)
        results += self._flush()  # the step before: read back while this one runs
        if isinstance(step, StepResult):
            results.append(step)
        else:
            self._in_flight = step
        self.kv.end_submit()
        return results

    def flush(self) -> list[StepResult]:
        """Read back the step in flight, if any (waits for the device)."""
        if self._in_flight is None:
            return []
        with self.ranks.watch():
            self.ranks.lead_flush()
            return self._flush()

    def _flush(self) -> list[StepResult]:
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        step.wait()
        token_ids = step.host_token_ids.tolist()
        for request_id, state, token_id in zip(step.request_ids, step.states, token_ids):
            if self._requests.get(request_id) is state:  # not forgotten or re-sent since
                state.token_ids.append(token_id)
                state.num_pending_tokens -= 1
        return [step.result(token_ids)]

    def _launch(self, plan: StepPlan, defer: bool) -> StepResult | StepInFlight:
        """Queue the step's kernels; with ``defer``, leave its sampled tokens on the device."""
        start_time = time.perf_counter()
        if self._staging is not None:  # its input copies may hide behind the step in flight
            self._staging.behind_step = self._in_flight is not None
        plan = self.kv.prepare(plan)
        finished = self._take_arrivals(plan)
        chunks = [self._chunk(scheduled) for scheduled in plan.scheduled]
        kv_step = self.kv.before_forward(plan, chunks, self._requests, finished)
        sampled_ids = [s.request_id for s, chunk in zip(plan.scheduled, chunks) if chunk.sample]
        states = [self._requests[request_id] for request_id in sampled_ids]
        chunk_states = [self._requests[s.request_id] for s in plan.scheduled]
        with torch.inference_mode():
            proposal = self.drafts.propose(chunks, chunk_states)  # draft_model.py
            layout = logits_layout(chunks) if chunks else None
            logits = self._run_model(chunks, layout, kv_step.layer_waits,
                                     proposal) if chunks else None
            self.kv.after_forward(kv_step)
            proposed = draft_model.read_back(proposal, chunks) if proposal else {}
            sampled = self._sample(plan, chunks, layout, logits, sampled_ids, states, defer)
        for state, chunk, scheduled in zip(chunk_states, chunks, plan.scheduled):
            state.block_table = chunk.block_table
            state.num_computed_tokens += scheduled.num_new_tokens
        keep_accepted(states, chunks, sampled.num_accepted)  # speculation.py
        if proposal:
            draft_model.settle(proposal, chunk_states)
        if defer:
            for state in states:
                state.num_pending_tokens += 1
            return StepInFlight.start(plan, start_time, sampled_ids, states,
                                      sampled.device_token_ids, self._device, kv_step,
                                      self._staging and self._staging.read_back)
        for state, token_id in zip(states, sampled.token_ids):
            state.token_ids.append(token_id)
        kv_step.wait_for_loads()  # the result says its loads are complete
        return StepResult(step_id=plan.step_id, request_ids=sampled_ids,
                          sampled_token_ids=sampled.token_ids,
                          step_time_s=time.perf_counter() - start_time,
                          logprobs=sampled.logprobs if any(sampled.logprobs) else [],
                          prompt_logprobs=sampled.prompt_logprobs,
                          kv_load_bytes=kv_step.load_bytes,
                          kv_load_bytes_per_s=kv_step.load_bytes_per_s(),
                          num_accepted_drafts=list(sampled.num_accepted),
                          **draft_model.result_fields(proposal, proposed, chunks))

    def _take_arrivals(self, plan: StepPlan) -> dict[str, RequestState]:
        """Forget the plan's finished requests and add its new ones -> the finished ones'
        states (their stores may still be in this plan)."""
        finished = {}
        for request_id in plan.finished_request_ids:
            if request_id in self._requests:
                finished[request_id] = self._requests[request_id]
            self._forget(request_id)
        for new_request in plan.new_requests:
            self._add_request(new_request)
        if len({s.request_id for s in plan.scheduled}) != len(plan.scheduled):
            raise ValueError(f"step {plan.step_id} schedules a request twice")
        return finished

    def _run_model(self, chunks: list[SequenceChunk], layout: LogitsLayout,
                   layer_waits: LayerWaits, proposal: Proposal | None) -> torch.Tensor:
        """The step's forward -> logits [num_logit_rows, vocab_size]; ``proposal``: the
        draft model's drafts, still on the device."""
        input_ids, positions, metadata = build_step_inputs(
            chunks, self.block_size, self._device, layout, self._staging)
        pending = None if metadata.pending_source_rows is None else (
            metadata.pending_source_rows, self._in_flight.token_ids)  # tokens in flight
        if pending and (proposal is not None or self._no_whole_graph(chunks, layout)):
            fill_pending_inputs(input_ids, *pending)  # (else the graph's own launch does)
            pending = None
        if proposal is not None:
            draft_model.fill_drafts(input_ids, proposal)
        return self._forward(input_ids, positions, metadata, layer_waits, pending)

    def _sample(self, plan: StepPlan, chunks: list[SequenceChunk], layout: LogitsLayout | None,
                logits: torch.Tensor | None, sampled_ids: list[str], states: list[RequestState],
                defer: bool) -> _Sampled:
        """Prompt logprobs and the draw of the step's sampled rows; with ``defer`` the
        tokens stay on the device."""
        if logits is None:  # nothing scheduled
            return _Sampled(None, [], [], {})
        prompt_logprobs = chunk_prompt_logprobs(
            [(s.request_id, self._requests[s.request_id]) for s in plan.scheduled], chunks,
            layout.first_rows, logits)
        params = [s.sampling for s in states]
        rows, num_accepted, known_tokens = verify_drafts(  # speculation.py
            logits, layout, chunks, params, [s.num_outputs for s in states],
            lambda rows_, owners, indices: self.sampler.adjusted(
                rows_, [sampled_ids[i] for i in owners], [params[i] for i in owners], indices),
            self._staging)
        # a request's next draw is its output number num_outputs + the drafts it keeps
        output_indices = [s.num_outputs + (num_accepted[i] if num_accepted else 0)
                          for i, s in enumerate(states)]
        for state, output_index in zip(states, output_indices):
            state.seed_next_draw(output_index)
        # verification gave every token (a deferred step, even one sampling none, needs them
        # on the device)
        if len(known_tokens) == len(states) and not defer:
            return _Sampled(None, [known_tokens[i] for i in range(len(states))],
                            [None] * len(states), prompt_logprobs, num_accepted)
        if len(rows) != logits.shape[0]:
            logits = select_rows(logits, rows, self._staging)  # [num_sampled, vocab_size]
        generators = [s.generator for s in states]
        if defer:
            return _Sampled(self.sampler.sample_on_device(  # [num_sampled]
                logits, sampled_ids, params, output_indices, generators), [], [], prompt_logprobs)
        token_ids, logprobs = self.sampler.sample(logits, sampled_ids, params, output_indices,
                                                  generators)
        for index, token_id in known_tokens.items():  # (a rejected draft's replacement)
            token_ids[index] = token_id
        return _Sampled(None, token_ids, logprobs, prompt_logprobs, num_accepted)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 metadata: AttentionMetadata,
                 layer_waits: list[list[torch.cuda.Event]] | None = None,
                 pending: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """-> logits [num_logit_rows, vocab_size]: a whole-step graph where one fits
        (``_whole_graph``), piecewise graphs for other steps that fit them, else eagerly.
        ``layer_waits``: per layer, the load events its attention waits for (never with a
        whole-step graph, which cannot wait between layers). ``pending``: (source rows, tokens
        in flight) for a whole-step graph to put in place."""
        graphs = self._whole_graph(len(input_ids), len(metadata.seq_lens),
                                   metadata.max_query_len, len(metadata.logits_indices))
        if graphs is not None:
            assert layer_waits is None, "a whole-step graph cannot wait between its layers"
            return graphs.run(input_ids, positions, metadata, pending)
        assert pending is None, "pending tokens go in place before any other forward"
        if self._mixed_graphs is not None \
                and self._mixed_graphs.bucket_for(len(input_ids)) is not None:
            return self._mixed_graphs.run(input_ids, positions, metadata, layer_waits)
        return self.model(input_ids, positions, metadata, layer_waits)

    def _whole_graph(self, num_tokens: int, num_seqs: int, max_query_len: int,
                     num_logits: int) -> DecodeGraphs | None:
        """The graph that runs a whole step of this shape: a decode graph (one query a
        sequence) or a verify graph (a token and K drafts a sequence); None: none does."""
        return next((graphs for graphs in (self._graphs, self._verify_graphs) if graphs
                     is not None and graphs.runs(num_tokens, num_seqs, max_query_len,
                                                 num_logits)), None)

    def _no_whole_graph(self, chunks: list[SequenceChunk], layout: LogitsLayout | None = None
                        ) -> bool:
        """No whole-step graph runs these chunks (``layout``: theirs, when built already):
        their forward can wait between its layers, and tokens in flight go in place first."""
        return self._whole_graph(sum(len(chunk.token_ids) for chunk in chunks), len(chunks),
                                 max(len(chunk.token_ids) for chunk in chunks),
                                 len((layout or logits_layout(chunks)).token_indices)) is None

    def _forget_loaded_blocks(self, block_ids: list[int]) -> None:
        """CPU: blocks written from outside the model must be gathered again by the decode
        contexts that may hold their old contents (a block freed and loaded into)."""
        if self._device.type == "cuda":
            return
        for layer in self.model.layers:
            context = layer.self_attn.decode_context
            if context is not None:
                context.forget_blocks(block_ids)

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
        drafts = list(scheduled.draft_token_ids) or [0] * scheduled.num_draft_slots
        if scheduled.num_draft_slots and (scheduled.draft_token_ids or not self.drafts.enabled):
            raise ValueError(f"request {request_id}: draft slots need a worker with a draft "
                             f"model (this one has no draft model, or drafts came too)")
        start, end = state.num_computed_tokens, state.num_computed_tokens + num_new_tokens
        known_end = end - len(drafts)  # drafts follow the last known token
        if num_new_tokens <= len(drafts) or known_end > state.num_tokens \
                or (drafts and known_end != len(state.token_ids)):
            raise ValueError(f"request {request_id}: {num_new_tokens} new tokens after {start} "
                             f"computed ({len(drafts)} drafts); it has {state.num_tokens} tokens")
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
        token_ids = state.token_ids[start:known_end]
        pending_row = None
        if known_end > len(state.token_ids):  # its last token: sampled by the step in flight
            in_flight = self._in_flight
            if in_flight is None or known_end - len(state.token_ids) != 1 \
                    or in_flight.row_of(request_id, state) is None:
                raise ValueError(f"request {request_id}: token {end - 1} is not known yet")
            pending_row = in_flight.row_of(request_id, state)
            token_ids.append(0)  # placeholder: filled on the device (fill_pending_inputs)
        return SequenceChunk(token_ids=token_ids + list(drafts), start=start,
                             block_table=block_table, sample=known_end == state.num_tokens,
                             num_logprob_rows=num_logprob_rows, pending_row=pending_row,
                             num_drafts=len(drafts), draft_slots=bool(scheduled.num_draft_slots),
                             num_forced_accept=scheduled.num_forced_accept if drafts else -1)

    def _check_block_ids(self, request_id: str, block_ids: list[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"request {request_id}: block ids {bad} outside [0, {self.num_blocks})")


class _Sampled(NamedTuple):
    device_token_ids: torch.Tensor | None  # [num_sampled], deferred: left on the device
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, list[TokenLogprobs]]
    num_accepted: list[int] | tuple = ()  # per sampled row: drafts kept ((): none sent)


def _grammar_bank(model_dir: Path, vocab_size: int, eos_token_ids: list[int]):
    from services.worker.structured import GrammarBank  # loads the grammar library on first use

    return GrammarBank(model_dir, vocab_size, eos_token_ids)
