"""The gateway's speculative-decoding metrics from the schedulers' cumulative stats: drafts,
kept drafts, verify passes, and drafts kept per position, per replica."""

from __future__ import annotations

from services.gateway.metrics import GatewayMetrics
from shared.scheduler_stats import EngineStats, SchedulerStats, SpeculationStats


def stats(replica: str, drafts: int, kept: int, steps: int, per_position: list[int],
          draft_cap: int = -1) -> SchedulerStats:
    return SchedulerStats(scheduler_id=f"sched-{replica}", replica_id=replica, timestamp=0.0,
                          engine=EngineStats(num_blocks_total=10),
                          speculation=SpeculationStats(
                              num_draft_tokens=drafts, num_accepted_drafts=kept,
                              num_drafted_steps=steps, num_accepted_per_position=per_position,
                              draft_cap=draft_cap))


def value(metrics: GatewayMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, {"scheduler_id": "sched-0", "replica_id": "0",
                                                    **labels})


def test_per_position_acceptance_and_mean_accepted_length_are_exported():
    metrics = GatewayMetrics()
    metrics.observe_scheduler(stats("0", drafts=8, kept=5, steps=2, per_position=[2, 2, 1]))
    metrics.observe_scheduler(stats("0", drafts=12, kept=6, steps=3, per_position=[3, 2, 1, 0]))
    assert value(metrics, "flotilla_spec_decode_draft_tokens_total") == 12
    assert value(metrics, "flotilla_spec_decode_accepted_tokens_total") == 6
    assert value(metrics, "flotilla_spec_decode_drafts_total") == 3  # mean kept: 6 / 3
    per_position = [value(metrics, "flotilla_spec_decode_accepted_tokens_per_pos_total",
                          position=str(i)) for i in range(4)]
    assert per_position == [3, 2, 1, 0]
    # a restarted scheduler counts from zero again: its counts add on
    metrics.observe_scheduler(stats("0", drafts=4, kept=1, steps=1, per_position=[1, 0]))
    assert value(metrics, "flotilla_spec_decode_accepted_tokens_per_pos_total",
                 position="0") == 4


def test_the_adaptive_draft_cap_is_a_gauge():
    metrics = GatewayMetrics()
    metrics.observe_scheduler(stats("0", drafts=0, kept=0, steps=0, per_position=[]))
    assert value(metrics, "flotilla_spec_decode_draft_cap") is None  # no speculation
    metrics.observe_scheduler(stats("0", drafts=8, kept=5, steps=2, per_position=[2],
                                    draft_cap=3))
    assert value(metrics, "flotilla_spec_decode_draft_cap") == 3
    metrics.observe_scheduler(stats("0", drafts=9, kept=5, steps=3, per_position=[2],
                                    draft_cap=0))
    assert value(metrics, "flotilla_spec_decode_draft_cap") == 0
