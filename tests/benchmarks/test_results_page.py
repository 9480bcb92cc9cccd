"""BENCHMARKS.md is generated from benchmarks/results/*.json: the committed page must be the
generated one, every row must carry its command, and a newer run must replace a row."""

import json
import shutil

import pytest

from benchmarks import results_page
from benchmarks.results_page import MAX_PAGE_LINES, PAGE, RESULTS_DIR, load, main, render_page


def test_the_committed_page_is_the_generated_one():
    catalog, runs = load(RESULTS_DIR)
    assert PAGE.read_text() == render_page(catalog, runs), "run: python -m benchmarks.results_page"


def test_every_row_has_a_command_and_the_page_fits():
    catalog, runs = load(RESULTS_DIR)
    rows = [row for run in runs for row in run["rows"]]
    assert rows
    assert all(row["command"].strip() for row in rows)
    assert len(PAGE.read_text().splitlines()) <= MAX_PAGE_LINES
    shown = [line for line in PAGE.read_text().splitlines() if line.startswith("| `") and "**" in line]
    assert shown and all(line.rstrip().endswith("` |") for line in shown)  # the command column


def _write_run(folder, name, **run):
    (folder / name).write_text(json.dumps(run))


def _shown_row(page, workload):
    return next(line for line in page.splitlines() if line.startswith(f"| `{workload}`") and "**" in line)


def _row(value, **extra):
    return {"workload": "b", "metric": "ms/token", "value": value, "unit": "ms/token",
            "better": "lower", "command": "bash benchmarks/gpu/device_run.sh decode", **extra}


@pytest.fixture
def results(tmp_path):
    shutil.copy(RESULTS_DIR / results_page.CATALOG, tmp_path)
    return tmp_path


def test_the_newest_run_wins_and_names_the_last_comparison(results):
    peer = {"name": "vLLM 0.26.0", "value": 4.96}
    _write_run(results, "h200-old.json", machine="h200", date="2026-11-23", session=4, rows=[_row(4.82, peer=peer)])
    _write_run(results, "h200-new.json", machine="h200", date="2026-11-23", session=6, rows=[_row(4.62)])
    page = render_page(*load(results))
    row = _shown_row(page, "b")
    assert "**4.62** ms/token" in row and "| n/a |" in row and "**missed**" in row
    assert "4.82 vs vLLM 0.26.0 4.96 ms/token (1.03×)" in page
    _write_run(results, "h200-newest.json", machine="h200", date="2026-11-27",
               rows=[_row(4.45, peer={"name": "vLLM 0.26.0", "value": 4.9})])
    row = _shown_row(render_page(*load(results)), "b")
    assert "**4.45**" in row and "1.10×" in row and "≤ 4.5 ms (#15): met" in row


def test_a_row_without_a_command_is_refused(results):
    _write_run(results, "h200-bad.json", machine="h200", date="2026-11-27", rows=[_row(4.5, command=" ")])
    with pytest.raises(ValueError, match="h200-bad.json.*command"):
        load(results)


def test_check_fails_on_a_stale_page_and_passes_once_written(results, tmp_path_factory):
    _write_run(results, "h200-run.json", machine="h200", date="2026-11-27", rows=[_row(4.5)])
    page = tmp_path_factory.mktemp("page") / "BENCHMARKS.md"
    page.write_text("stale\n")
    args = ["--results-dir", str(results), "--page", str(page)]
    assert main(["--check", *args]) == 1
    assert main(args) == 0
    assert main(["--check", *args]) == 0
