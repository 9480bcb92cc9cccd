"""Prometheus alert rules for a flotilla fleet, llm-d's set as the model: error rate,
P99 time to first token (warning and critical), KV-cache usage, queue length,
prefix-cache hit rate. Each rule is an expression and a threshold kept apart, so the
live test can evaluate the expression alone (tests/integration/test_prometheus_live.py)."""

from __future__ import annotations

from dataclasses import dataclass

TTFT_P99 = ("histogram_quantile(0.99, sum by (le, model_name) "
            "(rate(vllm:time_to_first_token_seconds_bucket[5m])))")


@dataclass(frozen=True)
class Alert:
    name: str
    expr: str  # without the comparison
    comparison: str  # "> 0.05": appended to expr
    duration: str
    severity: str
    summary: str

    def rule(self) -> dict:
        return {"alert": self.name, "expr": f"{self.expr} {self.comparison}",
                "for": self.duration, "labels": {"severity": self.severity},
                "annotations": {"summary": self.summary}}


ALERTS = [
    # 5xx over all answers of the API; no 5xx at all is a rate of 0, not no data
    Alert("FlotillaHighErrorRate",
          '(sum(rate(flotilla_requests_total{endpoint=~"/v1/.*", status=~"5.."}[5m])) '
          'or vector(0)) / sum(rate(flotilla_requests_total{endpoint=~"/v1/.*"}[5m]))',
          "> 0.05", "5m", "critical",
          "More than 5% of API requests end in a server error ({{ $value | humanizePercentage }})"),
    Alert("FlotillaHighTimeToFirstToken", TTFT_P99, "> 10", "5m", "warning",
          "P99 time to first token of {{ $labels.model_name }} is {{ $value | humanizeDuration }}"),
    Alert("FlotillaVeryHighTimeToFirstToken", TTFT_P99, "> 30", "5m", "critical",
          "P99 time to first token of {{ $labels.model_name }} is {{ $value | humanizeDuration }}"),
    Alert("FlotillaKVCacheNearlyFull", "max by (model_name, replica_id) (vllm:kv_cache_usage_perc)",
          "> 0.9", "10m", "warning",
          "Replica {{ $labels.replica_id }} has used over 90% of its KV cache for 10 minutes"),
    Alert("FlotillaManyRequestsWaiting",
          "max by (model_name, replica_id) (vllm:num_requests_waiting)", "> 50", "5m", "warning",
          "Replica {{ $labels.replica_id }} has {{ $value }} requests waiting"),
    Alert("FlotillaLowPrefixCacheHitRate",
          "sum by (model_name) (rate(vllm:prefix_cache_hits_total[15m])) / "
          "sum by (model_name) (rate(vllm:prefix_cache_queries_total[15m]))",
          "< 0.3", "15m", "info",
          "Prefix-cache hit rate of {{ $labels.model_name }} is "
          "{{ $value | humanizePercentage }}: routing or cache size may be off"),
]


def rule_groups() -> dict:
    """The rules file (Prometheus's rule_files format, the PrometheusRule's spec)."""
    return {"groups": [{"name": "flotilla", "rules": [alert.rule() for alert in ALERTS]}]}
