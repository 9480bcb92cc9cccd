"""benchmarks/scheduler_replay.py drives the real scheduler on a step-time model: its
figures move the way the policies say (it is how admission's reserve was chosen)."""

from benchmarks.scheduler_replay import StepModel, replay
from services.scheduler.config import SchedulerConfig

MODEL = StepModel(0.004, 2.7e-5, 2.3e-8)


def run(**config) -> dict:
    """48 requests of 256 + 64 tokens at once, on room for about 36 at their full length."""
    scheduler_config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, **config)
    return replay(scheduler_config, [(256, 64)] * 48, num_blocks=720, block_size=16,
                  max_model_len=1024, model=MODEL)


def test_the_reserve_removes_preemption_and_the_stall_target_shortens_gaps():
    without = run(admission_reserve=False)
    reserved = run()
    assert without["preemptions"] > 0 and reserved["preemptions"] == 0
    assert reserved["makespan_s"] < without["makespan_s"]
    paced = run(max_decode_stall_ms=30)
    assert paced["gap_p99_ms"] < reserved["gap_p99_ms"]
    assert paced["preemptions"] == 0 and paced["steps"] > reserved["steps"]


def test_poisson_arrivals_are_admitted_as_they_come():
    from benchmarks.scheduler_replay import poisson_arrivals

    arrivals = poisson_arrivals(48, rate=20.0, seed=0)
    assert poisson_arrivals(48, rate=float("inf"), seed=0) is None
    assert arrivals[0] == 0.0 and arrivals == sorted(arrivals) and 1.0 < arrivals[-1] < 5.0
    scheduler_config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048)
    spread = replay(scheduler_config, [(256, 64)] * 48, num_blocks=720, block_size=16,
                    max_model_len=1024, model=MODEL, arrivals_s=arrivals)
    burst = run()
    assert spread["makespan_s"] > arrivals[-1]  # the last one arrives, then runs
    assert spread["ttft_p99_s"] < burst["ttft_p99_s"]  # nobody queues behind 47 prompts
    assert spread["preemptions"] == 0 and spread["stalls_over_100ms"] == 0
