"""The benchmark's arithmetic against hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest

from cli.bench.metrics import (RequestRecord, chunk_figures, chunk_gaps_s, inter_token_latencies,
                               longest_chunk_gap_s, meets_slo, num_output_tokens, percentile,
                               stats, summarize, tpot_s)


def record(ttft: float, e2e: float, num_tokens: int, **kwargs) -> RequestRecord:
    """A request whose chunks arrive evenly between TTFT and E2E, one token each."""
    step = (e2e - ttft) / (num_tokens - 1) if num_tokens > 1 else 0.0
    times = [ttft + i * step for i in range(num_tokens)]
    return RequestRecord(prompt_len=kwargs.pop("prompt_len", 10), output_len=num_tokens,
                         chunk_times_s=times, e2e_s=e2e, **kwargs)


@pytest.mark.parametrize("q, expected", [(0, 1.0), (50, 2.5), (90, 3.7), (99, 3.97), (100, 4.0)])
def test_percentile_interpolates_between_ranks(q, expected):
    assert percentile([4.0, 1.0, 3.0, 2.0], q) == pytest.approx(expected)


def test_percentile_matches_numpy_and_edge_cases():
    values = [0.3, 12.0, 5.5, 7.25, 0.01, 3.3, 9.9]
    for q in (1, 10, 33.3, 50, 90, 99):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_stats_of_five_values():
    s = stats([10.0, 20.0, 30.0, 40.0, 100.0])
    assert (s.mean, s.median, s.min, s.max, s.count) == (40.0, 30.0, 10.0, 100.0, 5)
    assert s.p90 == pytest.approx(76.0)  # rank 3.6: 40 + 0.6 * 60
    assert s.p99 == pytest.approx(97.6)  # rank 3.96: 40 + 0.96 * 60
    assert stats([]).count == 0 and math.isnan(stats([]).mean)


def test_itl_is_the_gap_between_chunks():
    assert inter_token_latencies([0.1, 0.15, 0.3, 0.31]) == pytest.approx([0.05, 0.15, 0.01])
    assert inter_token_latencies([0.5]) == []


def test_itl_splits_a_gap_over_the_tokens_of_its_chunk():
    # chunk 1 carried 2 tokens 50 ms after chunk 0, chunk 3 carried 3 tokens 10 ms later
    itls = inter_token_latencies([0.1, 0.15, 0.3, 0.31], [1, 2, 1, 3])
    assert itls == pytest.approx([0.025, 0.025, 0.15, 0.01 / 3, 0.01 / 3, 0.01 / 3])


def test_tpot_excludes_the_first_token():
    assert tpot_s(record(ttft=0.1, e2e=1.0, num_tokens=10)) == pytest.approx(0.1)
    assert tpot_s(record(ttft=0.2, e2e=0.2, num_tokens=1)) is None


def test_output_tokens_prefer_the_server_usage():
    two_chunks = RequestRecord(prompt_len=5, output_len=8, chunk_times_s=[0.1, 0.2], e2e_s=0.3)
    assert num_output_tokens(two_chunks) == 2  # fallback: one per chunk
    two_chunks.num_output_tokens = 8  # a chunk can carry several tokens
    assert num_output_tokens(two_chunks) == 8
    # TPOT uses the usage count: (0.3 - 0.1) / 7
    assert tpot_s(two_chunks) == pytest.approx(0.2 / 7)


def test_slo_checks_every_given_limit():
    fast = record(ttft=0.1, e2e=0.5, num_tokens=5)  # tpot 0.1
    assert meets_slo(fast, {"ttft": 0.2, "tpot": 0.1})
    assert not meets_slo(fast, {"ttft": 0.05})
    assert not meets_slo(fast, {"tpot": 0.099})
    assert not meets_slo(fast, {"e2e": 0.4})
    assert meets_slo(record(ttft=0.1, e2e=0.1, num_tokens=1), {"tpot": 0.001})  # no TPOT


def test_the_itl_slo_bounds_a_requests_longest_chunk_gap():
    # chunks at 0.1, 0.15, 0.45, 0.5: gaps 50, 300, 50 ms; the mean gap (TPOT) is ~133 ms
    bursty = RequestRecord(prompt_len=4, output_len=4, chunk_times_s=[0.1, 0.15, 0.45, 0.5],
                           e2e_s=0.5)
    assert chunk_gaps_s(bursty) == pytest.approx([0.05, 0.3, 0.05])
    assert longest_chunk_gap_s(bursty) == pytest.approx(0.3)
    assert meets_slo(bursty, {"itl": 0.31}) and not meets_slo(bursty, {"itl": 0.29})
    assert meets_slo(bursty, {"tpot": 0.14})  # the mean hides the stall the itl SLO sees
    one_chunk = RequestRecord(prompt_len=4, output_len=4, chunk_times_s=[0.2], e2e_s=0.2)
    assert longest_chunk_gap_s(one_chunk) == 0.0 and meets_slo(one_chunk, {"itl": 0.001})


def test_chunk_figures_gaps_stalls_and_tokens_per_chunk():
    told = RequestRecord(prompt_len=4, output_len=6, chunk_times_s=[0.1, 0.2, 0.6],
                         chunk_num_tokens=[1, 2, 3], e2e_s=0.6)
    untold = RequestRecord(prompt_len=4, output_len=2, chunk_times_s=[0.1, 0.3], e2e_s=0.3)
    figures = chunk_figures([told, untold])
    assert figures["chunk_gap_ms"]["count"] == 3
    assert figures["chunk_gap_ms"]["max"] == pytest.approx(400)
    assert figures["chunk_gap_ms"]["median"] == pytest.approx(200)
    assert sorted([figures["longest_chunk_gap_ms"]["min"],
                   figures["longest_chunk_gap_ms"]["max"]]) == pytest.approx([200, 400])
    assert figures["tokens_per_chunk"]["count"] == 3  # only the server that said
    assert figures["tokens_per_chunk"]["mean"] == pytest.approx(2.0)
    assert chunk_figures([untold])["tokens_per_chunk"]["count"] == 0


def test_summary_of_a_run_with_a_failure():
    records = [
        record(ttft=0.1, e2e=0.5, num_tokens=5, prompt_len=10),  # tpot 0.1: good
        record(ttft=0.3, e2e=0.7, num_tokens=5, prompt_len=20),  # ttft too slow
        record(ttft=0.2, e2e=1.0, num_tokens=5, prompt_len=30),  # tpot 0.2: too slow
        record(ttft=0.1, e2e=0.3, num_tokens=3, prompt_len=40),  # tpot 0.1: good
        RequestRecord(prompt_len=50, output_len=5, error="HTTP 503: busy"),
        RequestRecord(prompt_len=50, output_len=5, error="HTTP 503: busy"),
    ]
    records[3].num_prompt_tokens = 41  # the server's count wins
    summary = summarize(records, duration_s=2.0, slo_s={"ttft": 0.25, "tpot": 0.15})
    assert (summary["completed"], summary["failed"]) == (4, 2)
    assert summary["failure_reasons"] == {"HTTP 503: busy": 2}
    assert summary["total_input_tokens"] == 10 + 20 + 30 + 41
    assert summary["total_output_tokens"] == 18
    assert summary["request_throughput"] == pytest.approx(2.0)
    assert summary["output_throughput"] == pytest.approx(9.0)
    assert summary["total_token_throughput"] == pytest.approx((101 + 18) / 2.0)
    assert summary["good_requests"] == 2
    assert summary["goodput"] == pytest.approx(1.0)
    assert summary["ttft_ms"]["mean"] == pytest.approx(175.0)
    assert summary["ttft_ms"]["median"] == pytest.approx(150.0)
    assert summary["tpot_ms"]["mean"] == pytest.approx(125.0)  # 100, 100, 200, 100
    assert summary["e2e_ms"]["max"] == pytest.approx(1000.0)
    assert summary["itl_ms"]["count"] == 4 + 4 + 4 + 2


def test_summary_without_completions_has_no_figures():
    summary = summarize([RequestRecord(prompt_len=1, output_len=1, error="boom")], 1.0)
    assert summary["completed"] == 0 and summary["output_throughput"] == 0.0
    assert math.isnan(summary["ttft_ms"]["mean"])


def test_slo_misses_say_whether_the_others_streaming_were_stalled_too():
    from cli.bench.metrics import slo_misses
    from cli.bench.report import slo_miss_line

    # the missed request: sent at 1.0 s, chunks at 1.1, 1.2, then 1.5 (a 300 ms gap)
    missed = RequestRecord(prompt_len=10, output_len=3, start_s=1.0,
                           chunk_times_s=[0.1, 0.2, 0.5], e2e_s=0.5)
    # streaming through the gap (1.2 - 1.5 s): one kept getting chunks (at most 80 ms
    # apart in it), one got a chunk 10 ms in and then none (stalled: 290 of its 300 ms)
    talking = RequestRecord(prompt_len=10, output_len=5, start_s=0.9,
                            chunk_times_s=[0.1, 0.37, 0.45, 0.52, 0.8], e2e_s=0.8)
    stalled = RequestRecord(prompt_len=10, output_len=3, start_s=0.8,
                            chunk_times_s=[0.1, 0.41, 0.9], e2e_s=0.9)
    later = RequestRecord(prompt_len=10, output_len=3, start_s=2.0,
                          chunk_times_s=[0.1, 0.2, 0.3], e2e_s=0.3)  # not in flight then
    # queued before the gap, its first chunk inside it: not streaming through it
    joined = RequestRecord(prompt_len=10, output_len=3, start_s=1.1,
                           chunk_times_s=[0.2, 0.3, 0.55], e2e_s=0.55)
    misses = slo_misses([missed, talking, stalled, later, joined], {"itl": 0.29})
    assert misses[0] == {"start_s": 1.0, "ttft_ms": 100.0, "longest_gap_ms": 300.0,
                         "num_output_tokens": 3, "gap_after_chunk": 1, "gap_ended_s": 1.5,
                         "others_streaming": 2, "others_stalled": 1}
    assert [m["start_s"] for m in misses] == [1.0, 0.8]  # the others' gaps are under 290 ms
    assert len(slo_misses([missed, talking, stalled, later], {"itl": 0.29}, limit=1)) == 1
    assert slo_miss_line(misses[0]) == ("  outside: sent at 1.00 s, TTFT 100 ms, longest gap "
                                        "300 ms (after chunk 1, ended at 1.50 s; 1 of 2 others "
                                        "stalled too)")
    assert summarize([missed, later], 3.0, {"itl": 0.25})["slo_misses"][0]["start_s"] == 1.0
    # with the run's start on the wall clock, the gap's end in UTC (to find in server logs)
    timed = slo_misses([missed, talking], {"itl": 0.29}, started_unix=1_800_000_000.25)[0]
    assert timed["gap_ended_utc"] == "08:00:01.750"  # 2027-01-15 08:00:00.25 UTC + 1.5 s
    assert slo_miss_line(timed).endswith("ended at 1.50 s = 08:00:01.750 UTC; "
                                         "0 of 1 others stalled too)")
