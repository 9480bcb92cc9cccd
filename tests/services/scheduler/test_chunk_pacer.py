"""Chunk pacing (--chunk-step-ratio, --max-decode-stall-ms): prompt chunks shrink so that a
step which also decodes takes at most the ratio times a decode-only step, or at most the
stall target, learned from the steps' periods."""

from __future__ import annotations

import msgspec
import pytest

from shared import limits
from services.scheduler.chunk_pacer import (
    ChunkPacer, StepClock, decode_stall_target_ms,
)
from services.scheduler.config import SchedulerConfig
from services.scheduler.scheduler import Scheduler
from shared.messages import ScheduledRequest, StepPlan
from tests.services.scheduler.test_scheduler import (
    FakeWorker, expected_tokens, make_scheduler, request,
)


def plan(*num_new_tokens: int) -> StepPlan:
    return StepPlan(0, [], [ScheduledRequest(f"r{i}", n) for i, n in enumerate(num_new_tokens)])


def test_pacer_solves_for_the_chunk_that_meets_the_target():
    pacer = ChunkPacer(ratio=2.0, max_tokens=64, min_tokens=4)
    assert pacer.chunk_budget(num_decodes=3) == 64  # nothing measured yet
    pacer.observe(plan(1, 1), 0.100)
    pacer.observe(plan(1, 1, 48), 0.400)  # the 48-token chunk cost 0.3 s; 0.1 s is allowed
    assert pacer.limit == 16
    assert pacer.chunk_budget(num_decodes=2) == 16
    assert pacer.chunk_budget(num_decodes=0) == 64  # no stream waits: the whole budget
    pacer.observe(plan(1, 16), 0.150)  # half the cost per token: the cap grows, in steps
    # running sums: 0.3 + 0.2 * (0.05 - 0.3) s over 48 + 0.2 * (16 - 48) tokens
    assert pacer.per_token_s == pytest.approx((0.3 - 0.2 * 0.25) / (48 - 0.2 * 32))
    assert pacer.limit == 17
    for _ in range(10):
        pacer.observe(plan(1, 8), 0.5)  # 50 ms a token now (a longer context)
    assert pacer.limit == 4  # never below min_tokens


def test_results_read_in_pairs_average_out():
    """A result the host reads late holds two steps' time, the one right after it almost
    none: the cost is the same as if each step had been timed alone."""
    alone, paired = (ChunkPacer(ratio=0.0, max_tokens=4096, min_tokens=16, target_s=0.3)
                     for _ in range(2))
    for _ in range(20):
        alone.observe(plan(1, 1000), 0.1)
        alone.observe(plan(1, 1000), 0.1)
        paired.observe(plan(1, 1000), 0.199)
        paired.observe(plan(1, 1000), 0.001)
    # within the running mean's swing (±11% at its weight), where taking each dearer step
    # at once settled at twice the cost
    assert abs(paired.per_token_s - alone.per_token_s) / alone.per_token_s < 0.12
    assert alone.limit == 3000 and 2600 < paired.limit < 3400


def test_a_step_without_decodes_counts_whole():
    pacer = ChunkPacer(ratio=2.0, max_tokens=64, min_tokens=4)
    pacer.observe(plan(40), 0.5)  # a prompt alone: 12.5 ms a token, overhead included
    pacer.observe(plan(1, 1), 0.1)
    assert pacer.limit == 8


def test_pacer_off_by_default_changes_nothing():
    pacer = ChunkPacer(ratio=0.0, max_tokens=64, min_tokens=4)
    pacer.observe(plan(1), 0.1)
    pacer.observe(plan(1, 60), 10.0)
    assert pacer.chunk_budget(num_decodes=5) == 64


def test_the_stall_target_is_on_by_default_for_a_gpu_workers_streams_only():
    """Unset, --max-decode-stall-ms is 300 ms for streams from a GPU worker and off on a
    CPU (and in the in-process engine); set, it is what was given, 0 turning it off."""
    assert decode_stall_target_ms(None, gpu_worker=True) == limits.GPU_DECODE_STALL_MS == 300.0
    assert decode_stall_target_ms(None, gpu_worker=False) == 0.0
    assert decode_stall_target_ms(0.0, gpu_worker=True) == 0.0
    assert decode_stall_target_ms(120.0, gpu_worker=False) == 120.0

    def target_s(config: SchedulerConfig, **kwargs) -> float:
        return Scheduler(config, num_blocks=16, block_size=4, max_model_len=64,
                         eos_token_ids=[0], **kwargs).chunk_pacer.target_s

    assert target_s(SchedulerConfig(), gpu_streams=True) == 0.3
    assert target_s(SchedulerConfig()) == 0.0
    assert target_s(SchedulerConfig(max_decode_stall_ms=0), gpu_streams=True) == 0.0
    with pytest.raises(ValueError, match="max_decode_stall_ms must be a number, 0 or more"):
        SchedulerConfig(max_decode_stall_ms=-1)


def simulated_time(step: StepPlan) -> float:
    """0.1 s per step, plus 10 ms per prompt-chunk token."""
    return 0.1 + 0.01 * sum(s.num_new_tokens for s in step.scheduled if s.num_new_tokens > 1)


def test_scheduler_paces_a_long_prompt_while_another_request_decodes():
    scheduler = make_scheduler(num_blocks=128, max_num_batched_tokens=64, chunk_step_ratio=2.0)
    worker = FakeWorker(128)
    outputs: dict[str, list[int]] = {}
    step_times: list[tuple[bool, float]] = []  # (has a decode, seconds)
    now = [0.0]
    scheduler.step_clock.clock = lambda: now[0]

    def step() -> None:
        step_plan = scheduler.schedule()
        seconds = simulated_time(step_plan)
        now[0] += seconds  # one step at a time: its period is its time
        result = msgspec.structs.replace(worker.execute(step_plan), step_time_s=2 * seconds)
        step_times.append((any(s.num_new_tokens == 1 for s in step_plan.scheduled), seconds))
        for emitted in scheduler.update(step_plan, result):
            outputs.setdefault(emitted.output.request_id, []).extend(emitted.output.new_token_ids)

    scheduler.add_request(request("short", 2, 80, ignore_eos=True))
    step(), step()  # its prompt, then a decode-only step: 0.1 s
    scheduler.add_request(request("long", 300, 2, ignore_eos=True))
    while scheduler.has_work:
        step()
    mixed = [seconds for has_decode, seconds in step_times[2:] if has_decode and seconds > 0.1]
    # The short prompt's step (0.12 s for 2 tokens, no decodes) overestimates the
    # per-token cost, so the first chunk is small; each chunk's time then corrects it, up to
    # the 10 tokens that fill the 0.2 s target, never beyond.
    assert all(seconds <= 0.2 + 1e-9 for seconds in mixed)
    assert mixed[0] < 0.2 and mixed.count(0.2) > 5
    assert outputs["long"] == expected_tokens("long", 300, 2)
    assert outputs["short"] == expected_tokens("short", 2, 80)


def test_without_decodes_a_prompt_takes_the_whole_budget():
    scheduler = make_scheduler(max_num_batched_tokens=64, chunk_step_ratio=2.0)
    scheduler.chunk_pacer.decode_step_s, scheduler.chunk_pacer.per_token_s = 0.1, 0.0125
    assert scheduler.chunk_pacer.limit == 8
    scheduler.add_request(request("long", 150, 1, ignore_eos=True))
    first = scheduler.schedule()
    assert [s.num_new_tokens for s in first.scheduled] == [64]


def test_a_stall_target_caps_mixed_steps_but_never_starves_prompts():
    pacer = ChunkPacer(ratio=0.0, max_tokens=64, min_tokens=4, target_s=0.3)
    assert pacer.limit == 64  # nothing measured yet
    pacer.observe(plan(1, 1, 48), 0.6)  # no decode-only step yet: the chunk bears it all
    assert pacer.limit == 24  # 0.3 s at 12.5 ms a token
    pacer.observe(plan(1, 1), 0.1)
    pacer.observe(plan(1, 24), 0.4)  # 12.5 ms a token beside 0.1 s of decodes
    assert pacer.limit == 16
    for _ in range(20):
        pacer.observe(plan(1, 1), 0.35)  # decodes alone past the target: still an eighth
    assert pacer.limit == 64 // 8
    both = ChunkPacer(ratio=2.0, max_tokens=64, min_tokens=4, target_s=10.0)
    both.observe(plan(1, 1), 0.1)
    both.observe(plan(1, 1, 48), 0.4)
    assert both.limit == 16  # the ratio's cap is the smaller here


def test_step_periods_are_the_gaps_between_results():
    """Overlapped steps: a step planned while the one before ran is timed from that one's
    result, not from its own plan (which included waiting behind it)."""
    now = [0.0]
    clock = StepClock(lambda: now[0])
    clock.planned(0)
    now[0] = 0.01
    clock.planned(1)  # queued behind step 0
    now[0] = 0.2
    assert clock.period(0) == 0.2
    now[0] = 0.5
    assert clock.period(1) == 0.3
    now[0] = 2.0
    clock.planned(2)  # planned after an idle second: timed from its plan
    now[0] = 2.1
    assert abs(clock.period(2) - 0.1) < 1e-12
