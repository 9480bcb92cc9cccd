"""benchmarks/ is a package run as modules from the repository root
(``python -m benchmarks.<name>``, ``python -m benchmarks.gpu.<name>``): no script edits
sys.path to find the code it measures."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"


def test_benchmarks_are_packages():
    assert (BENCHMARKS / "__init__.py").is_file() and (BENCHMARKS / "gpu" / "__init__.py").is_file()


def test_no_benchmark_edits_sys_path():
    edits = [f"{path.relative_to(ROOT)}:{number}"
             for path in sorted(BENCHMARKS.rglob("*.py"))
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if "sys.path" in line]
    assert len(list(BENCHMARKS.rglob("*.py"))) > 20
    assert not edits, "run benchmarks as modules (python -m benchmarks.<name>): " + ", ".join(edits)
