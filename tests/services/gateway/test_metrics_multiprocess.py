"""Several gateway processes sharing PROMETHEUS_MULTIPROC_DIR (flotilla serve
--gateway-workers): a scrape of any one sums the gateways' own figures over every process
(an exited one's included) and gives the schedulers' figures, which every process hears
alike, once, not once per process. Real processes: multiprocess mode is chosen when
prometheus_client is imported."""

from __future__ import annotations

import json
import subprocess
import sys

from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]

# one gateway process: its own traffic, and the same scheduler stats every process hears
GATEWAY = """
import json, sys
from services.gateway.metrics import GatewayMetrics, multiprocess
from shared.scheduler_stats import EngineStats, SchedulerStats
index, prompt_tokens, chunks = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
metrics = GatewayMetrics(fleet_metrics=index == 0)
assert multiprocess()
metrics.prompt_tokens.inc(prompt_tokens)
metrics.requests_finished.labels("stop").inc()
metrics.time_to_first_token.observe(0.05 * (index + 1))
for _ in range(chunks):
    metrics.inter_token_latency.observe(0.01)
for queries in (40, 100):  # cumulative on the scheduler
    metrics.observe_scheduler(SchedulerStats(
        scheduler_id="sched-0", replica_id="0", timestamp=1.0, num_waiting=3,
        engine=EngineStats(num_blocks_used=5, num_blocks_total=10, num_prefix_queries=queries,
                           recent_step_tokens=[16, 1], recent_step_times_s=[0.02, 0.01])))
metrics.replaced("0")
sys.stdout.write(metrics.render().decode() if index == 2 else "")
metrics.flush()
"""


def run_gateway(tmp_path, index: int, prompt_tokens: int = 0, chunks: int = 0) -> str:
    done = subprocess.run([sys.executable, "-c", GATEWAY, str(index), str(prompt_tokens),
                           str(chunks)], env={"PROMETHEUS_MULTIPROC_DIR": str(tmp_path),
                                              "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return done.stdout


def samples(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, json.dumps(s.labels, sort_keys=True)): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(scraped: dict, name: str, **labels) -> float | None:
    return scraped.get((name, json.dumps(labels, sort_keys=True)))


def test_gateway_figures_are_summed_and_scheduler_figures_are_not(tmp_path):
    run_gateway(tmp_path, 0, prompt_tokens=7, chunks=3)  # exited: its counts stay
    run_gateway(tmp_path, 1, prompt_tokens=5, chunks=2)
    scraped = samples(run_gateway(tmp_path, 2))  # the third process takes the scrape
    model = {"model_name": ""}
    assert value(scraped, "flotilla_prompt_tokens_total") == 12
    assert value(scraped, "vllm:prompt_tokens_total", **model) == 12
    assert value(scraped, "vllm:request_success_total", finished_reason="stop", **model) == 3
    assert value(scraped, "vllm:time_to_first_token_seconds_count", **model) == 3
    assert value(scraped, "vllm:time_to_first_token_seconds_bucket", le="0.1", **model) == 2
    # the per-chunk histogram reaches the files at flush()
    assert value(scraped, "vllm:inter_token_latency_seconds_count", **model) == 5
    assert value(scraped, "flotilla_inter_token_latency_seconds_sum") == 0.05
    replica = {"replica_id": "0", "scheduler_id": "sched-0"}
    # every process heard the same stats: once, not three times
    assert value(scraped, "flotilla_prefix_cache_queries_total", **replica) == 100
    assert value(scraped, "vllm:num_requests_waiting", **replica, **model) == 3
    assert value(scraped, "vllm:kv_cache_usage_perc", **replica, **model) == 0.5
    # counted by the first process only (fleet_metrics): two stats of two steps each
    assert value(scraped, "flotilla_scheduled_tokens_per_step_count") == 4
    assert value(scraped, "flotilla_scheduler_replacements_total", replica_id="0") == 1
