"""The load-adaptive draft cap (draft_budget.py): against simulated devices whose step time
does or does not grow with a step's rows, it settles on the cap that delivers the most
tokens a second, per batch size, and moves when the workload changes."""

from __future__ import annotations

from collections import Counter

from services.scheduler.draft_budget import EXPLORE_EVERY, DraftBudget, batch_bucket
from services.scheduler.scheduler import Scheduler
from services.scheduler.config import SchedulerConfig
from shared.messages import GenerateRequest, SamplingParams, StepResult

K = 4


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def kept_per_request(cap: int, acceptance: float) -> float:
    """Output tokens a request gets from a step with ``cap`` drafts, each kept with
    ``acceptance`` once the ones before it are: 1 + a + a^2 + ... (cap terms)."""
    return 1 + sum(acceptance ** i for i in range(1, cap + 1))


def run(budget: DraftBudget, clock: Clock, steps: int, num_running: int, step_s, acceptance,
        start: int = 0) -> Counter:
    """``steps`` steps at ``num_running`` requests; step_s(rows) the device's time for a step
    of that many rows. -> how often each cap was chosen."""
    chosen = Counter()
    for step_id in range(start, start + steps):
        cap = budget.cap(num_running)
        chosen[cap] += 1
        budget.planned(step_id, decodes_only=True)
        clock.now += step_s(num_running * (1 + cap))
        budget.step_done(step_id, round(num_running * kept_per_request(cap, acceptance)))
    return chosen


def test_a_memory_bound_device_drafts_the_most_it_may():
    """Step time flat in rows (a GPU at batch 1): K drafts deliver most; the other caps are
    only tried now and then."""
    clock = Clock()
    budget = DraftBudget(K, clock)
    chosen = run(budget, clock, 400, 1, lambda rows: 0.005, acceptance=0.7)
    assert chosen[K] >= 400 * (1 - 1.5 / EXPLORE_EVERY), chosen
    assert max(budget.rates(1), key=budget.rates(1).get) == K


def test_a_busy_device_with_few_kept_drafts_stops_drafting():
    """Step time in proportion to rows (a CPU, or a GPU at a large batch) and one draft in
    five kept: no drafts deliver most."""
    clock = Clock()
    budget = DraftBudget(K, clock)
    chosen = run(budget, clock, 400, 48, lambda rows: 0.001 * rows, acceptance=0.2)
    assert chosen[0] >= 400 * (1 - 1.5 / EXPLORE_EVERY), chosen


def test_batch_sizes_learn_apart_and_a_workload_change_moves_the_cap():
    clock = Clock()
    budget = DraftBudget(K, clock)

    def step_s(rows: int) -> float:  # flat up to 8 rows, then in proportion
        return 0.004 * max(1.0, rows / 8)

    small = run(budget, clock, 200, 1, step_s, acceptance=0.8)
    large = run(budget, clock, 200, 64, step_s, acceptance=0.8, start=200)
    assert small.most_common(1)[0][0] == K and large.most_common(1)[0][0] == 0
    assert batch_bucket(1) != batch_bucket(64) == batch_bucket(40)
    # the copy ends: drafts are no longer kept, and they cost a little at batch 1 too
    later = run(budget, clock, 400, 1, lambda rows: 0.004 + 0.0005 * rows, acceptance=0.0,
                start=400)
    assert later[0] + later[1] >= 300, later


def test_the_period_of_an_overlapped_step_starts_at_the_result_before_it():
    """Step 2 planned while step 1 runs: its time is from step 1's result to its own, not
    from its plan; a step with prompt chunks is not counted."""
    clock = Clock()
    budget = DraftBudget(K, clock)
    assert budget.cap(1) == K
    budget.planned(1, decodes_only=True)
    clock.now = 0.001
    budget.planned(2, decodes_only=True)  # (its cap: the same choice)
    clock.now = 0.010
    budget.step_done(1, 10)  # 10 tokens in 10 ms
    clock.now = 0.015
    budget.step_done(2, 10)  # 10 tokens in 5 ms (since step 1's result)
    rate = budget.rates(1)[K]
    assert abs(rate - ((1 - 0.2) * 1000 + 0.2 * 2000)) < 1e-6
    budget.cap(1)
    budget.planned(3, decodes_only=False)  # a prompt chunk rode along
    clock.now = 1.0
    budget.step_done(3, 1)
    assert budget.rates(1) == {K: rate}


def test_the_scheduler_drafts_within_the_cap_it_chose():
    """Through the scheduler: a repeating prompt gets K drafts at first (an untried cap),
    then none on the step that tries no drafts, as the books say."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    core = Scheduler(SchedulerConfig(speculative_config=spec), num_blocks=64, block_size=4,
                     max_model_len=256, eos_token_ids=[0])
    clock = Clock()
    core.drafter.budget.clock = clock
    cycle = [5, 6, 7]
    tokens = cycle * 3  # the prompt; the model goes on with the cycle
    core.add_request(GenerateRequest(request_id="r", prompt_token_ids=list(tokens),
                                     sampling=SamplingParams(temperature=0.0, max_tokens=40),
                                     output_subject="out"))
    drafted = []
    for _ in range(4):  # the prompt, then three decodes
        plan = core.schedule()
        drafts = plan.scheduled[0].draft_token_ids
        drafted.append(len(drafts))
        tokens += drafts  # each one the cycle's next: all kept
        tokens.append(cycle[len(tokens) % 3])
        clock.now += 0.01
        core.update(plan, StepResult(plan.step_id, ["r"], [tokens[-1]],
                                     num_accepted_drafts=[len(drafts)]))
    drafted = drafted[1:]
    assert drafted[:2] == [3, 0], drafted  # K first, then none: both measured
    assert core.drafter.budget.rates(1)[3] > core.drafter.budget.rates(1)[0]
    assert drafted[2] == 3  # K delivered more tokens a second
