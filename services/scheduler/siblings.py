"""n > 1: the sequences of one request run as sibling requests.

Sibling i runs under ``choice_request_ids(request_id, n)[i]`` with the same prompt, output
subject and priority. A seeded request gives sibling 0 the seed itself (so n=1 and choice 0
agree) and every other sibling a seed derived from (seed, i), so their draws differ.

The prompt is computed once: siblings 1..n-1 are held back until sibling 0 (the leader)
has scheduled its whole prompt, then find its full blocks in the prefix cache and compute
only the last, partial block. Without prefix caching, or when every prompt token's logits
are wanted (prompt logprobs), there is nothing to share and siblings start on their own.
"""

from __future__ import annotations

import hashlib

import msgspec

from services.scheduler.block_manager import num_blocks_for
from shared.messages import GenerateRequest, choice_request_ids

MAX_SEED = 2**63 - 1


def derived_seed(seed: int, index: int) -> int:
    """Sibling ``index``'s seed: the first 8 bytes of BLAKE2b("{seed}:{index}"), big endian,
    masked to 0..2**63-1. Sibling 0 keeps ``seed``."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") & MAX_SEED


def sibling_requests(request: GenerateRequest) -> list[GenerateRequest]:
    """One GenerateRequest per sequence (just ``request`` when n == 1)."""
    if request.n == 1:
        return [request]
    siblings = []
    for index, request_id in enumerate(choice_request_ids(request.request_id, request.n)):
        sampling = request.sampling
        if sampling.seed is not None:
            sampling = msgspec.structs.replace(sampling, seed=derived_seed(sampling.seed, index))
        siblings.append(msgspec.structs.replace(request, request_id=request_id, sampling=sampling, n=1))
    return siblings


def shares_prompt(request: GenerateRequest, prefix_caching: bool) -> bool:
    """Whether siblings 1..n-1 reuse the leader's prompt blocks."""
    return request.n > 1 and prefix_caching and request.sampling.prompt_logprobs is None


def num_blocks_needed(request: GenerateRequest, block_size: int, prefix_caching: bool) -> int:
    """KV blocks for all n sequences at full length: each its own, less the full prompt
    blocks the siblings share with the leader (all but the last prompt token's block)."""
    num_each = num_blocks_for(len(request.prompt_token_ids) + request.sampling.max_tokens, block_size)
    num_shared = (len(request.prompt_token_ids) - 1) // block_size \
        if shares_prompt(request, prefix_caching) else 0
    return num_shared + request.n * (num_each - num_shared)
