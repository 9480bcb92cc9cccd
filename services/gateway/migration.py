"""Request migration: when a request's scheduler or worker dies, the gateway submits it
again, to a live or restarted replica, carrying the tokens it had generated, so the
client's stream continues where it was. Pure policy; the bus calls are in service.py.

The new replica recomputes prompt + generated tokens (as after a preemption) and samples
on from there: greedy and seeded requests give exactly the text they would have given
without the fault (a seeded draw is keyed by the output index, and the scheduler knows
which tokens are outputs). The client sees neither duplicated nor missing text: the
gateway's detokenizer for the stream carries on from the tokens it already turned into
text, and the resumed request reports only new tokens.

Not migrated (they fail with the original error): requests with n > 1 (their sequences
share one prompt and derived seeds), requests out of migrations, and errors that are not
a lost replica (anything but 503).
"""

from __future__ import annotations

import msgspec

from shared.messages import ErrorInfo, GenerateRequest

RETRYABLE_STATUS = 503  # the replica is gone or restarting; other errors would repeat


def can_migrate(request: GenerateRequest | None, num_migrations: int, migration_limit: int,
                error: ErrorInfo) -> bool:
    return (request is not None and request.n == 1 and num_migrations < migration_limit
            and error.status == RETRYABLE_STATUS)


def resumed_request(request: GenerateRequest, output_token_ids: list[int], attempt: int,
                    arrival_time: float) -> GenerateRequest:
    """``request`` again under a new id, resuming after ``output_token_ids``. Prompt
    logprobs were delivered with the first output: a request that has outputs does not
    ask for them again."""
    sampling = request.sampling
    if output_token_ids and sampling.prompt_logprobs is not None:
        sampling = msgspec.structs.replace(sampling, prompt_logprobs=None)
    return msgspec.structs.replace(
        request, request_id=f"{request.request_id}-m{attempt}", sampling=sampling,
        output_token_ids=list(output_token_ids), arrival_time=arrival_time)
