"""A stored response's records in the JetStream stream (docs/openai-api.md), written by
the gateways beside the scheduler's outputs: what any gateway needs to rebuild the
response's events from those outputs (``ResponseStart``), and what changed its course
(``ResponseMark``: moved to another replica, failed, cancelled). Gateway to gateway, so
a newer gateway reads an older one's records: fields are only added, with defaults."""

from __future__ import annotations

from msgspec import Struct

from shared.messages import ErrorInfo

CANCELLED_CODE = "response_cancelled"  # the error code a cancelled response ends with


class ResponseStart(Struct, frozen=True, kw_only=True, tag="start"):
    kind: str  # "responses" (the only kind stored today)
    response_id: str  # as the client sees it (resp_...)
    request_id: str  # the scheduler's id of its first attempt
    model: str
    created: int  # unix seconds
    body: bytes  # the request's JSON, as received: replay plans its tools from it again
    echo: bytes  # JSON of the request fields a response repeats
    prompt_tail: list[int]  # the prompt's last tokens (the detokenizer's context)
    stop: list[str] = []
    num_prompt_tokens: int = 0
    background: bool = False


class ResponseMark(Struct, frozen=True, kw_only=True, tag="mark"):
    # "migrated" (outputs of ``request_id`` follow; the earlier attempts' are stale),
    # "failed" (``error``) or "cancelled"
    event: str
    request_id: str = ""
    num_output_tokens: int = 0
    error: ErrorInfo | None = None


ResponseRecord = ResponseStart | ResponseMark
