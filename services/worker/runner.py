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
kvstore it is ``NoKvConnector``, which computes a plan's loads instead. Speculative
decoding enters the same way: the worker's proposer (``self.proposer``, draft_model.py:
``propose``, ``fill``, ``read_back``, ``settle``; ``NoDraftModel`` without a draft model)
and the acceptance rule (``self.verify``, speculation.py). LoRA adapters too (``self.lora``,
lora_slots.py: ``resolve`` a request's adapter at arrival, ``begin`` a step's segments and
slots before its forward, ``end`` them after; ``NoLora`` with LoRA off); on CUDA a step with
adapter rows replays the graphs captured with the deltas (cuda_graphs.py), the torch path's
steps (the CPU) run eagerly.

``build_runner`` (runner_build.py) assembles the runner's parts; a plan's entries are
checked and turned into chunks by step_chunks.py.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import NamedTuple

import torch

from kernels.paged_attention_ref import FP8_KV_DTYPE
from services.worker.cuda_graphs import DecodeGraphs, PiecewiseGraphs
from services.worker.draft_model import Proposal, WorkerProposer
from services.worker.arrival_refusals import ArrivalRefusals
from services.worker.image_inputs import ImageEncoder, NoImages
from services.worker.kv_connector import KvConnector, NoKvConnector
from services.worker.kv_offload import KvOffload
from services.worker.kv_step import LayerWaits
from services.worker.kv_quant import kv_scales_tag
from services.worker.lora_slots import LoraSlots, NoLora
from services.worker.model import AttentionMetadata, Transformer
from services.worker.moe import ExpertCountReports, take_expert_counts
from services.worker.sampler import Sampler, chunk_prompt_logprobs, make_generator
from services.worker.speculation import VerifyRule, keep_accepted, verify_drafts
from services.worker.staging import HostStaging
from services.worker.step_chunks import CacheShape, chunk_of
from services.worker.step_inputs import (
    LogitsLayout, SequenceChunk, build_step_inputs, fill_pending_inputs, logits_layout,
    select_rows,
)
from services.worker.step_state import RequestState, StepInFlight, plan_needs_host_tokens
from services.worker.tp_ranks import SingleRank
from shared.messages import NewRequestData, StepPlan, StepResult, TokenLogprobs
from shared.kv_messages import KvLayout
from shared.models import ModelFiles

class StepGraphs(NamedTuple):
    """The runner's CUDA graphs (cuda_graphs.py); None where none are captured."""

    decode: DecodeGraphs | None  # whole decode steps
    verify: DecodeGraphs | None  # whole verify steps (speculative decoding)
    mixed: PiecewiseGraphs | None  # steps in pieces


class ModelRunner:
    def __init__(self, *, ranks: SingleRank, model_files: ModelFiles, model: Transformer,
                 device: torch.device, dtype: torch.dtype, seed: int, block_size: int,
                 max_model_len: int, eos_token_ids: list[int], kv_cache: torch.Tensor,
                 kv_cache_bytes: int, staging: HostStaging | None, proposer: WorkerProposer,
                 sampler: Sampler, graphs: StepGraphs, overlap_steps: bool,
                 kv_load_groups: int, verify: VerifyRule = verify_drafts,
                 lora: LoraSlots | NoLora = NoLora(),
                 images: ImageEncoder | NoImages = NoImages()) -> None:
        """The parts ``build_runner`` (runner_build.py) assembles. ``ranks``: this runner's
        tensor-parallel group (tp_group.py); rank 0 sends each call to the others, which run
        it too. ``proposer``: what fills draft slots (draft_model.py); ``verify``: which
        drafts a step keeps (speculation.py; a benchmark may install another).
        ``overlap_steps``: leave steps in flight (``submit``): on CUDA, where it hides the
        host's work behind the GPU's; tests turn it on on CPU to check the path.
        ``kv_load_groups``: the layer groups loads from the kvstore copy in. ``lora``: the
        LoRA adapters' slots (lora_slots.py; ``NoLora``: off). ``images``: a vision-language
        model's encoder and its cache (image_inputs.py; ``NoImages``: a text-only model)."""
        self.ranks, self.model, self.seed = ranks, model, seed
        self.model_name: str = model_files.name
        self.model_path: Path = model_files.path
        self._device, self._dtype = device, dtype
        self.block_size, self.max_model_len = block_size, max_model_len
        self.eos_token_ids = eos_token_ids
        self.kv_cache, self.kv_cache_bytes = kv_cache, kv_cache_bytes
        self.num_blocks: int = kv_cache.shape[2]
        self._cache = CacheShape(self.num_blocks, block_size, max_model_len)  # (plan checks)
        self._staging, self.proposer, self.verify = staging, proposer, verify
        self.sampler, self.lora, self.images = sampler, lora, images
        self._graphs, self._verify_graphs, self._mixed_graphs = graphs
        self.overlap_steps, self.kv_load_groups = overlap_steps, kv_load_groups
        self.kv: NoKvConnector = NoKvConnector(block_size)  # the kvstore's hooks
        self._requests: dict[str, RequestState] = {}
        self._in_flight: StepInFlight | None = None
        self.num_overlapped_steps = 0  # steps queued while the one before was in flight
        self.expert_counts = ExpertCountReports(model)  # an MoE model's, for /metrics
        self.refusals = ArrivalRefusals()  # new requests refused one by one (bad adapters)

    def zero_step_counts(self) -> None:
        """The step counts start again (after the start-up warm-up: they are serving's)."""
        self.num_overlapped_steps = 0
        take_expert_counts(self.model)  # (the warm-up's routing is not serving's)
        if self._mixed_graphs is not None:
            self._mixed_graphs.num_steps = 0

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
        self.images.forget(request_id)

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
        plan = self.refusals.screen(plan, self.lora.resolve)  # (before any rank sees it)
        with self.ranks.watch():
            return self.refusals.attach(self.images.attach(self.expert_counts.attach(
                self._submit(self.ranks.lead_step(plan)))))

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
            return self.refusals.attach(self.images.attach(self.expert_counts.attach(
                self._flush())))

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
        chunks = [chunk_of(scheduled, self._requests.get(scheduled.request_id), self._cache,
                           self._in_flight, self.proposer) for scheduled in plan.scheduled]
        chunk_states = [self._requests[s.request_id] for s in plan.scheduled]
        self.lora.begin(chunk_states, chunks, self._requests.values())  # (before graph choices)
        kv_step = self.kv.before_forward(plan, chunks, self._requests, finished)
        sampled_ids = [s.request_id for s, chunk in zip(plan.scheduled, chunks) if chunk.sample]
        states = [self._requests[request_id] for request_id in sampled_ids]
        with torch.inference_mode():
            proposal = self.proposer.propose(chunks, chunk_states)  # draft_model.py
            layout = logits_layout(chunks) if chunks else None
            logits = self._run_model(chunks, layout, kv_step.layer_waits, proposal,
                                     [s.request_id for s in plan.scheduled]) if chunks else None
            self.lora.end()
            self.kv.after_forward(kv_step)
            self.proposer.read_back(proposal, chunks)  # (its drafts into their chunks)
            sampled = self._sample(plan, chunks, layout, logits, sampled_ids, states, defer)
        for state, chunk, scheduled in zip(chunk_states, chunks, plan.scheduled):
            state.block_table = chunk.block_table
            state.num_computed_tokens += scheduled.num_new_tokens
        accepted = keep_accepted(states, chunks, sampled.num_accepted)  # speculation.py
        num_catch_up_tokens = self.proposer.settle(proposal, chunk_states)
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
                          accepted_draft_ids=accepted,
                          num_draft_catch_up_tokens=num_catch_up_tokens)

    def _take_arrivals(self, plan: StepPlan) -> dict[str, RequestState]:
        """Forget the plan's finished requests and add its new ones -> the finished ones'
        states (their stores may still be in this plan)."""
        finished = {}
        for request_id in plan.finished_request_ids:
            if request_id in self._requests:
                finished[request_id] = self._requests[request_id]
            self._forget(request_id)
        self.lora.forget(plan.forgotten_loras)  # (no request left uses them)
        for new_request in plan.new_requests:
            self._add_request(new_request)
        if len({s.request_id for s in plan.scheduled}) != len(plan.scheduled):
            raise ValueError(f"step {plan.step_id} schedules a request twice")
        return finished

    def _run_model(self, chunks: list[SequenceChunk], layout: LogitsLayout,
                   layer_waits: LayerWaits, proposal: Proposal | None,
                   request_ids: list[str]) -> torch.Tensor:
        """The step's forward -> logits [num_logit_rows, vocab_size]; ``proposal``: the
        draft model's drafts, still on the device. A step reaching an image's placeholders
        runs eagerly, their embeddings replaced by the encoder's (image_inputs.py)."""
        input_ids, positions, metadata = build_step_inputs(
            chunks, self.block_size, self._device, layout, self._staging)
        pending = None if metadata.pending_source_rows is None else (
            metadata.pending_source_rows, self._in_flight.token_ids)  # tokens in flight
        pending = self.proposer.fill(input_ids, proposal, pending)
        image_rows = self.images.step_rows(chunks, request_ids, self._dtype)
        positions, cos_sin = self.images.step_positions(chunks, request_ids, positions,
                                                        self.model.cos_sin_cache)
        eager = image_rows is not None or cos_sin is not None
        if pending and (eager or self._no_whole_graph(chunks, layout)):
            fill_pending_inputs(input_ids, *pending)  # (else the graph's own launch does)
            pending = None
        if eager:
            return self.model(input_ids, positions, metadata, layer_waits,
                              image_rows=image_rows, cos_sin_cache=cos_sin)
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
        rows, num_accepted, known_tokens = self.verify(  # speculation.py
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
        lora = self.lora.active  # (the graphs with LoRA's deltas)
        if graphs is not None:
            assert layer_waits is None, "a whole-step graph cannot wait between its layers"
            return graphs.run(input_ids, positions, metadata, pending, lora=lora)
        assert pending is None, "pending tokens go in place before any other forward"
        if self._mixed_graphs is not None and self._mixed_graphs.takes(len(input_ids), lora):
            return self._mixed_graphs.run(input_ids, positions, metadata, layer_waits, lora=lora)
        return self.model(input_ids, positions, metadata, layer_waits)

    def _whole_graph(self, num_tokens: int, num_seqs: int, max_query_len: int,
                     num_logits: int) -> DecodeGraphs | None:
        """The graph that runs a whole step of this shape: a decode graph (one query a
        sequence) or a verify graph (a token and K drafts a sequence); None: none does (a
        step with LoRA rows: none captured with the deltas)."""
        return next((graphs for graphs in (self._graphs, self._verify_graphs) if graphs
                     is not None and graphs.runs(num_tokens, num_seqs, max_query_len,
                                                 num_logits, self.lora.active)), None)

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
        self._cache.check_block_ids(new.request_id, new.block_ids)
        num_prompt_tokens = new.num_prompt_tokens or len(new.token_ids)
        lora_name = self.lora.resolve(new.request_id, new.lora_name, new.lora_path,
                                      new.lora_hash)
        self._forget(new.request_id)
        self.images.add(new.request_id, new.images, new.token_ids)
        self.sampler.add(new.request_id, new.sampling, list(new.token_ids), num_prompt_tokens)
        self._requests[new.request_id] = RequestState(
            token_ids=list(new.token_ids), sampling=new.sampling, block_table=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            generator=make_generator(new.sampling, self._device),
            num_prompt_tokens=num_prompt_tokens, lora_name=lora_name,
            wants_prompt_logprobs=new.sampling.prompt_logprobs is not None
            and num_prompt_tokens == len(new.token_ids))


class _Sampled(NamedTuple):
    device_token_ids: torch.Tensor | None  # [num_sampled], deferred: left on the device
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: dict[str, list[TokenLogprobs]]
    num_accepted: list[int] | tuple = ()  # per sampled row: drafts kept ((): none sent)

