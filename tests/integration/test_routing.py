"""KV-aware routing end to end (docs/routing.md): real nats-server, two replicas
(scheduler + worker each), tokenizer and gateway, SmolLM2, greedy, no kvstore (so a
prefix is on exactly one replica's GPU cache).

Two prompts with long prefixes of their own go out together and land on different
replicas; each one's next turn must land on the replica holding its prefix (least-loaded
would send both to the same idle replica: one of them would miss). Then the replica
holding one prefix is killed and restarted: its old blocks must not count for its new
instance, so that prefix's next request is routed by load, finds no cache, and still
gives the same text.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx
import pytest

from tests.integration.conftest import start_stack, wait_for
from tests.integration.test_kvstore_tiers import metric

pytestmark = pytest.mark.integration

BLOCK_SIZE = 16
PREFIX_TOKENS = 20 * BLOCK_SIZE
MAX_TOKENS = 6


def prefix(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1_000, 40_000) for _ in range(PREFIX_TOKENS)]


PREFIXES = {"a": prefix(1), "b": prefix(2)}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, model_files):
    stack = start_stack(tmp_path_factory.mktemp("routing-logs"), replicas=2, kvstore=False,
                        service_args={"worker": ["--kv-cache-memory", "128MiB"],
                                      "gateway": ["--routing", "kv", "--heartbeat-timeout-s", "3"]})
    yield stack
    stack.stop()


def complete(stack, model_name: str, token_ids: list[int]) -> tuple[str, int]:
    """Greedy completion: (text, cached prompt tokens)."""
    response = httpx.post(stack.base_url + "/v1/completions", timeout=120, json={
        "model": model_name, "prompt": token_ids, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True})
    assert response.status_code == 200, response.text
    body = response.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def gateway_metric(stack, name: str, label: str = "") -> float:
    return metric(stack.base_url + "/metrics", name, label)


def prompt_tokens_by_replica(stack) -> dict[str, float]:
    """Prompt tokens each replica has looked up in its prefix cache (one per request run)."""
    return {replica_id: gateway_metric(stack, "flotilla_prefix_cache_queries_total",
                                       f'replica_id="{replica_id}"') for replica_id in ("0", "1")}


def test_a_next_turn_goes_to_the_replica_holding_its_prefix(stack, model_name):
    threads = [threading.Thread(target=complete, args=(stack, model_name, [*tokens, 7]))
               for tokens in PREFIXES.values()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    # the second went elsewhere: the first's prefill was queued at its replica
    assert wait_for(lambda: all(v > 0 for v in prompt_tokens_by_replica(stack).values()), 10), \
        prompt_tokens_by_replica(stack)
    usable = 2 * (PREFIX_TOKENS // BLOCK_SIZE)  # both prefixes' blocks, known to the gateway
    assert wait_for(lambda: gateway_metric(stack, "flotilla_routing_index_blocks",
                                           'tier="gpu"') >= usable, 10)
    cache_decisions = gateway_metric(stack, "flotilla_routing_decisions_total", 'reason="cache"')
    for tokens in PREFIXES.values():
        _, cached = complete(stack, model_name, [*tokens, 8, 9])
        assert cached >= PREFIX_TOKENS - BLOCK_SIZE
    assert gateway_metric(stack, "flotilla_routing_decisions_total",
                          'reason="cache"') == cache_decisions + 2


def hits_by_replica(stack) -> dict[str, float]:
    return {replica_id: gateway_metric(stack, "flotilla_prefix_cache_hits_total",
                                       f'replica_id="{replica_id}"') for replica_id in ("0", "1")}


def settled_hits_by_replica(stack) -> dict[str, float]:
    """Prefix-cache hits (tokens) per replica, once the stats of earlier requests are in
    (they come every half second)."""
    last = hits_by_replica(stack)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        time.sleep(1.2)
        now = hits_by_replica(stack)
        if now == last:
            return now
        last = now
    raise AssertionError(f"the prefix-cache hits did not settle: {last}")


def test_a_restarted_replica_is_not_routed_to_by_its_stale_entries(stack, model_name):
    tokens = [*PREFIXES["a"], 8, 9]
    before = settled_hits_by_replica(stack)
    reference, cached = complete(stack, model_name, tokens)
    assert cached >= PREFIX_TOKENS - BLOCK_SIZE
    # this hit reaches the gateway with a later stats event: wait for it, not for a pause
    assert wait_for(lambda: max(after - before[replica] for replica, after in
                                hits_by_replica(stack).items()) >= cached, 30)
    after = settled_hits_by_replica(stack)
    (holder,) = [replica for replica in after if after[replica] > before[replica]]
    old_scheduler = stack.health()["replicas"][holder]["scheduler_id"]

    suffix = f"-{holder}" if holder != "0" else ""
    for kind in ("scheduler", "worker"):
        stack.stop_service(kind + suffix, signal.SIGKILL)
    time.sleep(0.5)
    for kind in ("worker", "scheduler"):
        stack.start_service(kind + suffix)

    def restarted() -> bool:
        replicas = (stack.health() or {}).get("replicas", {})
        return len(replicas) == 2 and all(r["ready"] for r in replicas.values()) and \
            replicas[holder]["scheduler_id"] != old_scheduler
    assert wait_for(restarted, 180), stack.health()

    expected_hits = gateway_metric(stack, "flotilla_routing_expected_hit_tokens_total")
    load_decisions = gateway_metric(stack, "flotilla_routing_decisions_total", 'reason="load"')
    text, cached = complete(stack, model_name, tokens)
    assert cached == 0  # the prefix was on the restarted replica's GPU only: gone
    assert text == reference
    assert gateway_metric(stack, "flotilla_routing_expected_hit_tokens_total") == expected_hits
    assert gateway_metric(stack, "flotilla_routing_decisions_total",
                          'reason="load"') == load_decisions + 1


@pytest.fixture(scope="module")
def kv_stack(tmp_path_factory, model_files):
    """One replica with its node's kvstore (host tier only)."""
    stack = start_stack(tmp_path_factory.mktemp("routing-kv-logs"), replicas=1,
                        kv_node_id=f"routingkv{random.randrange(1 << 30)}",
                        service_args={"worker": ["--kv-cache-memory", "128MiB"],
                                      "kvstore": ["--kv-host-memory", "64MiB"],
                                      "gateway": ["--routing", "kv"]})
    yield stack
    stack.stop()


def test_a_gateway_started_after_blocks_were_stored_learns_them_from_the_kvstore(
        kv_stack, model_name):
    def indexed_tier_blocks() -> float:
        return gateway_metric(kv_stack, "flotilla_routing_index_blocks", 'tier="kvstore"')

    complete(kv_stack, model_name, [*PREFIXES["a"], 1, 2])  # its full blocks go to the host tier
    assert wait_for(lambda: indexed_tier_blocks() >= PREFIX_TOKENS // BLOCK_SIZE, 60), \
        indexed_tier_blocks()
    held = indexed_tier_blocks()

    kv_stack.stop_service("gateway")  # the kvstore stays quiet from now on: no event will come
    kv_stack.start_service("gateway")
    kv_stack.wait_ready(120)
    # learnt from the kvstore's snapshot, asked when a scheduler's stats named its node
    assert wait_for(lambda: indexed_tier_blocks() == held, 30), (indexed_tier_blocks(), held)
    assert gateway_metric(kv_stack, "flotilla_routing_block_snapshots_total",
                          'outcome="kv_loaded"') >= 1
