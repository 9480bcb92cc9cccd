"""The scheduler's kvstore policy driven step by step: tier hits loaded at admission,
write-through stores, pins released. The fake worker below also plays the kvstore's
host tier: it loads slots into its KV blocks before the step (the context check of
FakeWorker then proves every loaded token is where the request reads it) and stores
blocks after it, checking each stored block holds its request's tokens."""

from __future__ import annotations

import pytest

from shared.prefix_hash import extend_block_hashes
from services.scheduler.request import TierHit
from services.scheduler.config import SchedulerConfig
from services.scheduler import scheduler as scheduler_module
from services.scheduler.intake import prefix_query
from services.scheduler.kv_tier import KvTierLedger, max_load_blocks, store_target
from services.scheduler.scheduler import Scheduler
from services.scheduler.validation import validate_request
from shared.errors import InvalidRequest
from shared.messages import ErrorInfo, StepPlan, StepResult
from tests.services.scheduler.test_scheduler import (
    BLOCK_SIZE, EOS, FakeWorker, expected_tokens, request, run_to_completion,
)


def make_scheduler(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=64, kvstore=False,
                   block_bytes=0, **config) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                             **config)
    kv = KvTierLedger(BLOCK_SIZE, max_load_blocks=max_load_blocks(
        config.max_kv_load_mib_per_step, block_bytes)) if kvstore else None
    return Scheduler(config, num_blocks=num_blocks, block_size=BLOCK_SIZE, max_model_len=512,
                     eos_token_ids=[EOS], model_name="m", kv=kv)


def query_of(scheduler: Scheduler, req):
    return prefix_query(req, scheduler.block_manager, scheduler.model_name,
                        scheduler.config.prefix_caching)


class TierWorker(FakeWorker):
    """FakeWorker with a host tier: ``host_slots`` (slot -> its block's tokens)."""

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self.host_slots: dict[int, list[int]] = {}
        self.stored: dict[bytes, list[int]] = {}  # hash -> tokens copied out
        self.num_stores: dict[bytes, int] = {}
        self.loads: list = []

    def execute(self, plan: StepPlan) -> StepResult:
        for load in plan.kv_loads:
            self.loads.append(load)
            for slot_id, block_id in zip(load.slot_ids, load.block_ids):
                for offset, token in enumerate(self.host_slots[slot_id]):
                    self.slots[block_id * BLOCK_SIZE + offset] = token
        # like the real worker, it keeps the requests it forgets for this plan's stores
        forgotten = {rid: self.state[rid] for rid in plan.finished_request_ids}
        result = super().execute(plan)
        for run in plan.kv_stores:
            st = self.state.get(run.request_id) or forgotten[run.request_id]
            assert st["blocks"][run.first_block_index:][:len(run.block_ids)] == run.block_ids
            for index, (block_id, block_hash) in enumerate(zip(run.block_ids, run.block_hashes)):
                position = (run.first_block_index + index) * BLOCK_SIZE
                tokens = [self.slots[block_id * BLOCK_SIZE + i] for i in range(BLOCK_SIZE)]
                assert tokens == st["tokens"][position:position + BLOCK_SIZE]
                self.stored[block_hash] = tokens
                self.num_stores[block_hash] = self.num_stores.get(block_hash, 0) + 1
        return result

    def pin(self, prompt: list[int], first_block: int, num_blocks: int, pin_id: str = "p1",
            tiers: tuple[str, ...] | None = None) -> TierHit:
        """Put blocks first_block.. of ``prompt`` into host slots and pin them."""
        slot_ids = []
        for index in range(first_block, first_block + num_blocks):
            slot_id = 1000 + len(self.host_slots)
            self.host_slots[slot_id] = prompt[index * BLOCK_SIZE:(index + 1) * BLOCK_SIZE]
            slot_ids.append(slot_id)
        return TierHit(pin_id, "store-1", first_block, tuple(slot_ids),
                       tiers or ("host",) * num_blocks)


def prompt_tokens(num: int, base: int = 5000) -> list[int]:
    return list(range(base, base + num))


def hashes_of(prompt: list[int], model: str = "m") -> list[bytes]:
    block_hashes: list[bytes] = []
    extend_block_hashes(block_hashes, prompt, len(prompt), BLOCK_SIZE, (f"model:{model}",))
    return block_hashes


def first_plan(scheduler, worker):
    plan = scheduler.schedule()
    return plan, worker.execute(plan)


def test_tier_hit_loads_into_fresh_blocks_and_counts_as_computed():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(18)  # 4 full blocks and 2 tokens
    hit = worker.pin(prompt, 0, 4)
    scheduler.add_request(request("a", 0, 3, prompt=prompt, ignore_eos=True), tier_hit=hit)
    plan, result = first_plan(scheduler, worker)
    (load,) = plan.kv_loads
    assert load.slot_ids == list(hit.slot_ids)
    (new,) = plan.new_requests
    assert load.block_ids == new.block_ids[:4]
    assert new.num_computed_tokens == 16 and plan.scheduled[0].num_new_tokens == 2
    first = [e.output.new_token_ids[0] for e in scheduler.update(plan, result)]
    outputs, _, _ = run_to_completion(scheduler, worker)
    assert first + outputs["a"] == expected_tokens("a", 18, 3)
    assert scheduler.kv.num_tokens_loaded == {"host": 16, "disk": 0}


def test_a_request_loading_beside_others_computes_from_the_next_plan():
    """Admitted into a step that computes another request, a loading request computes
    nothing in it (its load runs beside that compute), and computes in the very next
    plan, planned while the load step is still in flight (the worker orders that compute
    after the copy on the device). (Alone in its step, it computes at once:
    test_tier_hit_loads_into_fresh_blocks_and_counts_as_computed.)"""
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    scheduler.add_request(request("b", 0, 4, prompt=prompt_tokens(5, base=7000),
                                  ignore_eos=True))
    prompt = prompt_tokens(18)
    scheduler.add_request(request("a", 0, 3, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    load_plan = scheduler.schedule()
    assert [s.request_id for s in load_plan.scheduled] == ["b"] and load_plan.kv_loads
    assert [new.request_id for new in load_plan.new_requests] == ["b", "a"]
    next_plan = scheduler.schedule()  # planned while the load step is in flight
    assert ("a", 2) in [(s.request_id, s.num_new_tokens) for s in next_plan.scheduled]
    assert scheduler.kv.num_pins_held == 1  # the copy may still run: pinned
    scheduler.update(load_plan, worker.execute(load_plan))
    assert scheduler.kv.num_pins_held == 0
    first = {e.output.request_id: e.output.new_token_ids for e in
             scheduler.update(next_plan, worker.execute(next_plan))}
    outputs, _, _ = run_to_completion(scheduler, worker)
    assert first["a"] + outputs["a"] == expected_tokens("a", 18, 3)
    assert len(outputs["b"]) >= 1


def test_a_steps_loads_are_capped_past_its_first_hit():
    """With --max-kv-load-mib-per-step, a plan loads hits up to the cap (its first hit
    always): the next hits load in the next plans, in their order, so a step that reads
    loaded blocks waits for a smaller copy."""
    # 1 MiB blocks, a 5 MiB cap: a hit of 4 blocks fits, a second one does not
    scheduler, worker = make_scheduler(kvstore=True, block_bytes=1 << 20,
                                       max_kv_load_mib_per_step=5), TierWorker(64)
    prompts = {name: prompt_tokens(18, base=base) for name, base in
               (("a", 5000), ("b", 6000), ("c", 7000))}
    for name, prompt in prompts.items():
        scheduler.add_request(request(name, 0, 2, prompt=prompt, ignore_eos=True),
                              tier_hit=worker.pin(prompt, 0, 4, pin_id=f"p-{name}"))
    loaded_per_plan = []
    outputs, _, plans = run_to_completion(scheduler, worker, max_steps=50)
    for plan in plans:
        if plan.kv_loads:
            loaded_per_plan.append([len(load.block_ids) for load in plan.kv_loads])
    assert loaded_per_plan == [[4], [4], [4]]
    for name, prompt in prompts.items():
        assert outputs[name] == expected_tokens(name, 18, 2)


def test_the_load_cap_never_holds_back_a_lone_hit():
    scheduler, worker = make_scheduler(kvstore=True, block_bytes=1 << 20,
                                       max_kv_load_mib_per_step=1), TierWorker(64)
    prompt = prompt_tokens(18)
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    plan = scheduler.schedule()
    assert [len(load.block_ids) for load in plan.kv_loads] == [4]


def test_cached_tokens_count_tier_hits():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(18)
    scheduler.add_request(request("a", 0, 3, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4, tiers=("host", "disk", "disk", "host")))
    records = []
    outputs, _, plans = run_to_completion(scheduler, worker, record=records)
    assert records[0].num_cached_tokens == 16
    assert outputs["a"] == expected_tokens("a", 18, 3)
    assert scheduler.kv.num_tokens_loaded == {"host": 8, "disk": 8}
    assert scheduler.num_prefix_hits == 0  # GPU prefix hits only


def test_last_token_always_computed():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(16)  # exactly 4 blocks: the 4th holds the last token
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    plan, _ = first_plan(scheduler, worker)
    (load,) = plan.kv_loads
    assert len(load.slot_ids) == 3
    assert plan.new_requests[0].num_computed_tokens == 12
    assert plan.scheduled[0].num_new_tokens == 4


def test_gpu_hit_and_tier_hit_combined():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(26)  # 6 full blocks and 2 tokens
    # another request computed the first 2 blocks: they stay in the GPU prefix cache
    scheduler.add_request(request("warm", 0, 1, prompt=prompt[:9], ignore_eos=True))
    run_to_completion(scheduler, worker)
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 2, 4))
    records = []
    plan, result = first_plan(scheduler, worker)
    (load,) = plan.kv_loads
    new = plan.new_requests[0]
    assert load.block_ids == new.block_ids[2:6]
    assert new.num_computed_tokens == 24
    records += [e.output for e in scheduler.update(plan, result)]
    run_to_completion(scheduler, worker, record=records)
    assert records[0].num_cached_tokens == 24
    assert scheduler.num_prefix_hits == 8


def test_gpu_prefix_grew_meanwhile_uses_only_the_rest():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(26)
    hit = worker.pin(prompt, 0, 6)  # looked up when nothing was on the GPU
    scheduler.add_request(request("warm", 0, 1, prompt=prompt[:13], ignore_eos=True))
    run_to_completion(scheduler, worker)  # now blocks 0-2 are on the GPU
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True), tier_hit=hit)
    plan, _ = first_plan(scheduler, worker)
    (load,) = plan.kv_loads
    assert load.slot_ids == list(hit.slot_ids[3:])
    assert plan.new_requests[0].num_computed_tokens == 24


def test_gpu_prefix_grown_past_the_hit_releases_the_pin_unused():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(26)
    hit = worker.pin(prompt, 0, 2)
    scheduler.add_request(request("warm", 0, 1, prompt=prompt[:17], ignore_eos=True))
    run_to_completion(scheduler, worker)
    scheduler.kv.take_pins_to_release()
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True), tier_hit=hit)
    plan, _ = first_plan(scheduler, worker)
    assert plan.kv_loads == []
    assert scheduler.kv.take_pins_to_release() == ["p1"]


def test_gap_before_the_hit_is_recomputed_not_loaded():
    # the hit starts at block 2, but blocks 0-1 are no longer on the GPU
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(26)
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 2, 4))
    outputs, _, plans = run_to_completion(scheduler, worker)
    assert all(not p.kv_loads for p in plans)
    assert outputs["a"] == expected_tokens("a", 26, 2)
    assert scheduler.kv.take_pins_to_release() == ["p1"]


def test_shorter_pin_loads_what_it_has():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(26)
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 2))
    records = []
    outputs, _, plans = run_to_completion(scheduler, worker, record=records)
    assert len(plans[0].kv_loads[0].slot_ids) == 2
    assert records[0].num_cached_tokens == 8
    assert outputs["a"] == expected_tokens("a", 26, 2)


def test_pin_released_after_the_loading_steps_result():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(18)
    scheduler.add_request(request("a", 0, 4, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    plan, result = first_plan(scheduler, worker)
    plan2 = scheduler.schedule()  # overlapped: planned before the first result
    assert scheduler.kv.take_pins_to_release() == []
    scheduler.update(plan, result)
    assert scheduler.kv.take_pins_to_release() == ["p1"]
    scheduler.update(plan2, worker.execute(plan2))
    assert scheduler.kv.take_pins_to_release() == []
    assert scheduler.kv.num_pins_held == 0


def test_abort_before_admission_releases_the_pin():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(18)
    scheduler.add_request(request("a", 0, 4, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    scheduler.abort(["a"])
    assert scheduler.kv.take_pins_to_release() == ["p1"]
    assert scheduler.schedule() is None


def test_abort_after_admission_releases_once_the_step_is_back():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(18)
    scheduler.add_request(request("a", 0, 4, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    plan, result = first_plan(scheduler, worker)
    scheduler.abort(["a"])
    assert scheduler.kv.take_pins_to_release() == []  # the worker may still be copying
    scheduler.update(plan, result)
    assert scheduler.kv.take_pins_to_release() == ["p1"]


def test_worker_failure_releases_pins_of_steps_in_flight_and_waiting_requests():
    scheduler, worker = make_scheduler(kvstore=True, max_num_seqs=1), TierWorker(64)
    first, second = prompt_tokens(18), prompt_tokens(18, base=9000)
    scheduler.add_request(request("a", 0, 4, prompt=first, ignore_eos=True),
                          tier_hit=worker.pin(first, 0, 4, pin_id="pa"))
    scheduler.add_request(request("b", 0, 4, prompt=second, ignore_eos=True),
                          tier_hit=worker.pin(second, 0, 4, pin_id="pb"))
    scheduler.schedule()  # loads a's hit; b waits (one sequence at a time)
    scheduler.fail_all(ErrorInfo(status=503, message="gone"))
    assert sorted(scheduler.kv.take_pins_to_release()) == ["pa", "pb"]


def test_preemption_leaves_no_pin_and_recomputes_correctly():
    # 10 blocks: two requests that outgrow the cache, one preempted mid-decode
    scheduler, worker = make_scheduler(num_blocks=10, kvstore=True,
                                       admission_reserve=False), TierWorker(10)
    first, second = prompt_tokens(14), prompt_tokens(14, base=9000)
    scheduler.add_request(request("a", 0, 14, prompt=first, ignore_eos=True),
                          tier_hit=worker.pin(first, 0, 3, pin_id="pa"))
    scheduler.add_request(request("b", 0, 14, prompt=second, ignore_eos=True),
                          tier_hit=worker.pin(second, 0, 3, pin_id="pb"))
    released = []
    outputs, _, _ = run_to_completion(scheduler, worker, depth=2)
    released += scheduler.kv.take_pins_to_release()
    assert scheduler.num_preemptions > 0
    assert sorted(released) == ["pa", "pb"]
    assert scheduler.kv.num_pins_held == 0
    assert outputs["a"] == expected_tokens("a", 14, 14)
    assert outputs["b"] == expected_tokens("b", 14, 14)


def test_stores_once_per_block_and_never_loaded_ones():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(26)
    scheduler.add_request(request("a", 0, 6, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 2))
    scheduler.add_request(request("b", 0, 6, prompt=prompt, ignore_eos=True))  # same prompt
    run_to_completion(scheduler, worker)
    block_hashes = hashes_of(prompt)
    assert not set(block_hashes[:2]) & set(worker.stored)  # loaded: never stored back
    for block_hash in block_hashes[2:]:
        assert worker.num_stores[block_hash] == 1
    # and each request's own block 6 (2 prompt and 2 output tokens); block 7 ends with the
    # last sampled token, which is never computed
    assert len(worker.stored) == 4 + 1 + 1


def test_blocks_completed_by_a_requests_last_overlapped_step_go_with_the_next_plan():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    scheduler.add_request(request("a", 6, 3, ignore_eos=True))  # block 1: tokens 4-7
    _, _, plans = run_to_completion(scheduler, worker, depth=2)
    assert [run.first_block_index for p in plans for run in p.kv_stores] == [0]
    scheduler.add_request(request("c", 3, 1))
    _, _, plans = run_to_completion(scheduler, worker, depth=2)
    assert [(run.request_id, run.first_block_index) for run in plans[0].kv_stores] == [("a", 1)]
    assert "a" in plans[0].finished_request_ids


def test_stores_go_with_the_step_that_computes_them():
    scheduler, worker = make_scheduler(kvstore=True, max_num_batched_tokens=8), TierWorker(64)
    prompt = prompt_tokens(20)
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True))
    plan, _ = first_plan(scheduler, worker)  # a chunk of 8: blocks 0 and 1
    (run,) = plan.kv_stores
    assert (run.request_id, run.first_block_index) == ("a", 0)
    assert run.block_hashes == hashes_of(prompt)[:2]
    assert run.block_ids == plan.new_requests[0].block_ids[:2]


def test_block_of_a_preempted_request_readmitted_elsewhere_is_not_stored():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    scheduler.add_request(request("a", 8, 1, ignore_eos=True))
    plan, result = first_plan(scheduler, worker)
    stores = scheduler.kv
    block_ids = plan.new_requests[0].block_ids
    block_hash = hashes_of(scheduler.requests["a"].prompt_token_ids)[0]
    stores.on_block_cached("a", 0, block_ids[0], block_hash)
    assert len(stores.take_plan_stores(store_target(scheduler.requests, scheduler.block_manager, []))) == 1
    stores.on_block_cached("a", 0, block_ids[1], block_hash)  # not a's block 0 at the worker
    assert stores.take_plan_stores(store_target(scheduler.requests, scheduler.block_manager, [])) == []


def test_evicted_block_is_not_stored():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(8)
    scheduler.add_request(request("a", 0, 1, prompt=prompt, ignore_eos=True))
    plan, result = first_plan(scheduler, worker)
    scheduler.kv.on_block_cached("a", 0, plan.new_requests[0].block_ids[0], b"other")
    assert scheduler.kv.take_plan_stores(store_target(scheduler.requests, scheduler.block_manager, [])) == []


@pytest.mark.parametrize("kvstore", [False, True])
def test_no_kvstore_no_stores_and_same_plans(kvstore):
    scheduler, worker = make_scheduler(kvstore=kvstore), TierWorker(64)
    for i in range(4):
        scheduler.add_request(request(f"r{i}", 9 + i, 5, ignore_eos=True))
    outputs, _, plans = run_to_completion(scheduler, worker)
    assert all(not p.kv_loads for p in plans)
    assert any(p.kv_stores for p in plans) == kvstore
    for i in range(4):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 9 + i, 5)


def test_prefix_query_covers_blocks_before_the_last_token():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(17)
    scheduler.add_request(request("warm", 0, 1, prompt=prompt[:9], ignore_eos=True))
    run_to_completion(scheduler, worker)
    query = query_of(scheduler, request("a", 0, 1, prompt=prompt))
    assert query.block_hashes == hashes_of(prompt)[:4]
    assert query.num_gpu_blocks == 2
    assert query_of(scheduler, request("b", 0, 1, prompt=prompt, prompt_logprobs=0)) is None
    assert query_of(make_scheduler(prefix_caching=False), request("c", 0, 1, prompt=prompt)) is None


def test_the_arrivals_hashes_are_used():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    scheduler.kv.looks_up = True  # as the kvstore's connector: the core makes the query
    prompt = prompt_tokens(18)
    arrival = scheduler.arrive(request("a", 0, 3, prompt=prompt, ignore_eos=True))
    assert arrival.query.block_hashes == hashes_of(prompt)[:4]
    scheduler.queue(arrival, worker.pin(prompt, 0, 4))
    assert scheduler.requests["a"].block_hashes == arrival.query.block_hashes  # not again
    outputs, _, _ = run_to_completion(scheduler, worker)
    assert outputs["a"] == expected_tokens("a", 18, 3)


def test_an_arrival_keeps_its_place_in_line():
    scheduler = make_scheduler(max_num_seqs=1)
    first = scheduler.arrive(request("first", 5, 1))  # then a kvstore lookup
    scheduler.add_request(request("later", 5, 1))
    scheduler.queue(first)
    assert [r.request_id for r in scheduler.waiting] == ["first", "later"]


def test_a_request_is_validated_once(monkeypatch):
    calls = []
    monkeypatch.setattr(scheduler_module, "validate_request",
                        lambda *args: calls.append(args) or validate_request(*args))
    scheduler = make_scheduler(kvstore=True)
    scheduler.kv.looks_up = True
    scheduler.queue(scheduler.arrive(request("a", 9, 2)))
    scheduler.add_request(request("b", 9, 2))
    assert len(calls) == 2 and len(scheduler.waiting) == 2


def test_an_arriving_request_holds_its_ids_until_it_queues_or_is_withdrawn():
    scheduler = make_scheduler()
    arrival = scheduler.arrive(request("a", 5, 1, n=2))
    with pytest.raises(InvalidRequest, match="duplicate request id a-1"):
        scheduler.arrive(request("a-1", 5, 1))  # while the first is looked up
    scheduler.withdraw(arrival)
    scheduler.queue(scheduler.arrive(request("a", 5, 1, n=2)))
    assert sorted(scheduler.requests) == ["a-0", "a-1"] and not scheduler.arriving


def test_an_abort_while_arriving_is_kept_for_the_service():
    scheduler = make_scheduler()
    arrival, other = scheduler.arrive(request("a", 5, 1)), scheduler.arrive(request("b", 5, 1))
    scheduler.abort(["a"])
    assert arrival.aborted and not other.aborted


def test_hits_of_a_kvstore_restarted_since_are_dropped_when_the_next_request_queues():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(18)
    scheduler.kv.store_id = "store-1"  # the connector's: the kvstore process last heard from
    scheduler.add_request(request("a", 0, 2, prompt=prompt, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    assert scheduler.requests["a"].tier_hit is not None
    scheduler.kv.store_id = "store-2"  # it restarted
    scheduler.add_request(request("b", 5, 1))
    assert scheduler.requests["a"].tier_hit is None
    outputs, _, plans = run_to_completion(scheduler, worker)
    assert all(not p.kv_loads for p in plans)
    assert scheduler.kv.take_pins_to_release() == []  # its pins died with it
    assert outputs["a"] == expected_tokens("a", 18, 2)


def test_siblings_share_the_loaded_blocks():
    scheduler, worker = make_scheduler(kvstore=True), TierWorker(64)
    prompt = prompt_tokens(18)
    scheduler.add_request(request("a", 0, 3, prompt=prompt, n=3, ignore_eos=True),
                          tier_hit=worker.pin(prompt, 0, 4))
    records = []
    outputs, _, plans = run_to_completion(scheduler, worker, record=records)
    assert sum(len(p.kv_loads) for p in plans) == 1
    cached = {o.request_id: o.num_cached_tokens for o in records if o.num_cached_tokens}
    assert cached == {"a-0": 16, "a-1": 16, "a-2": 16}
