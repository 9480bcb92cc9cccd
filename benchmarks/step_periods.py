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
