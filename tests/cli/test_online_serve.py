"""benchmarks/gpu/online_serve.py's pure parts: readiness, the bench command, the table.
(The script itself is checked end to end on the CPU: docs/bench.md.)"""

from __future__ import annotations

import argparse
import sys

import pytest

from benchmarks.gpu import online_serve


@pytest.fixture(scope="module")
def online():
    return online_serve


def summary(completed: int, outstanding: int, total_tok_s: float) -> dict:
    latency = {"median": 12.0, "p99": 40.0}
    return {"completed": completed, "failed": 0, "outstanding": outstanding,
            "request_throughput": 2.0, "output_throughput": 100.0,
            "total_token_throughput": total_tok_s, "ttft_ms": latency,
            "itl_ms": {"median": None, "p99": None}}


def test_flotilla_is_ready_when_every_worker_is(online):
    assert not online.flotilla_ready(None)
    assert not online.flotilla_ready({"status": "ok", "replicas": {}})
    assert not online.flotilla_ready({"status": "ok", "replicas": {"0": {"worker_ready": False}}})
    assert not online.flotilla_ready({"status": "unavailable",
                                      "replicas": {"0": {"worker_ready": True}}})
    assert online.flotilla_ready({"status": "ok", "replicas": {"0": {"worker_ready": True}}})


def test_both_engines_get_the_same_bench_command_but_the_url(online, tmp_path):
    args = argparse.Namespace(dataset_name="sharegpt", num_prompts=1000, request_rate="inf",
                              seed=0, dataset_path=None, bench_args="--num-warmups 2")
    one, other = (online.bench_command(args, url, "dummy-x", "/m", 150.0, tmp_path / "r.json")
                  for url in ("http://127.0.0.1:1", "http://127.0.0.1:2"))
    assert one[0] == sys.executable and one[1:5] == ["-m", "cli.main", "bench", "serve"]
    differ = [i for i, (a, b) in enumerate(zip(one, other)) if a != b]
    assert [one[i - 1] for i in differ] == ["--base-url"]
    for flag, value in (("--tokenizer", "/m"), ("--max-duration", "150"), ("--seed", "0"),
                        ("--request-rate", "inf"), ("--num-warmups", "2")):
        assert one[one.index(flag) + 1] == value
    assert "--ignore-eos" in one


def test_the_table_has_each_engine_and_the_ratio(online):
    text = online.table([
        {"engine": "flotilla", "status": "cut short", "summary": summary(900, 100, 5000.0)},
        {"engine": "vllm", "status": "ok", "summary": summary(1000, 0, 10000.0)}])
    assert "900/0/100" in text and "cut short" in text and "1000/0/0" in text
    assert "flotilla/vllm total tok/s: 0.50" in text
    skipped = online.table([{"engine": "vllm", "status": "skipped: out of time"}])
    assert "skipped: out of time" in skipped
