"""One sequence's stream inside the gateway: token outputs in, text deltas out.

A scheduler step's outputs are turned into text right here (the sequence's own
``IncrementalDetokenizer``), with no bus round trip. Deltas that arrive while the
client's writer is still busy are merged into one, so the work per stream follows how
fast its client reads, not how many steps the engine runs: under load a stream sends
fewer, larger chunks instead of falling behind.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from shared.detokenizer import IncrementalDetokenizer, TokenBytes
from shared.messages import ErrorInfo, GenerateRequest, RequestOutput, TokenLogprobs


@dataclass(frozen=True, slots=True)
class TokenText:
    """A token as logprobs show it: its text, exact bytes and log-probability."""

    token: str
    token_bytes: bytes
    logprob: float


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    chosen: TokenText
    top: tuple[TokenText, ...] = ()


@dataclass(frozen=True, slots=True)
class Delta:
    """New text for one sequence, as the client should see it."""

    text: str
    num_new_tokens: int
    finish_reason: str | None = None
    error: ErrorInfo | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # one per new token, when the request asked
    # when the scheduler published the newest output in it (time.time(); 0: not stamped)
    published_at: float = 0.0

    def then(self, later: Delta) -> Delta:
        """This delta followed by ``later``, as one."""
        return Delta(self.text + later.text, self.num_new_tokens + later.num_new_tokens,
                     later.finish_reason, later.error, self.logprobs + later.logprobs,
                     later.published_at or self.published_at)


@dataclass(eq=False)
class RequestStream:
    request_id: str
    detokenizer: IncrementalDetokenizer
    scheduler_id: str = ""
    finished: bool = False  # no more deltas will be pushed
    num_cached_tokens: int = 0  # prompt tokens the prefix cache served
    has_output: bool = False
    # when the request asked for prompt logprobs: one per prompt token (the first None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # migration (migration.py): the request as submitted (None: cannot be migrated), every
    # token generated so far, how often it moved, and whether a move is under way
    request: GenerateRequest | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_migrations: int = 0
    migrating: bool = False
    stored_id: str = ""  # its id in the response store ("": not stored)
    # a non-streaming client reads only the whole answer: its reader is woken once, at the
    # end, not once per step (at 1,000 requests the wake-ups kept the gateway from keeping up)
    wake_at_end: bool = False
    first_token_at: float = 0.0  # perf_counter when the first token's delta was pushed
    _pending: Delta | None = None
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    def push(self, delta: Delta) -> None:
        """Queue ``delta`` for the client, merged with any it has not taken yet."""
        self._pending = delta if self._pending is None else self._pending.then(delta)
        if delta.num_new_tokens and not self.first_token_at:
            self.first_token_at = time.perf_counter()
        if delta.finish_reason is not None:
            self.finished = True
        elif self.wake_at_end:
            return
        self._ready.set()

    def fail(self, error: ErrorInfo) -> None:
        """End the stream with ``error`` (kept after any text not yet taken)."""
        if not self.finished:
            self.push(Delta("", 0, "error", error))

    def take(self) -> Delta | None:
        """What was pushed since the last take, without waiting (a replay: one delta per
        output, so the events it makes do not depend on timing)."""
        delta, self._pending = self._pending, None
        self._ready.clear()
        return delta

    async def next_delta(self) -> Delta:
        """Everything pushed since the last call, waiting until there is something."""
        await self._ready.wait()
        self._ready.clear()
        delta, self._pending = self._pending, None
        return delta


def apply_output(stream: RequestStream, output: RequestOutput, token_bytes: TokenBytes,
                 published_at: float = 0.0) -> bool:
    """Turn one step's output for ``stream`` (sent by the scheduler at ``published_at``)
    into a pushed delta. True when a stop string ended the sequence here (the scheduler
    still runs it: abort it)."""
    if output.error is not None:
        stream.fail(output.error)
        return False
    finished = output.finish_reason is not None
    stream.output_token_ids += output.new_token_ids
    step = stream.detokenizer.step(output.new_token_ids, finished)
    logprobs, prompt_logprobs = named_logprobs(output, token_bytes)
    if prompt_logprobs is not None:
        stream.prompt_logprobs = prompt_logprobs
    if step.stopped:
        stream.push(Delta(step.text, step.num_tokens_used, "stop", None,
                          logprobs[:step.num_tokens_used], published_at))
        return True
    stream.push(Delta(step.text, len(output.new_token_ids), output.finish_reason, None,
                      logprobs, published_at))
    return False


def named_logprobs(output: RequestOutput, token_bytes: TokenBytes
                   ) -> tuple[tuple[TokenLogprob, ...], list[TokenLogprob | None] | None]:
    """The output's logprobs (sampled and prompt) with the text and bytes of each token."""
    if not output.logprobs and not output.prompt_logprobs:
        return (), None
    entries = [*output.logprobs, *(e for e in output.prompt_logprobs if e is not None)]
    token_ids = [token_id for e in entries for token_id in (e.token_id, *e.top_token_ids)]
    texts, data = token_bytes.lookup(token_ids)
    names = iter(zip(texts, data))

    def named(entry: TokenLogprobs) -> TokenLogprob:
        token, raw = next(names)
        top = tuple(TokenText(*next(names), logprob) for logprob in entry.top_logprobs)
        return TokenLogprob(TokenText(token, raw, entry.logprob), top)

    logprobs = tuple(named(e) for e in output.logprobs)
    prompt = [None if e is None else named(e) for e in output.prompt_logprobs] \
        if output.prompt_logprobs else None
    return logprobs, prompt
