"""Steps grouped by batch size (benchmarks/step_periods.py), the same for flotilla's offline
benchmark and vLLM's offline script, and compared side by side."""

import importlib.util
from pathlib import Path

from benchmarks.step_periods import comparison_table, period_by_seqs


def test_step_periods_grouped_by_sequences():
    # (when a step's result came, its sequences)
    records = [(0.0, 900), (0.1, 900), (0.3, 1000), (0.31, 3)]
    assert period_by_seqs(records) == {"seqs<=16": [1, 0.01, 10.0, 3],
                                       "seqs<=1024": [2, 0.3, 150.0, 950]}


def test_vllms_offline_script_loads_the_same_step_periods():
    path = Path(__file__).resolve().parents[2] / "benchmarks/peers/vllm/vllm_offline.py"
    spec = importlib.util.spec_from_file_location("vllm_offline", path)
    peer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(peer)  # stdlib imports only: vLLM loads inside main()
    records = [(0.5 * i + 0.001 * n, n) for i, n in enumerate([1000, 700, 300, 120, 60, 10, 1])]
    assert peer.load_step_periods().period_by_seqs(records) == period_by_seqs(records)


def test_two_runs_side_by_side_bucket_by_bucket():
    table = comparison_table({
        "flotilla": {"seqs<=16": [291, 5.96, 20.49, 3], "seqs<=1024": [304, 38.83, 127.73, 909]},
        "vllm": {"seqs<=16": [280, 5.5, 19.6, 3], "seqs<=64": [10, 0.2, 20.0, 40]}})
    lines = table.splitlines()
    assert lines[0].split() == ["sequences", "flotilla", "vllm"]
    assert lines[1].split() == ["seqs<=16", "20.49", "ms", "x", "291", "19.60", "ms", "x", "280"]
    assert lines[2].split() == ["seqs<=64", "-", "20.00", "ms", "x", "10"]  # in order of size
    assert lines[3].split() == ["seqs<=1024", "127.73", "ms", "x", "304", "-"]
    assert lines[4].split() == ["total", "s", "44.79", "5.70"]
