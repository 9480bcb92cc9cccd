"""Continuous batching over a paged KV cache: pure, synchronous policy code.

There is no prefill or decode mode: each request has ``num_computed_tokens`` and a
token count, and every step catches requests up under one token budget: running
requests first (decodes, then the rest of chunked prompts), then waiting requests in
(priority, arrival) order. Full blocks are offered to the prefix cache under a chained
hash (shared/prefix_hash.py), so a new request starts after its longest cached prefix.
Blocks are allocated as tokens need them, and admission keeps room for the running
requests' growth (admission.py); when they run out anyway, the lowest-priority, latest
running request is preempted (blocks freed, recomputed later, mostly from the
prefix cache), so nothing is lost and nothing is sent twice. A request for n sequences
runs as n sibling requests that compute the prompt once (siblings.py).

The kvstore enters through the connector's hooks (``self.kv``, kv_tier.py: one per phase;
the default does nothing). With one (docs/kvstore.md), a request may come with a pinned
tier hit: admission loads the part beyond its GPU prefix into fresh blocks (beside the
compute of the other requests in that step, if any: the request then computes from the
next step planned, which the worker orders after the copy), and every block computed
here is stored to the kvstore once (write-through).

Steps overlap (the worker feeds sampled tokens into the next step: pending until a result
brings them); a result may end new requests the worker refused at arrival (outputs.py).
"""

from __future__ import annotations

import bisect
import itertools
import time
from collections import ChainMap
from dataclasses import dataclass

from services.scheduler.admission import AdmissionReserve, KeptRoom
from services.scheduler.block_manager import BlockManager, num_blocks_for
from services.scheduler.chunk_pacer import ChunkPacer, StepClock, decode_stall_target_ms
from services.scheduler.config import SchedulerConfig, SchedulingPolicy
from services.scheduler.intake import Arrival, Arrivals, prefix_query, queue_entries
from services.scheduler.kv_tier import (
    KvTierHooks, cache_loaded_blocks, drop_stale_tier_hits, store_target,
)
from services.scheduler.lora_registry import LoraRegistry
from services.scheduler.outputs import (add_prompt_logprobs, append_outputs, refused_outputs,
                                        request_output)
from services.scheduler.speculation import NO_DRAFTS, DraftBooks, Drafts, drafter, settle_drafts
from shared.prefix_hash import extend_block_hashes
from services.scheduler.request import Request, TierHit, new_request_data
from services.scheduler.validation import validate_request
from shared.messages import (
    ErrorInfo, GenerateRequest, NewRequestData, RequestOutput, ScheduledRequest, StepPlan,
    StepResult,
)


@dataclass(frozen=True)
class Emitted:
    """A RequestOutput and the subject of the gateway waiting for it."""

    output_subject: str
    output: RequestOutput


class Scheduler:
    def __init__(self, config: SchedulerConfig, *, num_blocks: int, block_size: int,
                 max_model_len: int, eos_token_ids: list[int], model_name: str = "",
                 kv: KvTierHooks | None = None, worker_drafts: bool = True,
                 gpu_streams: bool = False, loras: LoraRegistry | None = None) -> None:
        """``worker_drafts``: the worker can fill draft slots (else draft_model drafts none);
        ``gpu_streams``: streams served from a GPU worker (the decode stall target's default);
        ``loras``: the replica's LoRA adapters (lora_registry.py; kept across re-attaches)."""
        self.config = config
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(eos_token_ids)
        self.model_name = model_name  # the served name, part of every block key
        self.block_manager = BlockManager(num_blocks, block_size)
        self.kv = kv or KvTierHooks()  # the KV connector's hooks (kv_connector.py)
        self.chunk_pacer = ChunkPacer(config.chunk_step_ratio, config.max_num_batched_tokens,
                                      min_tokens=block_size,
                                      target_s=decode_stall_target_ms(
                                          config.max_decode_stall_ms, gpu_streams) / 1000)
        self.step_clock = StepClock()  # the pacer's step times
        self.reserve = AdmissionReserve(block_size, config.admission_reserve)
        self._kept = KeptRoom()  # room admission keeps for the running (admission.py)
        self.drafter = drafter(config.speculative_config, worker_drafts)  # speculation.py
        self.loras = loras or LoraRegistry()
        self.draft_books = DraftBooks()  # drafts verified and kept
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # sorted by sort_key
        self.running: list[Request] = []
        self.num_steps = 0
        self.num_preemptions = 0
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of those, tokens found
        self._arrival_seqs = itertools.count()
        self.arriving = Arrivals()  # validated, not queued yet (intake.py)
        self._tier_store_id = ""  # the kvstore process the queued tier hits were pinned by
        self._next_step_id = 0
        self._forget_ids: list[str] = []  # the worker should drop these at the next step
        self._in_plan: set[str] = set()  # ids in the plan being built: never preempted

    @classmethod
    def without_worker(cls, config: SchedulerConfig, kv: KvTierHooks,
                       loras: LoraRegistry | None = None) -> Scheduler:
        """The core while no worker is attached: no blocks, no drafts, no request (the
        service refuses submits until a worker attaches and the real core replaces it)."""
        core = cls(config, num_blocks=0, block_size=0, max_model_len=0, eos_token_ids=[], kv=kv,
                   loras=loras)
        core.drafter = drafter(None)  # (the stats report no draft cap)
        return core

    # ------------------------------------------------------------ intake
    def add_request(self, request: GenerateRequest, *, tier_hit: TierHit | None = None) -> None:
        """Validate and queue a request at once (no kvstore lookup in between)."""
        self.queue(self.arrive(request), tier_hit)

    def arrive(self, request: GenerateRequest) -> Arrival:
        """Validate a request (InvalidRequest), the one time, and give it its place in line;
        with a connector that looks requests up, the blocks to ask the kvstore about."""
        validate_request(request, ChainMap(self.requests, self.arriving), self.max_model_len,
                         self.block_manager, self.config.prefix_caching)
        lora = self.loras.resolve(request.lora_name)  # (NotFound: no such adapter)
        arrival = Arrival(request, next(self._arrival_seqs),
                          prefix_query(request, self.block_manager, self.model_name,
                                       self.config.prefix_caching, lora)
                          if self.kv.looks_up else None, lora)
        self.arriving.add(arrival)
        return arrival

    def queue(self, arrival: Arrival, tier_hit: TierHit | None = None) -> None:
        """Queue an arrived request (not aborted since); n > 1 queues n siblings (siblings.py),
        the leader first with its place in line and ``tier_hit`` (siblings hit its blocks)."""
        self.arriving.remove(arrival)
        self._tier_store_id = drop_stale_tier_hits(self.waiting, self._tier_store_id,
                                                   self.kv.store_id)
        priority_policy = self.config.scheduling_policy == SchedulingPolicy.PRIORITY
        for req in queue_entries(arrival, tier_hit, self._arrival_seqs, self.model_name,
                                 priority_policy, self.config.prefix_caching):
            self.requests[req.request_id] = req
            self._enqueue(req)

    def withdraw(self, arrival: Arrival) -> None:
        """An arrived request will not queue (its lookup failed, or the service refused it)."""
        self.arriving.remove(arrival)

    def use_connector(self, kv: KvTierHooks) -> None:
        """The service swapped its KV connector (the worker reached a kvstore)."""
        self.kv, self._tier_store_id = kv, ""

    def abort(self, request_ids: list[str]) -> None:
        self.arriving.abort(request_ids)  # (those being looked up queue nothing)
        for request_id in request_ids:
            req = self.requests.get(request_id)
            if req is not None:
                self._finish(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_queued_prefill_tokens(self) -> int:
        """Prompt tokens still to compute before every request decodes: all of each waiting
        request's (cache hits are known only at admission), the rest of each running one."""
        return sum(req.num_tokens_at_worker - req.num_computed_tokens for req in self.waiting) + \
            sum(req.num_tokens_at_worker - req.num_computed_tokens for req in self.running
                if req.is_prefilling)

    # ------------------------------------------------------------ one step
    def schedule(self) -> StepPlan | None:
        """Plan the next step, or None when there is nothing to compute now."""
        budget = self.config.max_num_batched_tokens
        self._in_plan = set()
        new_requests: list[NewRequestData] = []
        scheduled: list[ScheduledRequest] = []
        preempted = False
        num_decodes, num_chunk_tokens = 0, 0  # prompt chunks may be paced against decodes
        speculating = self.drafter.drafts_at(len(self.running))
        # Decodes first, then prompt chunks; each in (priority, arrival) order.
        for req in sorted(self.running, key=lambda r: (r.is_prefilling, r.sort_key)):
            if budget == 0:
                break
            if req not in self.running or req.reached_max_tokens or req.num_drafts:
                continue  # preempted for an earlier request, or its last token(s) coming
            if req.num_pending_tokens and not req.is_prefilling and speculating and \
                    self.drafter.worth_waiting(req.request_id, req.all_token_ids, req.sampling):
                continue  # copying: its next step verifies drafts once its token is known
            prefilling = req.is_prefilling
            num_new = min(req.num_tokens_at_worker - req.num_computed_tokens, budget)
            if prefilling:
                num_new = min(num_new, self.chunk_pacer.chunk_budget(num_decodes) - num_chunk_tokens)
            if num_new <= 0:
                continue
            drafts = self.drafter.for_request(req, budget, self.max_model_len) \
                if speculating and not prefilling else NO_DRAFTS
            num_new += drafts.num_drafts
            new_block_ids = self._grow_or_preempt(req, req.num_computed_tokens + num_new)
            if new_block_ids is None:  # req itself was preempted
                preempted = True
                continue
            self._schedule(req, num_new, new_block_ids, new_requests, scheduled, drafts)
            budget -= num_new
            num_chunk_tokens += num_new if prefilling else 0
            num_decodes += 0 if prefilling else 1
        self._kept = KeptRoom() if not self.waiting else self.reserve.kept_room(
            self.running, self.max_model_len, self.block_manager.num_sole)
        while not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            head = self._waiting_head()
            if head is None:
                break
            admit_budget = min(budget, self.chunk_pacer.chunk_budget(num_decodes) - num_chunk_tokens)
            num_new = self._admit(head, admit_budget, new_requests, scheduled) \
                if admit_budget > 0 else None
            if num_new is None:
                break  # the head does not fit: later requests wait behind it
            budget -= num_new
            num_chunk_tokens += num_new
        if not scheduled and not new_requests:
            return None  # (a retired adapter waits for the next plan to be forgotten)
        kv_loads, kv_stores = self.kv.take_plan(
            store_target(self.requests, self.block_manager, self._forget_ids))
        plan = StepPlan(self._next_step_id, new_requests, scheduled, self._forget_ids,
                        kv_loads=kv_loads, kv_stores=kv_stores,
                        forgotten_loras=self.loras.retired_unused(self.requests.values()))
        self._next_step_id, self._forget_ids = self._next_step_id + 1, []
        self.drafter.planned(plan)  # (after drafts_at: the adaptive draft cap's books)
        self.step_clock.planned(plan.step_id)
        return plan

    def update(self, plan: StepPlan, result: StepResult) -> list[Emitted]:
        """Apply the tokens a step sampled; return the outputs to publish."""
        self.num_steps += 1
        self.kv.on_step_result(plan.step_id)
        period_s = self.step_clock.period(plan.step_id)
        if plan.scheduled:  # (a step of loads alone says nothing of compute times)
            self.chunk_pacer.observe(plan, period_s)
        self.drafter.step_done(plan, result)
        add_prompt_logprobs(self.requests, plan, result)
        emitted: list[Emitted] = []
        logprobs = result.logprobs or [None] * len(result.request_ids)  # [] from an older worker
        accepted = result.accepted_draft_ids or [[]] * len(result.request_ids)
        for request_id, token_id, entry, kept in zip(
                result.request_ids, result.sampled_token_ids, logprobs, accepted):
            req = self.requests.get(request_id)
            if req is None:  # finished or aborted while the step ran: a wasted token
                continue
            req.num_pending_tokens -= 1
            token_ids = settle_drafts(req, kept, self.draft_books) + [token_id]
            token_ids, finish_reason = append_outputs(req, token_ids, self.eos_token_ids,
                                                      self.max_model_len)
            self._register_full_blocks(req)
            output = request_output(req, token_ids, finish_reason,
                                    [entry] if entry is not None else [])
            emitted.append(Emitted(req.output_subject, output))
            if finish_reason is not None:
                self.reserve.on_finished(req)
                self._finish(req)
        for req, output in refused_outputs(self.requests, result):  # (the rest ran on)
            emitted.append(Emitted(req.output_subject, output))
            self._finish(req)
        return emitted

    def fail_all(self, error: ErrorInfo) -> list[Emitted]:
        """The worker is gone: end every request with ``error``."""
        emitted = [Emitted(req.output_subject, RequestOutput.failure(
            req.request_id, len(req.prompt_token_ids), error)) for req in self.requests.values()]
        for req in list(self.requests.values()):
            self._finish(req)
        self._forget_ids = []
        self.kv.on_fail_all()
        return emitted

    # ------------------------------------------------------------ helpers
    def _admit(self, req: Request, budget: int, new_requests: list[NewRequestData],
               scheduled: list[ScheduledRequest]) -> int | None:
        """Start the head of the queue after its longest cached prefix (GPU hits, then
        the part of its tier hit beyond them, loaded into fresh blocks); return the
        tokens scheduled (None if it does not fit or is still receiving tokens).

        A request with blocks to load, admitted into a step that computes other requests
        already, computes nothing in it: the worker copies its blocks beside that step's
        forward, and it computes from the next step planned (even one planned before that
        step's result: the worker makes a step wait on the device for loads still writing
        blocks it reads), so loads overlap the compute of other requests instead of
        delaying it, and the request waits for no round trip after its copy. Into a step
        with nothing else to compute, it computes at once, after its load (the worker
        queues that forward while the copy runs). Past a plan's first hit, its loads are
        capped (``max_kv_load_mib_per_step``): the step that computes loaded requests waits
        for their whole copy, so hits go in batches that pipeline against compute."""
        if req.num_pending_tokens:
            return None  # preempted mid-step: its last token is still on the way
        block_size = self.block_manager.block_size
        hit_ids = self._prefix_hits(req)
        loaded = self.kv.slots_to_load(req.tier_hit, len(hit_ids), self._num_usable_blocks(req))
        if loaded is None:
            return None  # the plan's loads are full: it loads in the next one
        num_cached = (len(hit_ids) + len(loaded)) * block_size
        num_new = min(req.num_tokens - num_cached, budget)
        num_missing = num_blocks_for(num_cached + num_new, block_size) - len(hit_ids)
        own = self.reserve.commitment(req, num_missing, req.num_tokens - num_cached - num_new,
                                      self.max_model_len)  # its hits may stay held by others
        kept = self._kept.need_with(own, req.sort_key[0]) if self.running else 0
        if not self.block_manager.can_allocate(num_missing + self.reserve.blocks_for(kept),
                                               self.block_manager.num_evictable(hit_ids)):
            return None
        self._kept.add(own, req.sort_key[0])
        self.waiting.remove(req)
        self.running.append(req)
        self.block_manager.reuse(hit_ids)
        new_ids = self.block_manager.allocate(num_missing)
        req.block_table = hit_ids + new_ids
        hit, req.tier_hit = req.tier_hit, None  # spent either way
        self.kv.on_admit(hit, loaded, new_ids[:len(loaded)], self._next_step_id)
        cache_loaded_blocks(self.block_manager, req, len(hit_ids), new_ids[:len(loaded)])
        # its GPU hits and loaded blocks are in the prefix index already: not offered again
        # (1,023 calls for a 16k-token hit)
        req.num_registered_blocks = max(req.num_registered_blocks, len(hit_ids) + len(loaded))
        req.num_computed_tokens = num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.time()
            req.num_cached_tokens = num_cached
        self.num_prefix_queries += req.num_tokens
        self.num_prefix_hits += len(hit_ids) * block_size
        if loaded and scheduled:  # it computes from the next plan (see the docstring)
            self._send_to_worker(req, new_requests)
            return 0
        self._schedule(req, num_new, [], new_requests, scheduled)
        return num_new

    def _num_usable_blocks(self, req: Request) -> int:
        """Leading blocks a request may take from a cache: none when it wants every
        prompt token's logits, else all but its last token's block."""
        if not self.config.prefix_caching or req.wants_prompt_logprobs:
            return 0
        return (req.num_tokens - 1) // self.block_manager.block_size

    def _waiting_head(self) -> Request | None:
        """The first waiting request, skipping siblings whose leader is still scheduling
        the prompt they will share (it runs, or waits ahead of them: no deadlock), and
        those whose LoRA adapter cannot join the running ones (lora_registry.py)."""
        adapter_fits = self.loras.admits(self.running)
        for req in self.waiting:
            if not adapter_fits(req):
                continue
            leader = req.leader
            if leader is not None and self.requests.get(leader.request_id) is leader \
                    and leader.num_computed_tokens < len(leader.prompt_token_ids):
                continue
            req.leader = None  # released for good
            return req
        return None

    def _prefix_hits(self, req: Request) -> list[int]:
        num_usable = self._num_usable_blocks(req)  # one token is computed, to sample from
        if num_usable == 0:
            return []
        extend_block_hashes(req.block_hashes, req.all_token_ids, req.num_tokens,
                            self.block_manager.block_size, req.extra_keys, req.image_keys)
        return self.block_manager.cached_prefix(req.block_hashes, req.all_token_ids)[:num_usable]

    def _schedule(self, req: Request, num_new: int, new_block_ids: list[int],
                  new_requests: list[NewRequestData], scheduled: list[ScheduledRequest],
                  drafts: Drafts = NO_DRAFTS) -> None:
        if not req.known_to_worker:
            self._send_to_worker(req, new_requests)
            new_block_ids = []
        else:
            req.block_table.extend(new_block_ids)
        scheduled.append(ScheduledRequest(req.request_id, num_new, new_block_ids,
                                          drafts.num_drafts, drafts.token_ids))
        self._in_plan.add(req.request_id)
        req.num_computed_tokens += num_new
        req.num_drafts = drafts.num_drafts
        if req.num_computed_tokens >= req.num_tokens_at_worker:
            req.num_pending_tokens += 1  # the worker samples this step
        self._register_full_blocks(req)

    def _send_to_worker(self, req: Request, new_requests: list[NewRequestData]) -> None:
        """The worker learns the request in full with this plan (its blocks so far)."""
        req.sent_at_step = self._next_step_id
        if req.wants_prompt_logprobs:
            req.prompt_logprobs = []  # computed (again) from the start
        new_requests.append(new_request_data(req))
        req.known_to_worker = True

    def _register_full_blocks(self, req: Request) -> None:
        """Offer full blocks whose tokens are known and computed (or being computed
        by a step that runs before any step that could reuse them)."""
        if not self.config.prefix_caching:
            return
        block_size = self.block_manager.block_size
        num_ready = min(req.num_computed_tokens, req.num_tokens)
        num_full = min(num_ready // block_size, len(req.block_table))
        if num_full <= req.num_registered_blocks:
            return  # most decode steps: no block filled
        token_ids = req.all_token_ids
        extend_block_hashes(req.block_hashes, token_ids, num_ready, block_size, req.extra_keys,
                            req.image_keys)
        for index in range(req.num_registered_blocks, num_full):
            start = index * block_size
            block_id, block_hash = req.block_table[index], req.block_hashes[index]
            if self.block_manager.cache_block(block_id, block_hash,
                                              token_ids[start:start + block_size]):
                self.kv.on_block_cached(req.request_id, index, block_id, block_hash)
        req.num_registered_blocks = max(req.num_registered_blocks, num_full)

    def _grow_or_preempt(self, req: Request, num_tokens: int) -> list[int] | None:
        """Blocks for ``req`` to hold ``num_tokens``, preempting the lowest-priority,
        latest running requests until they fit; None if ``req`` itself had to go."""
        while True:
            num_missing = self.block_manager.num_missing_blocks(req.block_table, num_tokens)
            if self.block_manager.can_allocate(num_missing):
                return self.block_manager.allocate(num_missing)
            victim = max((r for r in self.running if r.request_id not in self._in_plan),
                         key=lambda r: r.sort_key)
            self._preempt(victim)
            if victim is req:
                return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0
        if req.known_to_worker:
            self._forget_ids.append(req.request_id)
            req.known_to_worker = False
        self._enqueue(req)
        self.num_preemptions += 1
        self.reserve.on_preempted()

    def _enqueue(self, req: Request) -> None:
        bisect.insort(self.waiting, req, key=lambda r: r.sort_key)

    def _finish(self, req: Request) -> None:
        """Forget a request. Its blocks are free at once even if a step in flight still
        writes them: the worker runs steps in order, so a later step reusing them
        writes after it."""
        self.requests.pop(req.request_id, None)
        self.drafter.forget(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req.block_table)
        req.block_table = []
        self.kv.on_finish(req.tier_hit)  # finished before admission used it
        req.tier_hit = None
        if req.known_to_worker:
            self._forget_ids.append(req.request_id)
            req.known_to_worker = False
