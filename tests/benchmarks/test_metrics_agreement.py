"""benchmarks/metrics_agreement.py's comparison of vLLM's names with flotilla's figures, on
hand-written scrapes: equal copies give no gap, a changed, missing or extra series gives
one, and the checks name the counts and means that do not add up."""

from __future__ import annotations

import math

from benchmarks.metrics_agreement import (
    failures, gauge_figures, histogram_figures, server_mean,
)

REPLICA = 'replica_id="0",scheduler_id="ab12"'
VLLM_REPLICA = f'model_name="m",{REPLICA}'


def scrape(waiting: float = 3, vllm_waiting: float = 3, used: float = 5, total: float = 20,
           usage: float = 0.25, ttft_count: float = 4, vllm_ttft_count: float = 4,
           ttft_sum: float = 2.0) -> str:
    """A /metrics text of one replica with one histogram on both names (the others absent)."""
    return f"""# TYPE flotilla_num_requests_waiting gauge
flotilla_num_requests_waiting{{{REPLICA}}} {waiting}
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{{{VLLM_REPLICA}}} {vllm_waiting}
# TYPE flotilla_kv_cache_blocks_used gauge
flotilla_kv_cache_blocks_used{{{REPLICA}}} {used}
# TYPE flotilla_kv_cache_blocks_total gauge
flotilla_kv_cache_blocks_total{{{REPLICA}}} {total}
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{{{VLLM_REPLICA}}} {usage}
# TYPE flotilla_time_to_first_token_seconds histogram
flotilla_time_to_first_token_seconds_bucket{{le="1.0"}} {ttft_count}
flotilla_time_to_first_token_seconds_bucket{{le="+Inf"}} {ttft_count}
flotilla_time_to_first_token_seconds_count {ttft_count}
flotilla_time_to_first_token_seconds_sum {ttft_sum}
flotilla_time_to_first_token_seconds_created 1.7e9
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{{le="1.0",model_name="m"}} {ttft_count}
vllm:time_to_first_token_seconds_bucket{{le="+Inf",model_name="m"}} {vllm_ttft_count}
vllm:time_to_first_token_seconds_count{{model_name="m"}} {vllm_ttft_count}
vllm:time_to_first_token_seconds_sum{{model_name="m"}} {ttft_sum}
"""


def test_equal_copies_have_no_gap():
    gauges = gauge_figures(scrape())
    assert gauges == {"waiting": 3, "waiting_gap": 0.0, "kv_usage": 0.25, "kv_gap": 0.0}
    ttft = histogram_figures(scrape())["ttft"]
    assert ttft == {"count": 4, "sum": 2.0, "gap": 0.0}


def test_a_changed_gauge_or_histogram_is_a_gap():
    assert gauge_figures(scrape(vllm_waiting=2))["waiting_gap"] == 1
    assert gauge_figures(scrape(usage=0.5))["kv_gap"] == 0.25
    assert histogram_figures(scrape(vllm_ttft_count=5))["ttft"]["gap"] == 1


def test_a_series_on_one_name_only_is_an_infinite_gap():
    extra = scrape() + 'vllm:num_requests_waiting{model_name="m",replica_id="1"} 0\n'
    assert gauge_figures(extra)["waiting_gap"] == math.inf
    without = "\n".join(line for line in scrape().splitlines()
                        if not line.startswith("vllm:kv_cache_usage_perc"))
    assert gauge_figures(without)["kv_gap"] == math.inf
    # e2e is on neither name in these scrapes: missing, not equal
    assert histogram_figures(scrape())["e2e"]["gap"] == math.inf


def bench(**overrides) -> dict:
    return {"num_prompts": 3, "completed": 3, "failed": 0, "ttft_mean_s": 0.6,
            "e2e_mean_s": 0.6, **overrides}


def figures(count: float, total: float) -> dict:
    return {key: {"count": count, "sum": total, "gap": 0.0}
            for key in ("ttft", "e2e", "itl", "queue")}


def test_the_checks_hold_when_counts_and_means_add_up():
    gauges = [gauge_figures(scrape())]
    # 1 warm-up before, +3 bench requests whose server-side mean, 0.5 s, is below 0.6 s
    assert failures(gauges, figures(1, 0.1), figures(4, 1.6), bench(), num_warmups=1) == []
    assert server_mean(figures(1, 0.1)["ttft"], figures(4, 1.6)["ttft"]) == 0.5


def test_the_checks_name_what_does_not_add_up():
    gauges = [gauge_figures(scrape(waiting=0, vllm_waiting=0))]
    found = failures(gauges, figures(1, 0.1), figures(5, 1.6), bench(ttft_mean_s=0.1),
                     num_warmups=1)
    assert any("waiting was 0 at every scrape" in line for line in found)
    assert any(line.startswith("ttft count 1 before") for line in found)
    assert any(line.startswith("server mean ttft") for line in found)
    gapped = [gauge_figures(scrape(vllm_waiting=4))]
    assert any(line.startswith("waiting_gap") for line in
               failures(gapped, figures(1, 0.1), figures(4, 1.6), bench(), num_warmups=1))
