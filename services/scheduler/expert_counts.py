"""A Mixture-of-Experts worker's routing, summed for the stats events (MoeStats): the
tokens each expert of each sparse layer got since the worker attached. The worker reports
its counts since its previous report on some step results only (about once a second);
this adds them up. Pure: service.py starts it over when it attaches a worker."""

from __future__ import annotations


class ExpertCounts:
    def __init__(self) -> None:
        self._counts: list[list[int]] = []  # [sparse layer][global expert id] -> tokens

    def add(self, report: list[list[int]]) -> None:
        """Add one report ([layer][expert] -> tokens since the last). A report whose shape
        differs from the first one's, or with a negative count, is refused (ValueError)
        and changes nothing: a sum over mismatched layouts would mean nothing."""
        if not report:
            return
        if any(count < 0 for layer in report for count in layer):
            raise ValueError("expert token counts must not be negative")
        if not self._counts:
            self._counts = [list(layer) for layer in report]
            return
        if [len(layer) for layer in report] != [len(layer) for layer in self._counts]:
            raise ValueError(
                f"expert token counts of {len(report)} layers x "
                f"{sorted({len(layer) for layer in report})} experts do not match the earlier "
                f"reports' {len(self._counts)} x {sorted({len(layer) for layer in self._counts})}")
        for total, layer in zip(self._counts, report):
            total[:] = [a + b for a, b in zip(total, layer)]

    def counts(self) -> list[list[int]]:
        """The sums so far (a copy); [] before the first report or for a dense model."""
        return [list(layer) for layer in self._counts]

    def reset(self) -> None:
        """A worker attached: its counts start from zero, like the engine's counters."""
        self._counts = []
