"""The --max-duration deadline of a ``flotilla bench serve`` sweep, which the single-turn
(serve.py) and multi-turn (multi_turn.py) runs share."""

from __future__ import annotations

import time

from cli.bench import report

DEFAULT_MAX_DURATION_S = 1800.0
# on stderr as each run starts: benchmarks/gpu/online_serve.py starts its profilers on it
RUN_STARTED = "run started:"
EXIT_DEADLINE = 3  # a run was cut short by --max-duration (its partial results are reported)


def time_left(deadline: float, max_duration: float, label: str) -> float | None:
    """Seconds left before a sweep's --max-duration deadline; None (and a notice) once it
    has passed, so the runs from the one ``label`` names on are not started."""
    remaining_s = deadline - time.monotonic()
    if remaining_s > 0:
        return remaining_s
    report.notice(f"--max-duration {max_duration:g} s has passed: the runs from {label} on "
                  "were not started")
    return None


def exit_status(runs: list[dict], num_runs_planned: int) -> int:
    """EXIT_DEADLINE if the deadline cut the benchmark short, else 1 if a run completed no
    request, else 0."""
    if len(runs) < num_runs_planned or any(r["summary"]["deadline_reached"] for r in runs):
        return EXIT_DEADLINE
    return 0 if all(r["summary"]["completed"] for r in runs) else 1
