"""``flotilla bench serve`` end to end against a scripted HTTP server on a random port:
usage-only streams (a random-weight model's ids decode to no text) count, and a server
that stalls gives partial results at the --max-duration deadline instead of a hang."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import pytest

from cli.bench.deadline import EXIT_DEADLINE
from cli.main import main
from tests.cli.fake_server import FakeServer

pytestmark = pytest.mark.timeout(60)


def usage_only(num_tokens: int) -> list[dict]:
    """A stream whose chunks carry no text; the tokens are only in the usage."""
    chunk = {"choices": [{"index": 0, "text": "", "finish_reason": None}]}
    return [chunk] * num_tokens + [
        {"choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": num_tokens}}]


@pytest.fixture
def bench(tmp_path) -> Iterator[Callable[..., tuple[int, dict, float]]]:
    def run(server: FakeServer, *extra: str) -> tuple[int, dict, float]:
        result = tmp_path / "serve.json"
        started = time.perf_counter()
        code = main(["bench", "serve", "--base-url", server.base_url, "--model", "m",
                     "--tokenizer", "smollm2", "--num-prompts", "6", "--input-len", "8",
                     "--output-len", "4", "--ignore-eos", "--disable-tqdm",
                     "--result-json", str(result), *extra])
        return code, json.loads(result.read_text()), time.perf_counter() - started
    yield run


def test_usage_only_streams_are_successes_with_their_tokens(bench, capsys):
    with FakeServer(lambda call, body: usage_only(body["max_tokens"])) as server:
        code, data, _ = bench(server)
    assert code == 0 and server.calls == 7  # one warm-up and six requests
    summary = data["runs"][0]["summary"]
    assert (summary["completed"], summary["failed"], summary["outstanding"]) == (6, 0, 0)
    assert summary["completed_without_text"] == 6 and not summary["deadline_reached"]
    assert summary["total_output_tokens"] == 24 and summary["output_throughput"] > 0
    assert summary["ttft_ms"]["count"] == 6 and summary["ttft_ms"]["median"] > 0
    assert all(not r["text"] and r["num_output_tokens"] == 4 for r in data["runs"][0]["requests"])
    out = capsys.readouterr()
    assert "Completed with no text (usage only):" in out.out and "warning" not in out.err


def test_a_stalled_server_gives_partial_results_at_the_deadline(bench, capsys):
    # the warm-up and the first three requests finish; the last three stall
    with FakeServer(lambda call, body: usage_only(4) if call <= 4 else None) as server:
        code, data, elapsed_s = bench(server, "--max-duration", "2")
    assert code == EXIT_DEADLINE and elapsed_s < 15
    run = data["runs"][0]
    summary = run["summary"]
    assert summary["deadline_reached"] and summary["num_requests"] == 6
    assert (summary["completed"], summary["failed"], summary["outstanding"]) == (3, 0, 3)
    assert (summary["outstanding_in_flight"], summary["outstanding_not_sent"]) == (3, 0)
    assert summary["duration_s"] == pytest.approx(2.0, abs=1.0)
    assert len(run["requests"]) == 3 and len(run["unfinished_requests"]) == 3
    out = capsys.readouterr()
    assert "Outstanding requests (deadline):" in out.out and "cancelled in flight" in out.err


def test_a_request_that_stalls_fails_after_the_request_timeout(bench):
    with FakeServer(lambda call, body: usage_only(4) if call <= 4 else None) as server:
        code, data, elapsed_s = bench(server, "--request-timeout", "0.5", "--max-duration", "20")
    summary = data["runs"][0]["summary"]
    assert code == 0 and elapsed_s < 15 and not summary["deadline_reached"]
    assert (summary["completed"], summary["failed"], summary["outstanding"]) == (3, 3, 0)
    assert list(summary["failure_reasons"]) == ["stalled: no data for 0.5 s (--request-timeout)"]


def test_a_warm_up_without_output_warns_and_the_run_goes_on(bench, capsys):
    # the warm-up's stream ends with neither text nor usage tokens
    with FakeServer(lambda call, body: [] if call == 1 else usage_only(4)) as server:
        code, data, _ = bench(server)
    assert code == 0 and data["runs"][0]["summary"]["completed"] == 6
    assert "warning: a warm-up request failed (no output" in capsys.readouterr().err


def two_token_chunks(num_tokens: int) -> list[dict]:
    """Text chunks of two tokens each, every one with the usage so far (per-chunk usage)."""
    chunks = [{"choices": [{"index": 0, "text": "ab", "finish_reason": None}],
               "usage": {"prompt_tokens": 8, "completion_tokens": done}}
              for done in range(2, num_tokens + 1, 2)]
    return chunks + [{"choices": [], "usage": {"prompt_tokens": 8,
                                               "completion_tokens": num_tokens}}]


def test_a_request_rate_sweep_reports_goodput_stalls_and_tokens_per_chunk(bench, capsys,
                                                                          tmp_path):
    plot = tmp_path / "sweep.png"
    with FakeServer(lambda call, body: two_token_chunks(body["max_tokens"])) as server:
        code, data, _ = bench(server, "--request-rate", "200,400", "--per-chunk-usage",
                              "--goodput", "ttft:10000", "itl:10000", "--plot", str(plot))
    assert code == 0 and server.calls == 13  # one warm-up, six requests per run
    assert all(body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
               for body in server.bodies)
    runs = data["runs"]
    assert [(run["request_rate"], run["label"]) for run in runs] == [(200, "rate 200/s"),
                                                                    (400, "rate 400/s")]
    for run in runs:
        summary = run["summary"]
        assert summary["completed"] == 6 and summary["good_requests"] == 6
        assert summary["slo_ms"] == {"ttft": 10000, "itl": 10000}
        assert summary["tokens_per_chunk"]["count"] == 12
        assert summary["tokens_per_chunk"]["mean"] == 2.0
        assert summary["longest_chunk_gap_ms"]["count"] == 6
    out = capsys.readouterr().out
    assert "Request-rate sweep" in out and "Tok/chk" in out and "goodput" in out
    assert plot.stat().st_size > 0


def test_lora_modules_spread_the_requests_over_the_adapters(bench):
    models = []

    def script(call, body):
        models.append(body["model"])
        return usage_only(body["max_tokens"])

    with FakeServer(script) as server:
        code, _, _ = bench(server, "--lora-modules", "a=/x,b", "--lora-assignment",
                           "round-robin")
    # the warm-up asks the base first; the six go at once, so they arrive in any order
    assert code == 0 and models[0] == "m" and sorted(models[1:]) == ["a"] * 3 + ["b"] * 3
    models.clear()
    with FakeServer(script) as server:
        code, _, _ = bench(server, "--lora-modules", "a,b,c")
    assert code == 0 and set(models[1:]) <= {"a", "b", "c"} and "m" not in models[1:]
