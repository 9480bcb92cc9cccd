"""Keep fuzzed requests cheap: cap how much each one generates (on the client side; the
server's limits are what is under test), and send the served model's name so requests
reach generation instead of stopping at a 404."""

from __future__ import annotations

from typing import Any

MAX_GENERATED_TOKENS = 2  # per sequence
MAX_SEQUENCES = 2  # n, best_of
MAX_PROMPTS = 2  # a completions batch
_LIMITS = {"max_tokens": MAX_GENERATED_TOKENS, "max_completion_tokens": MAX_GENERATED_TOKENS,
           "max_output_tokens": MAX_GENERATED_TOKENS, "min_tokens": MAX_GENERATED_TOKENS,
           "n": MAX_SEQUENCES, "best_of": MAX_SEQUENCES}
# endpoints that generate, and the parameter each reads its output limit from
GENERATING = {"/v1/chat/completions": "max_completion_tokens", "/v1/completions": "max_tokens",
              "/v1/responses": "max_output_tokens"}


def clamp_body(path: str, body: Any, model_name: str) -> Any:
    """``body`` with its generation bounded and ``model`` set; other values untouched."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    if "model" in body or path in GENERATING:
        body["model"] = model_name
    for key, limit in _LIMITS.items():
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > limit:
            body[key] = limit
    if path in GENERATING and not any(isinstance(body.get(key), int) for key in
                                      ("max_tokens", "max_completion_tokens", "max_output_tokens")):
        body[GENERATING[path]] = MAX_GENERATED_TOKENS
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        body["prompt"] = prompt[:MAX_PROMPTS]
    return body
