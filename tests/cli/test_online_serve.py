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
    latency = {"mean": 15.0, "median": 12.0, "p99": 40.0}
    return {"completed": completed, "failed": 0, "outstanding": outstanding,
            "request_throughput": 2.0, "output_throughput": 100.0,
            "total_token_throughput": total_tok_s, "ttft_ms": latency, "tpot_ms": latency,
            "itl_ms": {"mean": None, "median": None, "p99": None}}


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
                        ("--request-rate", "inf"), ("--num-warmups", "2"),
                        ("--timed-chunks", "tokens")):
        assert one[one.index(flag) + 1] == value
    assert "--ignore-eos" in one


def test_the_table_has_each_engine_and_the_ratio(online):
    text = online.table([
        {"engine": "flotilla", "status": "cut short", "summary": summary(900, 100, 5000.0)},
        {"engine": "vllm", "status": "ok", "summary": summary(1000, 0, 10000.0)}])
    assert "900/0/100" in text and "cut short" in text and "1000/0/0" in text
    assert "flotilla over vllm total tok/s: 0.50" in text
    skipped = online.table([{"engine": "vllm", "status": "skipped: out of time"}])
    assert "skipped: out of time" in skipped


def test_vllm_clients_result_maps_onto_the_summary(online):
    """`vllm bench serve`'s result JSON shows in the same table as flotilla bench's."""
    from benchmarks.gpu.online_clients import summary_from_vllm_client
    data = {"completed": 998, "duration": 45.0, "request_throughput": 22.1,
            "output_throughput": 5656.0, "total_token_throughput": 28280.1,
            "mean_ttft_ms": 16583.8, "median_ttft_ms": 14615.0, "p99_ttft_ms": 40132.2,
            "mean_tpot_ms": 95.6, "mean_itl_ms": 95.9, "median_itl_ms": 60.3,
            "p99_itl_ms": 427.8}
    summary = summary_from_vllm_client(data, num_prompts=1000)
    assert summary["failed"] == 2 and summary["itl_ms"]["p99"] == 427.8
    text = online.table([{"engine": "vllm", "status": "ok", "summary": summary}])
    assert "998/2/0" in text and "28280.1" in text and "95.6" in text and "427.8" in text


def test_the_metrics_digest_reads_counters_and_histogram_buckets():
    from benchmarks.gpu.online_clients import metrics_digest
    text = """# TYPE flotilla_preemptions_total counter
flotilla_preemptions_total{replica_id="0",scheduler_id="a"} 3.0
flotilla_preemptions_total{replica_id="1",scheduler_id="b"} 4.0
# TYPE flotilla_stream_tokens_per_chunk histogram
flotilla_stream_tokens_per_chunk_bucket{le="1.0"} 90.0
flotilla_stream_tokens_per_chunk_bucket{le="2.0"} 99.0
flotilla_stream_tokens_per_chunk_bucket{le="4.0"} 100.0
flotilla_stream_tokens_per_chunk_bucket{le="+Inf"} 100.0
flotilla_stream_tokens_per_chunk_count 100.0
flotilla_stream_tokens_per_chunk_sum 112.0
# TYPE flotilla_requests_total counter
flotilla_requests_total{endpoint="completions",status="200"} 9.0
"""
    digest = metrics_digest(text)
    assert digest["flotilla_preemptions"] == {"total": 7.0}
    assert digest["flotilla_stream_tokens_per_chunk"] == {
        "count": 100.0, "mean": 1.12, "p50": 1.0, "p90": 1.0, "p99": 2.0}
    assert "flotilla_requests" not in digest  # only the figures that explain gaps


def test_loads_run_in_turn_with_their_own_flags(online):
    from benchmarks.gpu.online_clients import loads_of
    args = online.argparse.Namespace(client="flotilla", dataset_name="sharegpt", num_prompts=1000,
                                     bench_args="", loads="")
    assert [load.load_name for load in loads_of(args)] == [""]
    args.loads = ('[{"name": "random", "client": "vllm", "dataset_name": "random", '
                  '"bench_args": "--random-input-len 1024"}, {"name": "sharegpt"}]')
    random, sharegpt = loads_of(args)
    assert (random.load_name, random.client, random.dataset_name) == ("random", "vllm", "random")
    assert (sharegpt.load_name, sharegpt.client, sharegpt.num_prompts) == ("sharegpt",
                                                                           "flotilla", 1000)
    args.loads = '[{"num_promts": 5}]'
    with pytest.raises(SystemExit, match="num_promts"):
        loads_of(args)
    for bad, message in (("[{", "not JSON"), ('{"name": "x"}', "a JSON list of objects")):
        args.loads = bad
        with pytest.raises(SystemExit, match=message):
            loads_of(args)
