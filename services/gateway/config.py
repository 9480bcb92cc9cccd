"""Gateway configuration."""

from __future__ import annotations

from enum import StrEnum

from shared.config import ServiceConfig, check_choice


class RoutingPolicy(StrEnum):
    """Which replica gets a request (docs/routing.md)."""

    KV = "kv"  # where its prefix is cached, priced against load
    LEAST_LOADED = "least-loaded"
    ROUND_ROBIN = "round-robin"


class GatewayConfig(ServiceConfig, frozen=True, kw_only=True):
    """flotilla gateway: the OpenAI-compatible HTTP API."""

    host: str = "0.0.0.0"
    port: int = 8000
    # several gateway processes on one port (SO_REUSEPORT): the kernel spreads connections
    reuse_port: bool = False
    api_key: str = ""  # when set, /v1/* and /tokenize need "Authorization: Bearer <key>"
    max_body_bytes: int = 4 * 1024 * 1024
    request_timeout_s: float = 5.0  # bus calls to the tokenizer and scheduler
    heartbeat_timeout_s: float = 5.0  # a scheduler silent this long has lost its requests
    migration_limit: int = 3  # times a request moves to another replica when its own dies
    migration_timeout_s: float = 60.0  # how long a moving request waits for a live replica
    stall_timeout_s: float = 60.0  # a replica with work and no finished step this long is stuck
    shutdown_timeout_s: float = 30.0  # on SIGTERM: finish in-flight requests this long, then exit
    # an idle client connection is kept this long: longer than clients' own idle expiry
    # (httpx and the OpenAI SDK: 5 s) and load balancers' (60 s), so a client never sends
    # on a connection the gateway is closing at the same moment (a ReadError, not retried)
    http_keep_alive_s: float = 75.0
    restarts_file: str = ""  # flotilla serve's restart counts (JSON), shown in /metrics
    health_timeout_s: float = 1.0
    accept_unknown_fields: bool = False  # drop and log parameters outside OpenAI's schema
    max_tokens_default: int = 0  # output limit of a request that sets none (0: the context)
    # which replica gets a request (docs/routing.md)
    routing: RoutingPolicy = RoutingPolicy.KV
    routing_saturation_margin: int = 1  # requests over the least loaded replica's ...
    routing_saturation_ratio: float = 0.5  # ... or this share of the mean load, if more
    routing_session_ttl_s: float = 600.0
    routing_max_sessions: int = 100_000

    __help__ = {
        "host": "address to listen on",
        "port": "HTTP port",
        "reuse_port": "bind the port with SO_REUSEPORT, so several gateway processes share it "
                      "and the kernel spreads connections between them (flotilla serve "
                      "--gateway-workers)",
        "api_key": "require this bearer token on the API",
        "max_body_bytes": "largest request body accepted (413 above)",
        "request_timeout_s": "timeout for calls to the tokenizer and scheduler",
        "heartbeat_timeout_s": "a scheduler silent this long has lost its requests (they move)",
        "migration_limit": "times a request may move to another replica when its own dies (0: never)",
        "migration_timeout_s": "how long a moving request waits for a live replica",
        "stall_timeout_s": "a replica with work queued and no finished step this long is not "
                           "ready; its requests move",
        "shutdown_timeout_s": "on SIGTERM, finish in-flight requests for this long, then exit",
        "http_keep_alive_s": "an idle HTTP connection is kept open this long (longer than "
                             "clients' and load balancers' idle timeouts)",
        "restarts_file": "JSON file of service restart counts (set by flotilla serve)",
        "health_timeout_s": "timeout of each service's health check",
        "accept_unknown_fields": "accept request parameters outside OpenAI's schema (vendor "
                                 "extensions), dropping and logging them, instead of a 400",
        "max_tokens_default": "output tokens of a request that gives no max_tokens (and no "
                              "smaller model default); 0: what the context leaves",
        "routing": "which replica gets a request: kv (where its prefix is cached, priced "
                   "against load), least-loaded or round-robin (docs/routing.md)",
        "routing_saturation_margin": "kv: a session leaves its replica once that one has "
                                     "this many more requests than the least loaded one, "
                                     "plus what its cached prefix is worth in requests (a "
                                     "replica holding the prompt's prefix: one more)",
        "routing_saturation_ratio": "kv: ... or this share of the replicas' mean load more, "
                                    "if that is larger",
        "routing_session_ttl_s": "kv: a session (prompt_cache_key or user) sticks to its "
                                 "replica this long after its last request",
        "routing_max_sessions": "kv: sessions remembered (least recently used forgotten first)",
    }

    def __post_init__(self) -> None:
        if self.max_tokens_default < 0:
            raise ValueError("max_tokens_default must be 0 (no default) or positive")
        check_choice(self.routing, RoutingPolicy, "routing")
        if self.routing_saturation_margin < 0 or self.routing_saturation_ratio < 0:
            raise ValueError("the routing saturation margin and ratio must not be negative")
