"""BENCHMARKS.md, generated from the measurement runs in benchmarks/results/.

    python -m benchmarks.results_page            # writes BENCHMARKS.md
    python -m benchmarks.results_page --check    # exits 1 when BENCHMARKS.md is out of date

`catalog.json` defines the machines, the peers and the workloads (with their targets) once; every
other `*.json` there is one measurement run: its machine, date (and `session`, to order runs of one
day), commit, the journal section it came from, and rows of workload / metric / value / unit /
peer / command. For each (machine, workload, metric) the newest run's row is the one shown, so a
new run's JSON and a rerun of this script are all it takes to update a row.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = ROOT / "benchmarks" / "results"
PAGE = ROOT / "BENCHMARKS.md"
CATALOG = "catalog.json"
MAX_PAGE_LINES = 250
_OPS = {">=": ("≥", lambda a, b: a >= b), "<=": ("≤", lambda a, b: a <= b),
        ">": (">", lambda a, b: a > b), "<": ("<", lambda a, b: a < b)}
_DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


@dataclass(frozen=True)
class Entry:
    """One row as shown: the newest measurement of a (machine, workload, metric)."""

    run: dict
    row: dict
    last_paired: tuple[dict, dict] | None  # an older (run, row) with a peer, when this has none


def load(results_dir: Path) -> tuple[dict, list[dict]]:
    """The catalog and every run, each run checked and tagged with its file name."""
    catalog = json.loads((results_dir / CATALOG).read_text())
    runs = []
    for path in sorted(results_dir.glob("*.json")):
        if path.name == CATALOG:
            continue
        run = json.loads(path.read_text())
        run["file"] = path.name
        check_run(run, catalog)
        runs.append(run)
    return catalog, runs


def check_run(run: dict, catalog: dict) -> None:
    """Raise ValueError naming the file for anything the page could not show truthfully."""
    where = run["file"]
    if run.get("machine") not in catalog["machines"]:
        raise ValueError(f"{where}: unknown machine {run.get('machine')!r}")
    if not _DATE.match(str(run.get("date", ""))):
        raise ValueError(f"{where}: date must be YYYY-MM-DD")
    workloads = {w["id"] for w in catalog["workloads"]}
    if not run.get("rows"):
        raise ValueError(f"{where}: no rows")
    for row in run["rows"]:
        label = f"{where}: {row.get('workload')}/{row.get('metric')}"
        if row.get("workload") not in workloads:
            raise ValueError(f"{label}: workload not in {CATALOG}")
        if not row.get("metric") or not isinstance(row.get("value"), (int, float)):
            raise ValueError(f"{label}: needs a metric and a numeric value")
        if not str(row.get("command", "")).strip():
            raise ValueError(f"{label}: needs the command that reproduces it")
        if row.get("better") not in ("higher", "lower"):
            raise ValueError(f"{label}: better must be 'higher' or 'lower'")
        peer = row.get("peer")
        if peer is not None and (not peer.get("name") or not isinstance(peer.get("value"), (int, float))):
            raise ValueError(f"{label}: a peer needs a name and a numeric value")


def current_entries(runs: list[dict]) -> dict[str, list[Entry]]:
    """Per machine, the newest row of each (workload, metric), oldest runs first in the order."""
    ordered = sorted(runs, key=lambda r: (r["date"], r.get("session", 0), r["file"]))
    newest: dict[tuple, tuple[dict, dict]] = {}
    paired: dict[tuple, tuple[dict, dict]] = {}
    for run in ordered:
        for row in run["rows"]:
            key = (run["machine"], row["workload"], row["metric"])
            newest[key] = (run, row)
            if row.get("peer"):
                paired[key] = (run, row)
    by_machine: dict[str, list[Entry]] = {}
    for key, (run, row) in newest.items():
        older = paired.get(key) if not row.get("peer") else None
        by_machine.setdefault(key[0], []).append(Entry(run, row, older))
    return by_machine


def fmt(value: float) -> str:
    """A figure as measured: thousands separated, the decimals it was written with."""
    if isinstance(value, int):
        return f"{value:,}"
    decimals = len(repr(float(value)).split(".")[1])
    return f"{value:,.{decimals}f}"


def speed_ratio(row: dict) -> float | None:
    """How many times flotilla's figure is better than the peer's (> 1: flotilla ahead)."""
    peer = row.get("peer")
    if not peer or not peer["value"] or not row["value"]:
        return None
    if row["better"] == "lower":
        return peer["value"] / row["value"]
    return row["value"] / peer["value"]


def render_targets(targets: list[dict], row: dict, ratio: float | None) -> str:
    parts = []
    for target in targets:
        symbol, holds = _OPS[target["op"]]
        if target["on"] == "ratio":
            text, measured = f"{symbol} {fmt(target['value'])}× peer", ratio
        else:
            unit = target.get("unit", "")
            text, measured = f"{symbol} {with_unit(fmt(target['value']), unit)}", row["value"]
        verdict = "n/a" if measured is None else ("met" if holds(measured, target["value"]) else "**missed**")
        parts.append(f"{text} (#{target['issue']}): {verdict}")
    return "; ".join(parts) or "—"


def with_unit(number: str, unit: str) -> str:
    """'5.1×', '81.1% of copy bw', '4.62 ms/token': units that are a sign go without a space."""
    if not unit:
        return number
    return number + (unit if unit[0] in "×%" else " " + unit)


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_machine(machine: dict, entries: list[Entry], catalog: dict) -> list[str]:
    order = {w["id"]: i for i, w in enumerate(catalog["workloads"])}
    workloads = {w["id"]: w for w in catalog["workloads"]}
    entries = sorted(entries, key=lambda e: order[e.row["workload"]])
    lines = [f"## {machine['title']}", "", "Machine: " + machine["about"], "",
             "| workload | metric | flotilla | peer | ratio | target | date | command |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes: list[str] = []
    for entry in entries:
        run, row = entry.run, entry.row
        ratio = speed_ratio(row)
        peer = row.get("peer")
        marks = []
        for note in entry_notes(entry):
            notes.append(note)
            marks.append(f"[{len(notes)}]")
        workload = workloads[row["workload"]]
        targets = workload.get("targets", {}).get(row["metric"], [])
        commit = row.get("commit") or run.get("commit")
        lines.append("| " + " | ".join([
            f"`{row['workload']}` {workload['name']}",
            cell(row["metric"]) + (" " + " ".join(marks) if marks else ""),
            with_unit(f"**{fmt(row['value'])}**", row["unit"]),
            f"{peer['name']}: {fmt(peer['value'])}" if peer else "n/a",
            f"{ratio:.2f}×" if ratio is not None else "—",
            render_targets(targets, row, ratio),
            run["date"] + (f" ({cell(commit)})" if commit else ""),
            f"`{cell(row['command'])}`",
        ]) + " |")
    lines.append("")
    lines += [f"{i}. {note}" for i, note in enumerate(notes, 1)]
    return lines + ([""] if notes else [])


def entry_notes(entry: Entry) -> list[str]:
    notes = [entry.row["note"]] if entry.row.get("note") else []
    if entry.last_paired:
        run, row = entry.last_paired
        notes.append(f"No peer in this run, so none is comparable. The last same-run comparison, "
                     f"{run['date']}: {fmt(row['value'])} vs {row['peer']['name']} "
                     f"{fmt(row['peer']['value'])} {row['unit']} ({speed_ratio(row):.2f}×).")
    return notes


INTRO = """\
<!-- Generated by `python -m benchmarks.results_page` from benchmarks/results/*.json: edit those, not this page. -->
# Benchmarks

flotilla's current figures, one table per machine kind. Each row is the newest measurement of one
workload's metric, with the command that reproduces it (run from the repository root; the GPU
stages of `benchmarks/gpu/device_run.sh` expect the wheels the device lacks in `.whl/` and the dummy
model directories in `.devmodels/`). Compare figures only within one machine kind.

- **peer**: vLLM where a same-machine, same-token-ids, same-run comparison exists (another named
  engine where the row says so); **n/a** where none does: a peer figure from another run is not
  comparable, since both engines' figures move between leases.
- **ratio**: how many times flotilla's figure beats the peer's (> 1: flotilla ahead; for times,
  the peer's time over flotilla's). Targets come from the issues (#N) that set them.
- The raw runs, one JSON file per measurement run, are in `benchmarks/results/`; the measurement
  history (the journal this page replaced) is in git: `git log -p -- BENCHMARKS.md`. Why a design
  or a default is what it is lives in the docs it explains: docs/bench.md ("Measuring"),
  docs/kvstore.md, docs/routing.md.
"""

ADDING = """\
## Adding a result

A run's JSON in `benchmarks/results/`, then `python -m benchmarks.results_page`: the fields and
an example are in docs/bench.md ("Adding a result to BENCHMARKS.md").
"""


def render_workloads(catalog: dict) -> list[str]:
    lines = ["## Workloads", "",
             "| id | workload | model / architecture | prompts | input / output | dataset | how it runs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for w in catalog["workloads"]:
        fields = [f"`{w['id']}`", w["name"], w["model"], w["prompts"], w["lengths"], w["dataset"], w["launch"]]
        lines.append("| " + " | ".join(cell(f) for f in fields) + " |")
    lines += ["", "Peers:"]
    lines += [f"- `{key}`: {text}" for key, text in catalog["peers"].items()]
    return lines + [""]


def render_page(catalog: dict, runs: list[dict]) -> str:
    entries = current_entries(runs)
    lines = INTRO.splitlines() + [""] + render_workloads(catalog)
    for key, machine in catalog["machines"].items():
        if key in entries:
            lines += render_machine(machine, entries[key], catalog)
    lines += ADDING.splitlines()
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is out of date")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--page", type=Path, default=PAGE)
    args = parser.parse_args(argv)
    catalog, runs = load(args.results_dir)
    page = render_page(catalog, runs)
    if page.count("\n") > MAX_PAGE_LINES:
        print(f"the page would be {page.count(chr(10))} lines (at most {MAX_PAGE_LINES})", file=sys.stderr)
        return 1
    if args.check:
        if not args.page.exists() or args.page.read_text() != page:
            print(f"{args.page} is out of date: run python -m benchmarks.results_page", file=sys.stderr)
            return 1
        return 0
    args.page.write_text(page)
    print(f"wrote {args.page} ({page.count(chr(10))} lines, {len(runs)} runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
