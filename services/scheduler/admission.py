"""How many KV blocks admission keeps free for the running requests' next tokens. Pure.

A request admitted into the last free blocks is soon preempted as the running ones grow: it
is computed again later, from its prompt, and its stream stalls meanwhile. Measured with
vLLM's client on an H200 (1,000 streams of 1,024 + 256 tokens at once, dummy Llama-3.1-8B):
135 preemptions of ~1,150 tokens each, a sixth of the run's prefill done twice. So admission
keeps back a share of what the running requests may still write:
``ratio × Σ min(max_tokens − output, MAX_COUNTED_TOKENS)`` tokens' blocks.

The share is learned, since clients often set max_tokens far above what they get: it is the
running mean of the share of their (counted) budget that finished requests used, and a
preemption (the reserve was too small) raises it. It starts at 1 (nothing known: reserve
all), so a burst of requests that run to max_tokens never preempts, and it falls within a
few finished requests where answers end early. Under the priority policy a request keeps
room only for running requests as important as it or more. At most MAX_COUNTED_TOKENS of a
request's budget count (longer outputs may still preempt, as without the reserve). Nothing
runs: the head is admitted whatever its own growth (it could otherwise wait forever).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable

from services.scheduler.request import Request

# of one request's remaining budget: a request without max_tokens gets the context's room
# (8,192 on SmolLM2), and a cold server, reserving all of it, would run few at once until
# the first ones finish and teach the share
MAX_COUNTED_TOKENS = 1024
MIN_RATIO = 0.1
FINISHED_WEIGHT = 0.2  # of the newest finished request in the running mean
PREEMPTED_RAISE = 0.1


class AdmissionReserve:
    def __init__(self, block_size: int, enabled: bool = True) -> None:
        self.block_size = block_size
        self.enabled = enabled
        self.ratio = 1.0

    def remaining_tokens(self, req: Request, max_model_len: int) -> int:
        """Tokens ``req`` may still write, as counted for the reserve."""
        budget = min(req.sampling.max_tokens - len(req.output_token_ids),
                     max_model_len - req.num_tokens)
        return max(0, min(budget, MAX_COUNTED_TOKENS))

    def tokens_to_keep(self, req: Request, num_prompt_left: int, max_model_len: int) -> float:
        """Room to keep for ``req``: its ``num_prompt_left`` prompt tokens not yet given
        blocks, all of them, and the learned share of what it may still write."""
        if not self.enabled:
            return 0.0
        return num_prompt_left + self.ratio * self.remaining_tokens(req, max_model_len)

    def kept_tokens(self, running: Iterable[Request], max_model_len: int) -> dict[int, float]:
        """Room to keep for the running requests (a prompt's blocks come chunk by chunk),
        by their priority."""
        kept: dict[int, float] = defaultdict(float)
        if self.enabled:
            for req in running:
                kept[req.sort_key[0]] += self.tokens_to_keep(
                    req, max(0, req.num_tokens - req.num_computed_tokens), max_model_len)
        return kept

    @staticmethod
    def kept_for(kept: dict[int, float], priority: int) -> float:
        """What a request of ``priority`` must leave free: room for the running requests
        as important as it or more (the others would be preempted for it)."""
        return sum(tokens for other, tokens in kept.items() if other <= priority)

    def blocks_for(self, num_tokens: float) -> int:
        return math.ceil(num_tokens / self.block_size)

    def on_finished(self, req: Request) -> None:
        """``req`` ended (EOS, stop or length): how much of its budget it used."""
        counted = min(req.sampling.max_tokens, MAX_COUNTED_TOKENS)
        used = min(1.0, len(req.output_token_ids) / counted) if counted > 0 else 1.0
        self.ratio = max(MIN_RATIO, self.ratio + FINISHED_WEIGHT * (used - self.ratio))

    def on_preempted(self) -> None:
        self.ratio = min(1.0, self.ratio + PREEMPTED_RAISE)
