"""Pacing prompt chunks against running decodes: an opt-in latency policy.

A step that carries a prompt chunk as well as decodes makes every decoding stream wait for
the chunk. With ``--chunk-step-ratio R`` the scheduler caps the prompt tokens of such steps
so that the step takes at most R times a decode-only step, as measured by the worker. The
cost of a chunk grows with its context (attention reads everything before it), so the cap
is learned step by step: after each mixed step, ``time ≈ decode + per_token × chunk`` gives
the per-token cost at the current context, and the next chunk is the one that would take
exactly the target (a dearer step counts at once, a cheaper one only partly). Steps without decodes are never capped (no stream is waiting). Off (ratio 0) by
default: it trades a long prompt's time to first token, and throughput, for smooth streams.
"""

from __future__ import annotations

from shared.messages import StepPlan

DECODE_EMA_WEIGHT = 0.2  # of the newest decode-only step in the running mean
PER_TOKEN_EASE = 0.3  # how far one cheaper chunk moves the per-token cost toward itself


class ChunkPacer:
    def __init__(self, ratio: float, max_tokens: int, min_tokens: int) -> None:
        self.ratio = ratio
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.decode_step_s: float | None = None  # running mean of decode-only steps
        # the latest chunk's cost per prompt token (it grows with the context); a step with
        # no decodes counts whole, which overestimates it: the first paced chunk is small
        self.per_token_s: float | None = None

    @property
    def limit(self) -> int:
        """Prompt tokens allowed in a step that also decodes."""
        if self.ratio <= 0 or self.decode_step_s is None or not self.per_token_s:
            return self.max_tokens
        wanted = round((self.ratio - 1) * self.decode_step_s / self.per_token_s)
        return max(self.min_tokens, min(self.max_tokens, wanted))

    def chunk_budget(self, num_decodes: int) -> int:
        """Prompt tokens a step with ``num_decodes`` decodes may carry."""
        return self.limit if num_decodes else self.max_tokens

    def observe(self, plan: StepPlan, step_time_s: float) -> None:
        if self.ratio <= 0:
            return
        num_decodes = sum(1 for s in plan.scheduled if s.num_new_tokens == 1)
        num_chunk_tokens = sum(s.num_new_tokens for s in plan.scheduled if s.num_new_tokens > 1)
        if num_chunk_tokens == 0:
            self.decode_step_s = step_time_s if self.decode_step_s is None else (
                (1 - DECODE_EMA_WEIGHT) * self.decode_step_s + DECODE_EMA_WEIGHT * step_time_s)
            return
        base = self.decode_step_s if num_decodes and self.decode_step_s is not None else 0.0
        observed = max(step_time_s - base, 1e-9) / num_chunk_tokens
        if self.per_token_s is None or observed >= self.per_token_s:
            self.per_token_s = observed  # dearer: shrink the next chunk at once
        else:  # cheaper: grow slowly, since one quick step on a busy machine proves little
            self.per_token_s += PER_TOKEN_EASE * (observed - self.per_token_s)
