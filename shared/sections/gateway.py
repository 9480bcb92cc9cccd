"""The API's knobs: where the gateway listens, what it accepts, how long it waits, how it
picks a replica (docs/routing.md), and the model's name in the API."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from shared.config import Section, check_choice, knob


class RoutingPolicy(StrEnum):
    """Which replica gets a request (docs/routing.md)."""

    KV = "kv"  # where its prefix is cached, priced against load
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


class Listen(Section, frozen=True, kw_only=True):
    host: Annotated[str, knob("address the API listens on")] = "0.0.0.0"
    port: Annotated[int, knob("the API's HTTP port")] = 8000


class ServedModel(Section, frozen=True, kw_only=True):
    served_model_name: Annotated[str, knob(
        "the model's name in the API: /v1/models lists it and requests must use it "
        "(default: the model's own name, e.g. SmolLM2-135M-Instruct)")] = ""


class Gateway(Section, frozen=True, kw_only=True):
    reuse_port: Annotated[bool, knob(
        "bind the port with SO_REUSEPORT, so several gateway processes share it and the "
        "kernel spreads connections between them (flotilla serve --gateway-workers)",
        serve=False)] = False
    fleet_metrics: Annotated[bool, knob(
        "count in /metrics what every gateway hears alike from the schedulers (step "
        "histograms, scheduler replacements); of several gateway processes sharing a "
        "PROMETHEUS_MULTIPROC_DIR one does (flotilla serve --gateway-workers: the first)",
        serve=False)] = True
    api_key: Annotated[str, knob(
        "require this bearer token on /v1/*, /tokenize and /detokenize (/health and /metrics "
        "stay open)")] = ""
    max_body_bytes: Annotated[int, knob("largest request body accepted (413 above)")] = \
        4 * 1024 * 1024
    request_timeout_s: Annotated[float, knob(
        "timeout of the gateway's calls to the tokenizer and scheduler")] = 5.0
    heartbeat_timeout_s: Annotated[float, knob(
        "a scheduler silent this long has lost its requests (they move to another "
        "replica)")] = 5.0
    migration_limit: Annotated[int, knob(
        "times a request may move to another replica when its own dies (0: never)")] = 3
    migration_timeout_s: Annotated[float, knob(
        "how long a moving request waits for a live replica")] = 60.0
    stall_timeout_s: Annotated[float, knob(
        "a replica with work queued and no finished step this long is not ready; its "
        "requests move")] = 60.0
    http_keep_alive_s: Annotated[float, knob(
        "an idle HTTP connection is kept open this long: longer than clients' own idle expiry "
        "(httpx and the OpenAI SDK: 5 s) and load balancers' (60 s), so a client never sends "
        "on a connection the gateway is closing")] = 75.0
    restarts_file: Annotated[str, knob(
        "JSON file of service restart counts, shown in /metrics (set by flotilla serve)",
        serve=False)] = ""
    health_timeout_s: Annotated[float, knob("timeout of each service's health check")] = 1.0
    accept_unknown_fields: Annotated[bool, knob(
        "accept request parameters outside OpenAI's schema (vendor extensions), dropping and "
        "logging them, instead of a 400")] = False
    max_tokens_default: Annotated[int, knob(
        "output tokens of a request that gives no max_tokens (and no smaller model default); "
        "0: what the context leaves")] = 0

    def __post_init__(self) -> None:
        if self.max_tokens_default < 0:
            raise ValueError("max_tokens_default must be 0 (no default) or positive")


class Routing(Section, frozen=True, kw_only=True):
    routing: Annotated[RoutingPolicy, knob(
        "which replica gets a request: kv (where its prefix is cached, priced against load, "
        "sticky sessions by prompt_cache_key or user), least-loaded or round-robin "
        "(docs/routing.md)")] = RoutingPolicy.KV
    routing_saturation_margin: Annotated[int, knob(
        "kv: a session leaves its replica once that one has this many more requests than the "
        "least loaded one, plus what its cached prefix is worth in requests (a replica "
        "holding the prompt's prefix: one more)")] = 1
    routing_saturation_ratio: Annotated[float, knob(
        "kv: ... or this share of the replicas' mean load more, if that is larger")] = 0.5
    routing_session_ttl_s: Annotated[float, knob(
        "kv: a session (prompt_cache_key or user) sticks to its replica this long after its "
        "last request")] = 600.0
    routing_max_sessions: Annotated[int, knob(
        "kv: sessions remembered (least recently used forgotten first)")] = 100_000

    def __post_init__(self) -> None:
        check_choice(self.routing, RoutingPolicy, "routing")
        if self.routing_saturation_margin < 0 or self.routing_saturation_ratio < 0:
            raise ValueError("the routing saturation margin and ratio must not be negative")


class ResponseStore(Section, frozen=True, kw_only=True):
    """Stored and resumable responses (docs/openai-api.md): each such request's outputs kept
    in a NATS JetStream stream, so any gateway replays them from a sequence number."""

    response_retention_s: Annotated[float, knob(
        "how long a stored or background response (and a resumable stream) is kept in NATS "
        "JetStream, readable with GET /v1/responses/{id} and resumable from any gateway; "
        "0: no store (store: true and background: true are refused)")] = 3600.0
    response_store_replicas: Annotated[int, knob(
        "copies JetStream keeps of the response stream (1, or 3 on a 3-node NATS cluster)")] = 1
    response_idle_timeout_s: Annotated[float, knob(
        "a replayed response that gets no output for this long ends with a 503 error event "
        "(its replica died with no gateway left to move it)")] = 60.0

    def __post_init__(self) -> None:
        if self.response_retention_s < 0:
            raise ValueError("response_retention_s must be 0 (no store) or positive")
        if not 1 <= self.response_store_replicas <= 5:
            raise ValueError("response_store_replicas must be 1 to 5 (JetStream's limit)")
        if self.response_idle_timeout_s <= 0:
            raise ValueError("response_idle_timeout_s must be positive")
