"""Admission keeps KV room for the running requests' next tokens (admission.py), learned from
how much of max_tokens finished requests used."""

from __future__ import annotations

import random

from services.scheduler.admission import (MAX_COUNTED_TOKENS, AdmissionReserve, Commitment,
                                          peak_need)
from services.scheduler.request import Request
from shared.messages import SamplingParams
from tests.services.scheduler.test_scheduler import (
    FakeWorker, expected_tokens, make_scheduler, request, run_to_completion,
)


def test_requests_that_run_to_max_tokens_are_not_preempted():
    """6 requests of 4 + 20 tokens (6 blocks each) on 12 blocks: without the reserve all
    start and most are preempted (the scheduler tests' case); with it two run at a time,
    none is computed twice, and every one gets its exact tokens."""
    scheduler, worker = make_scheduler(num_blocks=12, max_num_batched_tokens=32), FakeWorker(12)
    for i in range(6):
        scheduler.add_request(request(f"r{i}", 4, 20, ignore_eos=True))
    outputs, _, plans = run_to_completion(scheduler, worker, depth=2)
    assert scheduler.num_preemptions == 0
    assert max(len(p.new_requests) for p in plans) <= 2
    for i in range(6):
        assert outputs[f"r{i}"] == expected_tokens(f"r{i}", 4, 20)
    unreserved, worker = make_scheduler(num_blocks=12, max_num_batched_tokens=32,
                                        admission_reserve=False), FakeWorker(12)
    for i in range(6):
        unreserved.add_request(request(f"r{i}", 4, 20, ignore_eos=True))
    run_to_completion(unreserved, worker, depth=2)
    assert unreserved.num_preemptions > 0


def test_a_request_whose_growth_exceeds_the_cache_still_runs_alone():
    """The reserve only holds back requests behind running ones: one that fits its prompt
    but could not keep room for all of its max_tokens starts when nothing runs."""
    scheduler, worker = make_scheduler(num_blocks=6, max_num_batched_tokens=32), FakeWorker(6)
    scheduler.add_request(request("big", 4, 20, ignore_eos=True))
    outputs, _, _ = run_to_completion(scheduler, worker)
    assert outputs["big"] == expected_tokens("big", 4, 20)


def sized(num_outputs: int, max_tokens: int) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens), "out", (0, 0),
                   output_token_ids=[7] * num_outputs)


def test_the_share_follows_finished_requests_and_rises_on_preemption():
    reserve = AdmissionReserve(block_size=16)
    assert reserve.ratio == 1.0  # nothing known: room for every token asked
    for _ in range(20):
        reserve.on_finished(sized(10, 100))  # answers end at a tenth of max_tokens
    assert 0.1 <= reserve.ratio < 0.12
    reserve.on_preempted()
    assert 0.2 <= reserve.ratio < 0.22
    for _ in range(30):
        reserve.on_finished(sized(100, 100))
    assert reserve.ratio > 0.99


def test_room_counts_the_prompt_left_and_a_clipped_share_of_the_output():
    reserve = AdmissionReserve(block_size=16)
    reserve.ratio = 0.5
    # 100 tokens may still come (max_tokens 110, 10 written): half kept, plus 20 of prompt;
    # its 3 blocks free when it ends
    assert reserve.commitment(sized(10, 110), 3, 20, max_model_len=10_000) == \
        Commitment(48, 20, 50.0)
    # max_tokens up to the context counts at most MAX_COUNTED_TOKENS, and its end is not
    # counted on (its blocks would free too late)
    huge = sized(0, 100_000)
    assert reserve.commitment(huge, 3, 0, max_model_len=200_000) == \
        Commitment(0, 0, 0.5 * MAX_COUNTED_TOKENS)
    assert reserve.blocks_for(70) == 5
    assert AdmissionReserve(16, enabled=False).commitment(huge, 3, 9, 200_000) == \
        Commitment(0, 0, 0.0)


def brute_force_peak(commitments: list[Commitment]) -> float:
    """Step by step: at step t a request still running (it writes its last token at step
    growth) holds its blocks, its prompt and t tokens; one that has ended holds nothing."""
    horizon = int(max(c.growth for c in commitments)) + 1
    held_now = sum(c.held_tokens for c in commitments)
    return max(sum(c.held_tokens + c.prompt_left + t for c in commitments if t <= c.growth)
               - held_now for t in range(horizon))


def test_the_need_peaks_before_the_long_ones_end_not_at_the_sum():
    # one long answer and many short ones: the short ones free their blocks first
    mix = [Commitment(160, 0, 1000.0)] + [Commitment(32, 8, 20.0)] * 50
    assert peak_need(*zip(*mix)) == brute_force_peak(mix)
    assert peak_need(*zip(*mix)) < 1000 + 50 * (8 + 20)  # the sum the reserve used to keep
    # identical answers all run to the end together: their peak is the sum
    same = [Commitment(64, 4, 100.0)] * 10
    assert peak_need(*zip(*same)) == brute_force_peak(same) == 10 * (4 + 100)
    # a prompt still to fill counts at once, even for a request about to end
    assert peak_need(*zip(Commitment(0, 500, 0.0), Commitment(16, 0, 10.0))) == 500
    assert peak_need([], [], []) == 0.0


def test_the_peak_matches_a_step_by_step_count_on_random_mixes():
    rng = random.Random(0)
    for _ in range(200):
        mix = [Commitment(16 * rng.randint(0, 20), rng.choice((0, 0, rng.randint(1, 64))),
                          float(rng.randint(0, 60))) for _ in range(rng.randint(1, 12))]
        assert peak_need(*zip(*mix)) == brute_force_peak(mix), mix


def test_short_and_long_answers_start_together_when_the_peak_fits():
    """One request of 4 + 100 tokens and five of 4 + 12 on 32 blocks of 4 tokens: the sum of
    their prompts and answers (184 tokens) would not fit, their peak does (the short ones end
    long before the long one needs its last blocks): all start at once, none is preempted
    and every one gets its exact tokens."""
    scheduler, worker = make_scheduler(num_blocks=32, max_num_batched_tokens=64), FakeWorker(32)
    scheduler.add_request(request("long", 4, 100, ignore_eos=True))
    for i in range(5):
        scheduler.add_request(request(f"short{i}", 4, 12, ignore_eos=True))
    outputs, _, plans = run_to_completion(scheduler, worker, depth=2)
    assert len(plans[0].new_requests) == 6  # all at once
    assert scheduler.num_preemptions == 0
    assert outputs["long"] == expected_tokens("long", 4, 100)
    for i in range(5):
        assert outputs[f"short{i}"] == expected_tokens(f"short{i}", 4, 12)


def test_under_the_priority_policy_room_is_kept_only_for_the_more_important():
    """A running low-priority request's growth holds back a request of its own priority,
    not a more important one (the low one would be preempted for it anyway)."""
    scheduler, worker = make_scheduler(num_blocks=12, max_num_batched_tokens=32,
                                       scheduling_policy="priority"), FakeWorker(12)
    scheduler.add_request(request("low", 4, 20, priority=5, ignore_eos=True))
    plan = scheduler.schedule()
    scheduler.update(plan, worker.execute(plan))
    scheduler.add_request(request("peer", 4, 20, priority=5, ignore_eos=True))
    scheduler.add_request(request("urgent", 4, 20, priority=-1, ignore_eos=True))
    plan = scheduler.schedule()
    assert [new.request_id for new in plan.new_requests] == ["urgent"]


def test_a_request_frees_only_the_blocks_no_other_sequence_holds():
    """Siblings share their prompt's blocks: one that ends gives back only its own."""
    from services.scheduler.block_manager import BlockManager

    blocks = BlockManager(num_blocks=8, block_size=4)
    shared, own_a, own_b = blocks.allocate(1), blocks.allocate(2), blocks.allocate(1)
    blocks.blocks[shared[0]].ref_count += 1  # the second sibling's reference
    assert blocks.num_sole(shared + own_a) == 2
    assert blocks.num_sole(shared + own_b) == 1
    reserve = AdmissionReserve(block_size=4)
    a, b = sized(0, 10), sized(0, 10)
    a.block_table, b.block_table = shared + own_a, shared + own_b
    a.num_computed_tokens = b.num_computed_tokens = 3  # their prompts are in
    kept = reserve.kept_room([a, b], max_model_len=1000, num_sole_blocks=blocks.num_sole)
    # both grow 10 tokens; just before they end they need 20 tokens beyond what they hold
    assert kept.need_with(Commitment(0, 0, 0.0), 0) == 20
    # a third request growing 100 counts on their 3 sole blocks (12 tokens) once they end,
    # not on 4
    assert kept.need_with(Commitment(0, 0, 100.0), 0) == 100 - 12
