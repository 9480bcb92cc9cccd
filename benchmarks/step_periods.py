"""Steps grouped by batch size, timed by the period between their results: what a run pays
a step at each size, host and device together. Plain Python, so vLLM's offline script (in
vLLM's environment, without flotilla's packages) reports the same buckets as flotilla's."""

from __future__ import annotations

SEQ_BUCKETS = (16, 64, 128, 256, 512, 1024)


def period_by_seqs(steps: list[tuple[float, int]]) -> dict[str, list[float]]:
    """(when a step's result came, its sequences) in order -> per bucket of sequences:
    [steps, total s, mean ms, mean sequences]; a step's period ends at its own result."""
    groups: dict[int, tuple[int, float, int]] = {}
    for (before, _), (when, num_seqs) in zip(steps, steps[1:]):
        bound = next((b for b in SEQ_BUCKETS if num_seqs <= b), num_seqs)
        count, total, seqs = groups.get(bound, (0, 0.0, 0))
        groups[bound] = (count + 1, total + when - before, seqs + num_seqs)
    return {f"seqs<={bound}": [count, round(total, 2), round(1e3 * total / count, 2),
                               round(seqs / count)]
            for bound, (count, total, seqs) in sorted(groups.items())}


def comparison_table(named: dict[str, dict[str, list[float]]]) -> str:
    """Several runs' ``period_by_seqs`` side by side: ms a step and steps, bucket by bucket."""
    buckets = sorted({b for periods in named.values() for b in periods},
                     key=lambda bucket: int(bucket.split("<=")[1]))
    lines = [f"{'sequences':>12}" + "".join(f"{name[:24]:>26}" for name in named)]
    for bucket in buckets:
        cells = [periods.get(bucket) for periods in named.values()]
        lines.append(f"{bucket:>12}" + "".join(
            f"{cell[2]:>14.2f} ms x{cell[0]:>6}" if cell else f"{'-':>26}" for cell in cells))
    lines.append(f"{'total s':>12}" + "".join(
        f"{sum(cell[1] for cell in periods.values()):>26.2f}" for periods in named.values()))
    return "\n".join(lines)


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    # python -m benchmarks.step_periods RESULT.json ... (each holding "period_by_seqs")
    print(comparison_table({path: json.loads(Path(path).read_text())["period_by_seqs"]
                            for path in sys.argv[1:]}))
