"""A real Prometheus scrapes a live stack (two gateway processes on one port; two replicas,
so KV-aware routing has a choice to make; ngram speculation; a LoRA adapter; the kvstore's
metrics port) and every query of every shipped dashboard and alert rule returns a series
(issue 54). Method, for the rules: each alert's
expression is evaluated without its threshold comparison (an alert that does not fire
returns nothing, which says nothing about its metrics), and Prometheus itself loads the
rules file and must evaluate every rule without an error. Dashboards' Grafana variables
become ``$model_name`` -> ``.*`` and ``$__rate_interval`` -> ``1m``."""

from __future__ import annotations

import json
import math
import re
import subprocess

import httpx
import pytest
import torch
import yaml
from prometheus_client.parser import text_string_to_metric_families

from cli.stack import free_port
from deploy.__main__ import DASHBOARD_DIR, RULES_FILE
from shared.models import resolve_model
from tests.integration.conftest import start_stack, wait_for
from tests.prometheus_server import Prometheus

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
# repeats, so the n-gram proposer finds drafts; over a block (16 tokens), so a second
# request hits the prefix cache
PROMPT = "one two three four five six seven eight " * 6
COMPARISON = re.compile(r"\s*[<>]=?\s*[0-9.]+\s*$")


def dashboard_queries() -> list[tuple[str, str]]:
    queries = []
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", []):
                expr = target["expr"].replace("$model_name", ".*").replace("$__rate_interval", "1m")
                queries.append((f"{path.stem} / {panel['title']}", expr))
    return queries


def rule_queries() -> list[tuple[str, str]]:
    groups = yaml.safe_load(RULES_FILE.read_text())["groups"]
    return [(rule["alert"], COMPARISON.sub("", rule["expr"]))
            for group in groups for rule in group["rules"]]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory):
    """A random-weight PEFT adapter on SmolLM2 (as tests/integration/test_lora_serve.py's)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2").path, dtype=torch.float32)
    torch.manual_seed(0)
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False,
                                            target_modules=["q_proj", "v_proj"]))
    path = tmp_path_factory.mktemp("adapter") / "sql"
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def live(tmp_path_factory, adapter):
    """(stack, Prometheus) with traffic sent once Prometheus scrapes."""
    kv_metrics_port = free_port()
    lora = ["--enable-lora", "--lora-modules", f"sql={adapter}", "--max-loras", "2"]
    stack = start_stack(tmp_path_factory.mktemp("logs"), gateways=2, replicas=2, service_args={
        "scheduler": ["--speculative-config", NGRAM, *lora],
        "worker": ["--kv-cache-memory", "256MiB", "--speculative-config", NGRAM, *lora],
        "kvstore": ["--metrics-port", str(kv_metrics_port)]})
    prometheus = Prometheus(tmp_path_factory.mktemp("prometheus"),
                            [f"127.0.0.1:{stack.options.port}", f"127.0.0.1:{kv_metrics_port}"],
                            [RULES_FILE])
    try:
        prometheus.start()
        assert wait_for(lambda: [t["health"] for t in prometheus.api("targets")["activeTargets"]]
                        == ["up", "up"], 30), prometheus.api("targets")
        send_traffic(stack.base_url)
        yield stack, prometheus
    finally:
        prometheus.stop()
        stack.stop()


def send_traffic(url: str) -> None:
    """Streamed chats (twice the same prompt: prefix hits, drafts), a LoRA completion and
    a bad request (a 400), each on a new connection: the kernel spreads them over the
    gateways. 4 sequences in all."""
    base = resolve_model("smollm2").name
    for model in (base, base, "sql"):
        body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": 12, "stream": True, "temperature": 0}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as reply:
            assert reply.status_code == 200
            assert "data: [DONE]" in "".join(reply.iter_text())
        # the first one's blocks in the routing index: the second goes where they are
        assert wait_for(lambda: 'flotilla_routing_index_blocks{tier="gpu"} 0.0' not in
                        httpx.get(url + "/metrics", timeout=10).text, 10)
    reply = httpx.post(url + "/v1/completions", timeout=60, json={
        "model": "sql", "prompt": PROMPT, "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert httpx.post(url + "/v1/completions", timeout=60, json={
        "model": base, "prompt": "hi", "max_tokens": -1}).status_code == 400


def test_every_scrape_of_the_shared_port_sums_both_gateways_once(live):
    """Each scrape (a new connection: either gateway process) counts every sequence once,
    and the schedulers' figures once: the prompt tokens the scheduler looked up equal
    those the gateways submitted (summed over both), not twice them."""
    stack, _ = live
    for _ in range(6):
        families = {f.name: f for f in text_string_to_metric_families(
            httpx.get(stack.base_url + "/metrics", timeout=10).text)}

        def total(name: str) -> float:
            return sum(s.value for s in families[name].samples if s.name == name + "_total")

        assert total("vllm:request_success") == 4
        assert total("vllm:prefix_cache_queries") == total("vllm:prompt_tokens") > 0


def test_every_dashboard_and_rule_query_returns_a_series(live):
    stack, prometheus = live
    # the scrape after the last request: every sequence counted once, over both gateways
    assert wait_for(lambda: [float(s["value"][1]) for s in prometheus.query(
        "sum(vllm:request_success_total)")] == [4.0], 30), prometheus.query(
        "sum(vllm:request_success_total)")

    def empty() -> list[tuple[str, str]]:
        return [(name, expr) for name, expr in dashboard_queries() + rule_queries()
                if not prometheus.query(expr)]

    # a rate needs two samples of a series: a few scrapes after its first
    wait_for(lambda: not empty(), 15)
    empty = empty()
    assert not empty, "queries with no series:\n" + "\n".join(f"{n}: {e}" for n, e in empty)
    (ttft_p99,) = [expr for name, expr in dashboard_queries() if "time_to_first_token" in expr
                   and expr.startswith("histogram_quantile(0.99,")]
    ttft = prometheus.query(ttft_p99)  # data flowed: a number, not NaN
    assert ttft and all(math.isfinite(float(s["value"][1])) for s in ttft), ttft


def test_prometheus_loads_and_evaluates_every_rule(live):
    _, prometheus = live
    check = subprocess.run([str(prometheus.promtool), "check", "rules", str(RULES_FILE)],
                           capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr

    def rules() -> list[dict]:
        return [rule for group in prometheus.api("rules")["groups"] for rule in group["rules"]]

    assert wait_for(lambda: all(r["lastEvaluation"] > "2000" for r in rules()), 20), rules()
    assert sorted(r["name"] for r in rules()) == sorted(name for name, _ in rule_queries())
    assert [(r["name"], r.get("lastError")) for r in rules() if r["health"] != "ok"] == []


def test_every_metric_a_query_names_is_scraped(live):
    _, prometheus = live
    scraped = set(prometheus.api("label/__name__/values"))
    named = {name for _, expr in dashboard_queries() + rule_queries()
             for name in re.findall(r"\b(?:vllm:|flotilla_)[A-Za-z0-9_:]+", expr)}
    assert named and not named - scraped, sorted(named - scraped)
