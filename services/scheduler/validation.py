"""Which requests a scheduler refuses before queueing them (InvalidRequest, a 400). Pure."""

from __future__ import annotations

from collections.abc import Container

from services.scheduler.block_manager import BlockManager
from services.scheduler.siblings import num_blocks_needed
from shared.errors import InvalidRequest
from shared.messages import GenerateRequest, choice_request_ids


def validate_request(request: GenerateRequest, requests: Container[str], max_model_len: int,
                     block_manager: BlockManager, prefix_caching: bool) -> None:
    """Raise InvalidRequest unless ``request`` can run here: ids not in ``requests``, a
    prompt, max_tokens within the context, and a KV cache big enough for all of it."""
    if request.n < 1:
        raise InvalidRequest(f"n must be at least 1, not {request.n}", param="n")
    for request_id in choice_request_ids(request.request_id, request.n):
        if request_id in requests:
            raise InvalidRequest(f"duplicate request id {request_id}", param="request_id")
    num_prompt = len(request.prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if request.output_token_ids and (request.n != 1 or len(request.output_token_ids)
                                     >= request.sampling.max_tokens):
        raise InvalidRequest("a resumed request needs n = 1 and fewer output tokens than "
                             "max_tokens", param="output_token_ids")
    for image in request.images:
        if image.offset < 0 or image.length < 1 or image.offset + image.length > num_prompt:
            raise InvalidRequest(f"an image's placeholders [{image.offset}, "
                                 f"{image.offset + image.length}) lie outside the prompt of "
                                 f"{num_prompt} tokens", param="messages")
    num_total = num_prompt + request.sampling.max_tokens
    if num_total > max_model_len:
        raise InvalidRequest(
            f"prompt ({num_prompt} tokens) plus max_tokens ({request.sampling.max_tokens}) is "
            f"{num_total} tokens, over the model's context length of {max_model_len}",
            param="max_tokens", code="context_length_exceeded")
    num_blocks = num_blocks_needed(request, block_manager.block_size, prefix_caching)
    if num_blocks > block_manager.num_blocks:
        what = "the request needs" if request.n == 1 else \
            f"the request's {request.n} sequences need"
        raise InvalidRequest(
            f"{what} {num_blocks * block_manager.block_size} tokens of KV cache; this replica's "
            f"cache holds {block_manager.num_blocks * block_manager.block_size}",
            param="max_tokens" if request.n == 1 else "n", code="kv_cache_too_small")
