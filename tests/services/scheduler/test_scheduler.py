"""The scheduler policy driven step by step, with a fake worker that tracks what a
real one would hold (its own token lists and block tables) and checks every plan."""

from __future__ import annotations

import zlib
from collections import deque

import msgspec
import pytest

from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.errors import InvalidRequest
from shared.messages import GenerateRequest, SamplingParams, StepPlan, StepResult, TokenLogprobs

EOS = 0


BLOCK_SIZE = 4


class FakeWorker:
    """Mirrors the worker's bookkeeping and its KV cache: it records which token each
    slot holds and checks, every step, that every request's whole context reads back
    its own tokens, so shared prefix blocks, reused blocks and preemption are all
    checked. The sampled token is a pure function of the request and its position,
    so a preempted-and-recomputed request must continue with the same tokens. Like the
    real worker, it gives logprobs where asked: -position for prompt token ``position``
    (prompt logprobs of a request that arrived with no outputs), -0.25 for a sampled one."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.state: dict[str, dict] = {}
        self.slots: dict[int, int] = {}  # slot -> token whose KV is stored there
        self.num_sampled: dict[str, int] = {}

    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.state.pop(request_id)
        for new in plan.new_requests:
            assert new.request_id not in self.state
            num_prompt = new.num_prompt_tokens or len(new.token_ids)
            self.state[new.request_id] = {"tokens": list(new.token_ids), "blocks": list(new.block_ids),
                                          "computed": new.num_computed_tokens, "sampling": new.sampling,
                                          "num_prompt": num_prompt,
                                          "prompt_logprobs": new.sampling.prompt_logprobs is not None
                                          and num_prompt == len(new.token_ids)}
        request_ids, token_ids, logprobs, prompt_logprobs = [], [], [], {}
        for sched in plan.scheduled:
            st = self.state[sched.request_id]
            st["blocks"] += sched.new_block_ids
            start, end = st["computed"], st["computed"] + sched.num_new_tokens
            assert end <= len(st["tokens"])
            assert len(st["blocks"]) * BLOCK_SIZE >= end, "not enough blocks for the computed tokens"
            assert all(0 <= b < self.num_blocks for b in st["blocks"])
            for position in range(start, end):
                self.slots[self.slot(st, position)] = st["tokens"][position]
            st["computed"] = end
            if st["prompt_logprobs"] and start + 1 < min(end + 1, st["num_prompt"]):
                prompt_logprobs[sched.request_id] = [
                    TokenLogprobs(st["tokens"][i], -float(i))
                    for i in range(start + 1, min(end + 1, st["num_prompt"]))]
            if end == len(st["tokens"]):
                token = next_token(sched.request_id, len(st["tokens"]))
                st["tokens"].append(token)
                request_ids.append(sched.request_id)
                token_ids.append(token)
                logprobs.append(None if st["sampling"].logprobs is None else TokenLogprobs(token, -0.25))
                self.num_sampled[sched.request_id] = self.num_sampled.get(sched.request_id, 0) + 1
        for sched in plan.scheduled:  # attention reads the whole context
            st = self.state[sched.request_id]
            for position in range(st["computed"]):
                assert self.slots.get(self.slot(st, position)) == st["tokens"][position], \
                    f"{sched.request_id}: KV of position {position} was overwritten or never written"
        return StepResult(plan.step_id, request_ids, token_ids, 0.0,
                          logprobs if any(logprobs) else [], prompt_logprobs)

    @staticmethod
    def slot(st: dict, position: int) -> int:
        return st["blocks"][position // BLOCK_SIZE] * BLOCK_SIZE + position % BLOCK_SIZE


def next_token(request_id: str, position: int) -> int:
    return 1 + (hash((request_id, position)) % 1000)


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512,
                   **config):
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             **config)
    return Scheduler(config, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                     max_model_len=max_model_len, eos_token_ids=[EOS], model_name="m")


def request(request_id: str, num_prompt: int, max_tokens: int, prompt: list[int] | None = None,
            priority: int = 0, cache_salt: str | None = None, n: int = 1,
            **sampling) -> GenerateRequest:
    """A request whose prompt is its own (no shared prefix) unless ``prompt`` is given."""
    if prompt is None:
        base = 1 + (zlib.crc32(request_id.encode()) % 1000) * 1000
        prompt = list(range(base, base + num_prompt))
    return GenerateRequest(request_id=request_id, prompt_token_ids=prompt,
                           sampling=SamplingParams(max_tokens=max_tokens, **sampling),
                           output_subject="out", priority=priority, cache_salt=cache_salt, n=n)


def run_to_completion(scheduler: Scheduler, worker: FakeWorker, depth: int = 1, max_steps=10_000,
                      record: list | None = None):
    """Drive the scheduler until it is idle. With ``depth`` > 1, plans run ahead of the
    results as in the service: the worker runs each plan in order, the scheduler sees
    a result only ``depth - 1`` plans later. ``record`` collects every RequestOutput."""
    in_flight: deque = deque()
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    plans = []
    for _ in range(max_steps):
        while len(in_flight) < depth:
            plan = scheduler.schedule()
            if plan is None:
                break
            plans.append(plan)
            in_flight.append((plan, worker.execute(plan)))
        if not in_flight:
            break
        plan, result = in_flight.popleft()
        for emitted in scheduler.update(plan, result):
            out = emitted.output
            if record is not None:
                record.append(out)
            assert out.request_id not in finish, "output after finish"
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason:
                finish[out.request_id] = out.finish_reason
    assert not scheduler.has_work
    return outputs, finish, plans


def expected_tokens(request_id: str, num_prompt: int, max_tokens: int) -> list[int]:
    return [next_token(request_id, num_prompt + i) for i in range(max_tokens)]


def test_all_requests_complete_with_their_own_tokens():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    for i in range(5):
        scheduler.add_request(request(f"r{i}", 3 + i, 6, ignore_eos=True))
    outputs, finish, _ = run_to_completion(scheduler, worker)
    for i in range(5):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 3 + i, 6)
        assert finish[f"r{i}"] == "length"
    assert scheduler.block_manager.num_free_blocks == 64


def test_max_num_seqs_limits_the_running_batch():
    scheduler, worker = make_scheduler(max_num_seqs=2), FakeWorker(64)
    for i in range(4):
        scheduler.add_request(request(f"r{i}", 4, 3, ignore_eos=True))
    _, finish, plans = run_to_completion(scheduler, worker)
    assert max(len(p.scheduled) for p in plans) == 2
    assert len(finish) == 4


def test_long_prompt_is_chunked_under_the_token_budget_while_others_decode():
    scheduler, worker = make_scheduler(max_num_batched_tokens=8), FakeWorker(64)
    scheduler.add_request(request("short", 2, 10, ignore_eos=True))
    scheduler.add_request(request("long", 30, 2, ignore_eos=True))
    outputs, _, plans = run_to_completion(scheduler, worker)
    assert all(sum(s.num_new_tokens for s in p.scheduled) <= 8 for p in plans)
    chunks = [s.num_new_tokens for p in plans for s in p.scheduled if s.request_id == "long"]
    assert chunks[:4] == [6, 7, 7, 7]  # short decodes one token in each of those steps
    assert outputs["long"] == expected_tokens("long", 30, 2)
    assert outputs["short"] == expected_tokens("short", 2, 10)


def test_waiting_requests_are_admitted_in_arrival_order_when_blocks_free_up():
    scheduler, worker = make_scheduler(num_blocks=5), FakeWorker(5)
    scheduler.add_request(request("a", 12, 4, ignore_eos=True))  # 3 blocks for its prompt
    scheduler.add_request(request("b", 12, 4, ignore_eos=True))  # 3 more: does not fit yet
    scheduler.add_request(request("c", 2, 2, ignore_eos=True))  # would fit, but b is first
    first = scheduler.schedule()
    assert [s.request_id for s in first.scheduled] == ["a"]
    scheduler.update(first, worker.execute(first))
    outputs, finish, plans = run_to_completion(scheduler, worker)
    admitted = [n.request_id for p in plans for n in p.new_requests]
    assert admitted.index("b") < admitted.index("c")
    assert set(finish) == {"a", "b", "c"}
    assert outputs["b"] == expected_tokens("b", 12, 4)


def test_eos_and_stop_token_ids_end_a_request_and_free_its_blocks():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    stop_token = next_token("s", 5)
    scheduler.add_request(request("s", 5, 50, stop_token_ids=[stop_token]))
    outputs, finish, _ = run_to_completion(scheduler, worker)
    assert outputs["s"] == [stop_token] and finish["s"] == "stop"
    assert scheduler.block_manager.num_used_blocks == 0


def test_preemption_recomputes_and_every_request_gets_its_exact_tokens():
    # 12 blocks of 4 tokens; 6 requests each growing to 24 tokens (6 blocks): only two fit.
    # (admission keeps no room for growth here, so they are preempted)
    scheduler, worker = make_scheduler(num_blocks=12, max_num_batched_tokens=32,
                                       admission_reserve=False), FakeWorker(12)
    for i in range(6):
        scheduler.add_request(request(f"r{i}", 4, 20, ignore_eos=True))
    outputs, finish, plans = run_to_completion(scheduler, worker)
    assert scheduler.num_preemptions > 0
    resumed = [n for p in plans for n in p.new_requests if n.token_ids[4:]]
    assert resumed, "a preempted request is resent with its outputs so far"
    for i in range(6):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 4, 20)
    assert scheduler.block_manager.num_free_blocks == 12


def test_abort_frees_blocks_and_tells_the_worker():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    scheduler.add_request(request("x", 8, 100, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(plan, worker.execute(plan))
    scheduler.abort(["x"])
    assert scheduler.block_manager.num_used_blocks == 0 and not scheduler.has_work
    scheduler.add_request(request("y", 2, 1, ignore_eos=True))
    plan = scheduler.schedule()
    assert plan.finished_request_ids == ["x"]


@pytest.mark.parametrize("num_prompt,max_tokens,match", [
    (0, 4, "empty"), (500, 100, "context length"), (200, 100, "KV cache"),
])
def test_requests_that_can_never_run_are_rejected(num_prompt, max_tokens, match):
    scheduler = make_scheduler(num_blocks=64)  # 256 tokens of cache, 512 context
    with pytest.raises(InvalidRequest, match=match):
        scheduler.add_request(request("bad", num_prompt, max_tokens))


# ---------------------------------------------------------------- prefix caching
def run_one(scheduler, worker, req):
    scheduler.add_request(req)
    return run_to_completion(scheduler, worker)


def test_a_shared_prefix_reuses_the_exact_cached_blocks():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    prompt = list(range(100, 112))  # 3 full blocks
    _, _, plans_a = run_one(scheduler, worker, request("a", 0, 2, prompt=prompt, ignore_eos=True))
    blocks_a = plans_a[0].new_requests[0].block_ids
    _, _, plans_b = run_one(scheduler, worker,
                            request("b", 0, 2, prompt=prompt + [7, 8, 9], ignore_eos=True))
    new_b = plans_b[0].new_requests[0]
    assert new_b.num_computed_tokens == 12
    assert new_b.block_ids[:3] == blocks_a[:3]
    assert plans_b[0].scheduled[0].num_new_tokens == 3
    assert (scheduler.num_prefix_queries, scheduler.num_prefix_hits) == (12 + 15, 12)


def test_a_fully_cached_prompt_still_computes_its_last_block():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    prompt = list(range(100, 112))
    run_one(scheduler, worker, request("a", 0, 1, prompt=prompt, ignore_eos=True))
    _, _, plans = run_one(scheduler, worker, request("b", 0, 1, prompt=prompt, ignore_eos=True))
    assert plans[0].new_requests[0].num_computed_tokens == 8  # 2 blocks; the 3rd is recomputed
    assert plans[0].scheduled[0].num_new_tokens == 4


def test_no_prefix_caching_turns_it_off():
    scheduler, worker = make_scheduler(prefix_caching=False), FakeWorker(64)
    prompt = list(range(100, 112))
    run_one(scheduler, worker, request("a", 0, 1, prompt=prompt, ignore_eos=True))
    _, _, plans = run_one(scheduler, worker, request("b", 0, 1, prompt=prompt, ignore_eos=True))
    assert plans[0].new_requests[0].num_computed_tokens == 0
    assert scheduler.block_manager.num_cached_blocks == 0


def test_cache_salt_isolates_tenants():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    prompt = list(range(100, 116))
    run_one(scheduler, worker, request("a", 0, 1, prompt=prompt, cache_salt="x", ignore_eos=True))
    _, _, other = run_one(scheduler, worker, request("b", 0, 1, prompt=prompt, cache_salt="y"))
    _, _, same = run_one(scheduler, worker, request("c", 0, 1, prompt=prompt, cache_salt="x"))
    assert other[0].new_requests[0].num_computed_tokens == 0
    assert same[0].new_requests[0].num_computed_tokens == 12


def test_shared_blocks_are_reference_counted_and_evicted_least_recent_first():
    scheduler, worker = make_scheduler(num_blocks=8), FakeWorker(8)
    manager = scheduler.block_manager
    prompt = list(range(100, 108))  # 2 full blocks
    scheduler.add_request(request("a", 0, 5, prompt=prompt, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(plan, worker.execute(plan))
    scheduler.add_request(request("b", 0, 5, prompt=prompt + [1], ignore_eos=True))
    plan = scheduler.schedule()
    shared = plan.new_requests[0].block_ids[:2]
    assert [manager.blocks[b].ref_count for b in shared] == [2, 2]
    scheduler.update(plan, worker.execute(plan))
    run_to_completion(scheduler, worker)
    assert all(block.ref_count == 0 for block in manager.blocks)
    assert manager.num_free_blocks == 8 and manager.num_cached_blocks >= 2
    # A new unrelated request that needs every block evicts cached ones; the prefix
    # blocks go last because blocks are freed tail first.
    cached_before = {bid for bid, block in enumerate(manager.blocks) if block.block_hash}
    taken = manager.allocate(8 - len(cached_before) + 1)
    evicted = cached_before & set(taken)
    assert len(evicted) == 1 and not evicted & set(shared)


def test_a_hash_hit_is_confirmed_by_tokens():
    scheduler = make_scheduler()
    manager = scheduler.block_manager
    [block_id] = manager.allocate(1)
    manager.cache_block(block_id, b"h" * 32, [1, 2, 3, 4])
    assert manager.cached_prefix([b"h" * 32], [1, 2, 3, 4]) == [block_id]
    assert manager.cached_prefix([b"h" * 32], [1, 2, 3, 5]) == []  # a collision is not a hit


# ---------------------------------------------------------------- priorities and preemption
def test_priority_policy_admits_lower_values_first_and_preempts_the_lowest_priority():
    scheduler, worker = make_scheduler(num_blocks=6, max_num_seqs=1,
                                       scheduling_policy="priority"), FakeWorker(6)
    scheduler.add_request(request("low", 4, 2, priority=5, ignore_eos=True))
    scheduler.add_request(request("high", 4, 2, priority=-1, ignore_eos=True))
    scheduler.add_request(request("mid", 4, 2, priority=0, ignore_eos=True))
    _, _, plans = run_to_completion(scheduler, worker)
    assert [n.request_id for p in plans for n in p.new_requests] == ["high", "mid", "low"]


def test_fcfs_ignores_priority():
    scheduler, worker = make_scheduler(max_num_seqs=1), FakeWorker(64)
    scheduler.add_request(request("first", 4, 1, priority=5, ignore_eos=True))
    scheduler.add_request(request("second", 4, 1, priority=-5, ignore_eos=True))
    _, _, plans = run_to_completion(scheduler, worker)
    assert [n.request_id for p in plans for n in p.new_requests] == ["first", "second"]


def test_preemption_takes_the_latest_request_first():
    scheduler, worker = make_scheduler(num_blocks=6, max_num_batched_tokens=64,
                                       admission_reserve=False), FakeWorker(6)
    for name in ("r0", "r1", "r2"):
        scheduler.add_request(request(name, 4, 8, ignore_eos=True))  # each grows to 3 blocks
    plan = scheduler.schedule()
    scheduler.update(plan, worker.execute(plan))
    preempted = []
    while scheduler.has_work:
        before = {r.request_id for r in scheduler.running}
        plan = scheduler.schedule()
        preempted += sorted(before - {r.request_id for r in scheduler.running}
                            - {o for o in before if o not in scheduler.requests})
        if plan is None:
            break
        scheduler.update(plan, worker.execute(plan))
    assert preempted and preempted[0] == "r2"


# ---------------------------------------------------------------- overlapped steps
def test_overlapped_steps_give_exactly_the_same_tokens():
    scheduler, worker = make_scheduler(max_num_batched_tokens=16), FakeWorker(64)
    for i in range(6):
        scheduler.add_request(request(f"r{i}", 5 + 3 * i, 7 + i, ignore_eos=True))
    outputs, finish, _ = run_to_completion(scheduler, worker, depth=2)
    for i in range(6):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 5 + 3 * i, 7 + i)
        assert finish[f"r{i}"] == "length"
    assert scheduler.block_manager.num_used_blocks == 0


def test_overlap_wastes_at_most_one_token_after_a_stop():
    scheduler, worker = make_scheduler(), FakeWorker(64)
    stop_token = next_token("s", 6 + 3)  # the 4th output token
    scheduler.add_request(request("s", 6, 50, stop_token_ids=[stop_token]))
    outputs, finish, _ = run_to_completion(scheduler, worker, depth=2)
    assert outputs["s"] == expected_tokens("s", 6, 4) and finish["s"] == "stop"
    assert worker.num_sampled["s"] == 5  # the stop token, then one wasted in the step in flight


def test_overlap_with_preemption_and_prefix_hits_stays_exact():
    scheduler, worker = make_scheduler(num_blocks=12, max_num_batched_tokens=12,
                                       admission_reserve=False), FakeWorker(12)
    shared = list(range(500, 508))
    for i in range(6):
        scheduler.add_request(request(f"r{i}", 0, 12, prompt=shared + [i], ignore_eos=True))
    outputs, _, _ = run_to_completion(scheduler, worker, depth=2)
    assert scheduler.num_preemptions > 0 and scheduler.num_prefix_hits > 0
    for i in range(6):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 9, 12)


def test_a_resumed_request_continues_after_the_outputs_it_brings():
    """Migration: a request re-submitted with the tokens it had generated elsewhere runs
    like a preempted one resuming: the worker gets prompt + outputs with the prompt's
    length, max_tokens counts the outputs it brought, and only new tokens come out."""
    scheduler, worker = make_scheduler(), FakeWorker(64)
    done = expected_tokens("r", 4, 20)[:7]
    resumed = request("r", 4, 20, ignore_eos=True)
    scheduler.add_request(msgspec.structs.replace(resumed, output_token_ids=done))
    record = []
    outputs, finish, plans = run_to_completion(scheduler, worker, record=record)
    new = plans[0].new_requests[0]
    assert new.token_ids == resumed.prompt_token_ids + done and new.num_prompt_tokens == 4
    assert outputs["r"] == expected_tokens("r", 4, 20)[7:] and finish["r"] == "length"
    assert record[0].num_cached_tokens == 0 and not record[0].prompt_logprobs


@pytest.mark.parametrize("n, num_done", [(2, 3), (1, 20)])
def test_a_resumed_request_must_be_single_and_unfinished(n, num_done):
    scheduler = make_scheduler()
    with pytest.raises(InvalidRequest, match="resumed"):
        scheduler.add_request(msgspec.structs.replace(request("r", 4, 20, n=n),
                                                      output_token_ids=[5] * num_done))
