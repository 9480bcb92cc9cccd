"""flotilla's Grafana dashboards: overview, KV cache and tiers, routing, speculative
decoding, LoRA. Queries read vLLM's names where vLLM has one (docs/metrics.md), so they
work on a vLLM fleet's panels' habits, and flotilla's own names for the rest."""

from __future__ import annotations

from deploy.grafana import MODEL, RATE, Panel, Row, dashboard


def rate(metric: str, by: str = "model_name", selector: str = MODEL) -> str:
    """The per-second rate of a counter, summed by ``by`` (over replicas and gateways)."""
    matchers = f"{{{selector}}}" if selector else ""
    return f"sum by ({by}) (rate({metric}{matchers}[{RATE}]))"


def ratio(numerator: str, denominator: str, by: str = "model_name") -> str:
    return f"{rate(numerator, by)} / {rate(denominator, by)}"


def quantiles(histogram: str, qs=(0.5, 0.9, 0.99)) -> list[tuple[str, str]]:
    return [(f"histogram_quantile({q}, {rate(histogram + '_bucket', 'le, model_name')})",
             f"p{q * 100:g} {{{{model_name}}}}") for q in qs]


def per_replica(metric: str, selector: str = MODEL) -> str:
    return f"sum by (model_name, replica_id) ({metric}{{{selector}}})"


def overview() -> dict:
    return dashboard("flotilla-overview", "flotilla / Overview",
                     "Requests, errors, latency, throughput and queues of a flotilla fleet", [
        Row("Requests", [
            Panel("Finished sequences /s", "vllm:request_success by finish reason",
                  [(rate("vllm:request_success_total", "model_name, finished_reason"),
                    "{{finished_reason}}")], "reqps", stack=True),
            Panel("HTTP errors /s", "4xx and 5xx answers of the OpenAI API, by status",
                  [(rate("flotilla_requests_total", "endpoint, status",
                         'endpoint=~"/v1/.*", status=~"[45].."'), "{{status}} {{endpoint}}")],
                  "reqps", stack=True),
        ]),
        Row("Latency", [
            Panel("Time to first token", "From submit to the first token at the gateway",
                  quantiles("vllm:time_to_first_token_seconds"), "s", width=8),
            Panel("Inter-token latency", "Between streamed chunks (docs/metrics.md)",
                  quantiles("vllm:inter_token_latency_seconds"), "s", width=8),
            Panel("End-to-end latency", "From submit to the last token",
                  quantiles("vllm:e2e_request_latency_seconds"), "s", width=8),
            Panel("Queue time", "Arrival at the scheduler to first scheduled",
                  quantiles("vllm:request_queue_time_seconds", (0.5, 0.99)), "s"),
        ]),
        Row("Throughput and queues", [
            Panel("Tokens /s", "Prompt tokens submitted and tokens generated",
                  [(rate("vllm:prompt_tokens_total"), "prompt {{model_name}}"),
                   (rate("vllm:generation_tokens_total"), "generation {{model_name}}")],
                  "short"),
            Panel("Running and waiting", "Requests in each replica's batch and queue",
                  [(per_replica("vllm:num_requests_running"), "running {{replica_id}}"),
                   (per_replica("vllm:num_requests_waiting"), "waiting {{replica_id}}")]),
            Panel("Preemptions /s", "Requests preempted for KV blocks, per replica",
                  [(rate("vllm:num_preemptions_total", "model_name, replica_id"),
                    "{{replica_id}}")]),
        ]),
    ])


def kv_cache() -> dict:
    tier_hits = rate("flotilla_prefix_cache_tier_hits_total", "replica_id", "")
    return dashboard("flotilla-kv-cache", "flotilla / KV cache and tiers",
                     "GPU KV blocks, prefix-cache hits and the kvstore's host and disk tiers", [
        Row("GPU KV cache", [
            Panel("KV cache usage", "Share of each replica's KV blocks in use",
                  [(per_replica("vllm:kv_cache_usage_perc"), "{{replica_id}}")],
                  "percentunit", max_value=1),
            Panel("Prefix-cache hit rate", "Prompt tokens found in GPU blocks over those "
                  "looked up", [(ratio("vllm:prefix_cache_hits_total",
                                       "vllm:prefix_cache_queries_total"), "{{model_name}}")],
                  "percentunit", max_value=1),
            Panel("Prefix-cache tokens /s", "Looked up and found, per replica",
                  [(rate("vllm:prefix_cache_queries_total", "model_name, replica_id"),
                    "queries {{replica_id}}"),
                   (rate("vllm:prefix_cache_hits_total", "model_name, replica_id"),
                    "hits {{replica_id}}")]),
            Panel("Tier hits /s", "Prompt tokens loaded from the kvstore's tiers instead of "
                  "computed", [(tier_hits, "{{replica_id}}")]),
        ]),
        Row("kvstore tiers", [
            Panel("Tier fill", "Bytes held over each tier's size",
                  [("sum by (tier) (flotilla_kvstore_bytes) / "
                    "sum by (tier) (flotilla_kvstore_capacity_bytes)", "{{tier}}")],
                  "percentunit", width=8, max_value=1),
            Panel("Blocks held", "Per tier", [("sum by (tier) (flotilla_kvstore_blocks)",
                                               "{{tier}}")], width=8),
            Panel("Lookups /s", "Blocks pinned by the tier found in, and misses",
                  [(rate("flotilla_kvstore_pinned_total", "tier", ""), "{{tier}}"),
                   (rate("flotilla_kvstore_misses_total", "", ""), "miss")], width=8),
        ]),
    ])


def routing() -> dict:
    return dashboard("flotilla-routing", "flotilla / Routing",
                     "The gateway's replica choices (docs/routing.md)", [
        Row("Decisions", [
            Panel("Decisions /s", "By policy and reason (cache, session, load, saturated)",
                  [(rate("flotilla_routing_decisions_total", "policy, reason", ""),
                    "{{policy}} {{reason}}")], "ops", stack=True),
            Panel("Expected hit tokens /s", "Prompt tokens the chosen replica was expected "
                  "to hold, by tier", [(rate("flotilla_routing_expected_hit_tokens_total",
                                             "tier", ""), "{{tier}}")]),
            Panel("Index blocks", "Blocks in the routing index, by tier",
                  [("max by (tier) (flotilla_routing_index_blocks)", "{{tier}}")]),
            Panel("Block snapshots /s", "Snapshots fetched for the index, by outcome",
                  [(rate("flotilla_routing_block_snapshots_total", "outcome", ""),
                    "{{outcome}}")]),
        ]),
    ])


def speculative() -> dict:
    accepted, drafts = ("vllm:spec_decode_num_accepted_tokens_total",
                        "vllm:spec_decode_num_draft_tokens_total")
    per_position = " / ignoring(position) group_left ".join((
        rate("vllm:spec_decode_num_accepted_tokens_per_pos_total", "model_name, position"),
        rate("vllm:spec_decode_num_drafts_total")))
    return dashboard("flotilla-speculative", "flotilla / Speculative decoding",
                     "Draft acceptance (--speculative-config)", [
        Row("Acceptance", [
            Panel("Acceptance rate", "Drafts kept over drafts verified",
                  [(ratio(accepted, drafts), "{{model_name}}")], "percentunit", max_value=1),
            Panel("Mean acceptance length", "Tokens per verify pass: 1 + kept drafts per pass",
                  [(f"1 + {ratio(accepted, 'vllm:spec_decode_num_drafts_total')}",
                    "{{model_name}}")]),
            Panel("Acceptance by position", "Drafts kept at each position per verify pass",
                  [(per_position, "position {{position}}")], "percentunit", max_value=1),
            Panel("Draft cap", "Drafts a request could get in the last planned step "
                  "(load-adaptive)", [("max by (replica_id) (flotilla_spec_decode_draft_cap)",
                                       "{{replica_id}}")]),
        ]),
    ])


def lora() -> dict:
    return dashboard("flotilla-lora", "flotilla / LoRA", "Requests and tokens per LoRA "
                     "adapter, adapters per replica (docs/lora.md)", [
        Row("Adapters", [
            Panel("Requests /s per adapter", "", [(rate("flotilla_lora_requests_total",
                                                        "lora_name", ""), "{{lora_name}}")],
                  "reqps", stack=True),
            Panel("Tokens /s per adapter", "Prompt and generated",
                  [(rate("flotilla_lora_prompt_tokens_total", "lora_name", ""),
                    "prompt {{lora_name}}"),
                   (rate("flotilla_lora_generation_tokens_total", "lora_name", ""),
                    "generation {{lora_name}}")]),
            Panel("Adapters registered", "Per replica",
                  [("max by (replica_id) (flotilla_lora_adapters)", "{{replica_id}}")]),
            Panel("Running and waiting adapters", "vLLM's lora_requests_info (its labels "
                  "name the adapters)",
                  [("count by (max_lora, running_lora_adapters, waiting_lora_adapters) "
                    "(vllm:lora_requests_info)",
                    "running: {{running_lora_adapters}} waiting: {{waiting_lora_adapters}}")]),
        ]),
    ])


DASHBOARDS = {"overview": overview, "kv-cache": kv_cache, "routing": routing,
              "speculative-decoding": speculative, "lora": lora}
