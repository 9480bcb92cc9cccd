"""A MoE worker's expert routing, summed by the scheduler for its stats events: reports
add up per (layer, expert), a mismatched or negative report is refused and changes
nothing, and the sums start over when the scheduler attaches a worker again."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.scheduler.expert_counts import ExpertCounts
from services.scheduler.step_stats import StepStats
from services.scheduler.tiering import TierSpeeds
from shared.errors import ServiceUnavailable
from shared.messages import StepPlan, StepResult, decode, encode
from shared.scheduler_stats import SchedulerStats
from shared.subjects import Subjects
from tests.services.scheduler.test_drain import FakeBus, eventually, started
from tests.services.scheduler.test_scheduler import request

REPORT = [[1, 0, 3, 4], [0, 2, 2, 8]]  # 2 sparse layers x 4 experts


def test_reports_add_up_per_layer_and_expert():
    counts = ExpertCounts()
    assert counts.counts() == []
    counts.add(REPORT)
    counts.add([])  # a result without a report
    counts.add([[5, 5, 0, 0], [1, 1, 1, 1]])
    assert counts.counts() == [[6, 5, 3, 4], [1, 3, 3, 9]]
    copy = counts.counts()
    copy[0][0] = 99  # the stats event's copy is not the books
    assert counts.counts()[0][0] == 6
    counts.reset()
    assert counts.counts() == []
    counts.add([[1, 2]])  # after a reset a new layout is taken
    assert counts.counts() == [[1, 2]]


@pytest.mark.parametrize("bad, match", [
    ([[1, 0, 3, 4]], "1 layers x \\[4\\] experts do not match the earlier reports' 2 x \\[4\\]"),
    ([[1, 0, 3], [0, 2, 2, 8]], "do not match"),
    ([[1, 0, 3, 4], [0, -2, 2, 8]], "negative"),
])
def test_a_report_of_another_shape_or_negative_is_refused_and_changes_nothing(bad, match):
    counts = ExpertCounts()
    counts.add(REPORT)
    with pytest.raises(ValueError, match=match):
        counts.add(bad)
    assert counts.counts() == REPORT


def test_the_stats_event_carries_the_sums_and_skips_a_mismatched_report():
    stats = StepStats(TierSpeeds())
    plan = StepPlan(1, [], [], [], "w")
    for report in (REPORT, [], [[1]], REPORT):  # [[1]]: refused (logged), the rest summed
        stats.record_step(plan, StepResult(1, [], [], 0.01, expert_token_counts=report))
    assert stats.expert_counts.counts() == [[2, 0, 6, 8], [0, 4, 4, 16]]
    stats.worker_attached()
    assert stats.expert_counts.counts() == []


class MoeBus(FakeBus):
    """A worker that reports ``REPORT`` with every step result (a real one reports about
    once a second) and fails the steps while ``fail_steps`` is set."""

    def __init__(self) -> None:
        super().__init__(step_s=0.002)
        self.num_reports = 0
        self.fail_steps = False

    async def request(self, subject, message, reply_type, *, timeout=5.0):
        if subject == Subjects().worker_step("0"):
            if self.fail_steps:
                raise ServiceUnavailable("the worker crashed")
            result = await super().request(subject, message, reply_type, timeout=timeout)
            self.num_reports += 1
            return msgspec.structs.replace(result, expert_token_counts=REPORT)
        return await super().request(subject, message, reply_type, timeout=timeout)

    def last_moe(self) -> list[list[int]]:
        # as the gateways read it: through the wire
        return decode(encode(self.last_stats()), SchedulerStats).moe.expert_token_counts


def times(n: int) -> list[list[int]]:
    return [[n * count for count in layer] for layer in REPORT]


async def test_the_scheduler_publishes_cumulative_counts_and_starts_over_on_reattach():
    bus = MoeBus()
    service, stop, run = await started(bus)
    assert bus.last_moe() == []  # nothing reported yet
    await service._on_submit(request("a", 10, 6))
    await eventually(lambda: bus.outputs().get("a", [None])[-1] is not None
                     and bus.outputs()["a"][-1].finish_reason == "length")
    assert bus.num_reports >= 6
    await eventually(lambda: bus.last_moe() == times(bus.num_reports))

    bus.fail_steps = True  # the worker fails a step: the scheduler attaches it again
    await service._on_submit(request("b", 10, 400))
    await eventually(lambda: bus.num_attaches == 2)
    bus.fail_steps = False
    reports_before = bus.num_reports
    await service._on_submit(request("c", 10, 3))
    await eventually(lambda: bus.outputs().get("c", [None])[-1] is not None
                     and bus.outputs()["c"][-1].finish_reason == "length")
    since_attach = bus.num_reports - reports_before
    assert 0 < since_attach < bus.num_reports
    await eventually(lambda: bus.last_moe() == times(since_attach))
    stop.set()
    await asyncio.wait_for(run, 5)
