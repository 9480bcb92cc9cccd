"""The load-adaptive draft cap (draft_budget.py): against simulated devices whose step time
does or does not grow with a step's rows, and drafts kept more or less often, it settles on
the cap that gives the most tokens a second, per batch size, and moves when the drafts stop
being kept."""

from __future__ import annotations

import random
from collections import Counter

from services.scheduler.draft_budget import DraftBudget, size_bucket
from services.scheduler.scheduler import Scheduler
from services.scheduler.config import SchedulerConfig
from shared.messages import GenerateRequest, SamplingParams, StepResult
from shared.sections.speculative import parse_speculative_config

K = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run(budget: DraftBudget, clock: Clock, steps: int, num_running: int, step_s,
        acceptance: float, proposed: int = K, start: int = 0) -> Counter:
    """``steps`` steps of ``num_running`` decodes; step_s(rows) is the device's time for a
    step of that many rows; each request is proposed ``proposed`` drafts (within the cap),
    each kept with ``acceptance`` once the ones before it are. -> how often each cap was
    chosen."""
    draws = random.Random(start)
    chosen = Counter()
    for step_id in range(start, start + steps):
        cap = budget.cap(num_running)
        chosen[cap] += 1
        budget.planned(step_id, cap)
        drafts = []
        for _ in range(num_running):
            offered = min(cap, proposed)
            kept = next((i for i in range(offered) if draws.random() >= acceptance), offered)
            drafts.append((offered, kept))
        rows = sum(1 + offered for offered, _ in drafts)
        clock.now += step_s(rows)
        budget.step_done(step_id, rows, drafts)
    return chosen


def test_a_memory_bound_device_drafts_the_most_it_may():
    """Step time flat in rows (a GPU at batch 1), most drafts kept: K every step."""
    clock = Clock()
    budget = DraftBudget(K, clock)
    chosen = run(budget, clock, 200, 1, lambda rows: 0.005, acceptance=0.7)
    assert chosen[K] >= 195, chosen


def test_a_busy_device_with_few_kept_drafts_stops_drafting():
    """Step time in proportion to rows (a CPU, or a GPU at a large batch) and one draft in
    five kept: no drafts after the first tries."""
    clock = Clock()
    budget = DraftBudget(K, clock)
    chosen = run(budget, clock, 200, 48, lambda rows: 0.001 * rows, acceptance=0.2)
    assert chosen[0] >= 195, chosen


def test_batch_sizes_differ_and_the_cap_follows_the_drafts_kept():
    clock = Clock()
    budget = DraftBudget(K, clock)

    def step_s(rows: int) -> float:  # flat up to 8 rows, then in proportion
        return 0.004 * max(1.0, rows / 8)

    small = run(budget, clock, 100, 1, step_s, acceptance=0.8)
    large = run(budget, clock, 100, 64, step_s, acceptance=0.8, start=100)
    assert small.most_common(1)[0][0] == K and large.most_common(1)[0][0] == 0, (small, large)
    assert size_bucket(5) == 8 and size_bucket(64) == 64
    # a proposer with two drafts at most: rows counted as offered, so a cap of K costs no
    # more than 2 and is as good
    two = run(budget, clock, 50, 2, step_s, acceptance=0.8, proposed=2, start=200)
    assert sum(n for cap, n in two.items() if cap >= 2) >= 45, two
    # the copy ends: drafts are no longer kept and cost a little at batch 1 too
    def later_step_s(rows: int) -> float:
        return 0.004 + 0.0005 * rows

    learning = run(budget, clock, 100, 1, later_step_s, acceptance=0.0, start=300)
    learnt = run(budget, clock, 100, 1, later_step_s, acceptance=0.0, start=400)
    assert learnt[0] >= 90, (learning, learnt)


def test_the_period_of_an_overlapped_step_starts_at_the_result_before_it():
    """Step 2 planned while step 1 runs: its time is from step 1's result to its own."""
    clock = Clock()
    budget = DraftBudget(K, clock)
    assert budget.step_time(1) is None and budget.cap(1) == K  # nothing measured: K
    budget.planned(1, K)
    clock.now = 0.001
    budget.planned(2, K)
    clock.now = 0.010
    budget.step_done(1, 1, [(0, 0)])  # 10 ms
    clock.now = 0.015
    budget.step_done(2, 1, [(0, 0)])  # 5 ms since step 1's result
    assert abs(budget.step_time(1) - (0.7 * 0.010 + 0.3 * 0.005)) < 1e-9
    assert budget.step_time(3) == budget.step_time(1)  # a larger size: the nearest smaller's
    offered, kept = budget.offered_and_kept(0)  # drafts planned, none offered: the prior
    assert offered < 0.55 and kept == 0.5


def decode_with_drafts(keep: bool, step_s, num_steps: int = 12) -> list[int]:
    """Through the scheduler: one request on a repeating prompt, so n-gram drafts are always
    proposed; the simulated worker keeps them all or none, and each step takes
    ``step_s(rows)``. -> the drafts of each decode step."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    core = Scheduler(SchedulerConfig(speculative_config=parse_speculative_config(spec)), num_blocks=64, block_size=4,
                     max_model_len=256, eos_token_ids=[0])
    clock = Clock()
    core.drafter.budget.clock = clock
    cycle = [5, 6, 7]
    tokens = cycle * 3  # the prompt; the model goes on with the cycle
    core.add_request(GenerateRequest(request_id="r", prompt_token_ids=list(tokens),
                                     sampling=SamplingParams(temperature=0.0, max_tokens=60),
                                     output_subject="out"))
    drafted = []
    for _ in range(num_steps + 1):  # the prompt, then the decodes
        plan = core.schedule()
        drafts = plan.scheduled[0].draft_token_ids
        drafted.append(len(drafts))
        num_kept = len(drafts) if keep else 0
        tokens += drafts[:num_kept]  # each one the cycle's next
        tokens.append(cycle[len(tokens) % 3])
        clock.now += step_s(plan.scheduled[0].num_new_tokens)
        core.update(plan, StepResult(plan.step_id, ["r"], [tokens[-1]],
                                     accepted_draft_ids=[drafts[:num_kept]]))
    return drafted[1:]


def test_the_scheduler_plans_each_step_within_the_cap():
    """Drafts all kept on a device whose step time is flat: K drafts every step. None kept on
    one whose step time grows with rows: the scheduler soon plans none."""
    kept = decode_with_drafts(True, lambda rows: 0.01)
    assert kept.count(3) >= 11, kept  # (one step may try no drafts: a size not yet timed)
    rejected = decode_with_drafts(False, lambda rows: 0.01 * rows)
    assert 3 in rejected[:3] and rejected[-6:] == [0] * 6, rejected


def test_a_one_off_dear_step_does_not_stop_drafting():
    """One drafted step in the middle of a run takes 40 times a step's time (a collection
    pause): its size counts it as at most twice its average, so drafting goes on (that size
    may stay too dear: three drafts a step, not four, after it). An untimed step (a draft
    model's catch-up) leaves the step times as they were."""
    clock = Clock()
    budget = DraftBudget(K, clock)
    steps = iter(range(10_000))

    def step_s(rows: int) -> float:
        return 0.2 if next(steps) == 50 else 0.005

    chosen = run(budget, clock, 200, 1, step_s, acceptance=0.7)
    assert chosen[K] >= 45 and chosen[K - 1] + chosen[K] >= 199, chosen
    before = budget.step_time(8)
    budget.planned(500, K)
    clock.now += 1.0
    budget.step_done(500, 5, [(K, K)], timed=False)
    assert budget.step_time(8) == before


def test_a_draft_models_catch_up_leaves_its_step_untimed():
    """Through the scheduler, method draft_model at batch 1 on a device whose step time is
    flat: the first drafted step also catches the draft's cache up over the prompt (the
    result says how many tokens) and takes 50 times as long. It is not timed, and drafting
    goes on, K drafts a step. Unreported, it is its size's first period, taken whole: that
    size (a token and K drafts) is never drafted again."""
    spec = ('{"method": "draft_model", "model": "dummy:llama-3.2-1b", '
            '"num_speculative_tokens": 4}')

    def drafted(catch_up_reported: bool) -> tuple[list[int], float]:
        core = Scheduler(SchedulerConfig(speculative_config=parse_speculative_config(spec)), num_blocks=256,
                         block_size=4, max_model_len=512, eos_token_ids=[0])
        clock = Clock()
        core.drafter.budget.clock = clock
        core.add_request(GenerateRequest(
            request_id="r", prompt_token_ids=list(range(1, 301)),
            sampling=SamplingParams(temperature=0.0, max_tokens=120), output_subject="out"))
        slots, caught_up = [], False
        for _ in range(40):
            plan = core.schedule()
            scheduled = plan.scheduled[0]
            slots.append(scheduled.num_drafts)
            catch_up = 0
            if scheduled.num_drafts and not caught_up:
                catch_up, caught_up = 300, True
            clock.now += 0.25 if catch_up else 0.005
            # the worker's draft model proposed 7s; half of them kept
            kept = [[7] * (scheduled.num_drafts // 2)] if scheduled.num_drafts else []
            core.update(plan, StepResult(
                plan.step_id, ["r"], [9], accepted_draft_ids=kept,
                num_draft_catch_up_tokens=catch_up if catch_up_reported else 0))
        return slots[1:], core.drafter.budget.step_time(5)

    slots, verify_s = drafted(True)
    assert slots.count(4) >= 35 and abs(verify_s - 0.005) < 1e-9, (slots, verify_s)
    slots, verify_s = drafted(False)
    assert slots.count(4) == 1 and verify_s == 0.25, (slots, verify_s)
