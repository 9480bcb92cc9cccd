"""A request as the scheduler tracks it: token counts, block table, prefix-cache keys."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from shared.lora_adapters import LoraRef
from shared.messages import ImageInput, NewRequestData, SamplingParams, TokenLogprobs


@dataclass(frozen=True)
class TierHit:
    """A kvstore hit pinned for a request (docs/kvstore.md): its blocks
    ``first_block_index``.. are in these host slots (their tokens confirmed against the
    request's), held under ``pin_id`` until the scheduler releases it."""

    pin_id: str
    store_id: str  # the kvstore process that pinned them
    first_block_index: int
    slot_ids: tuple[int, ...]
    tiers: tuple[str, ...]  # where each block was found: "host" or "disk"


@dataclass(eq=False)  # identity: requests are looked up in lists
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_subject: str
    sort_key: tuple[int, int]  # (priority, arrival order): smaller runs first, is preempted last
    extra_keys: tuple[str, ...] = ()  # prefix-cache key parts: model, LoRA, cache salt
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    # tokens computed or being computed by steps already sent to the worker
    num_computed_tokens: int = 0
    # tokens the worker samples in steps still in flight (it feeds them into the next
    # step itself; the scheduler learns them from the step's result)
    num_pending_tokens: int = 0
    known_to_worker: bool = False  # the worker holds this request's state
    block_hashes: list[bytes] = field(default_factory=list)  # keys of full blocks, in order
    num_registered_blocks: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at first admission
    first_scheduled_time: float | None = None
    num_outputs_sent: int = 0
    # n > 1: sibling 0, while this sibling waits for it to schedule the shared prompt
    leader: Request | None = None
    # prompt logprobs received so far (until the first output carries them), and the step
    # that (re)sent the request to the worker: results of earlier steps are stale
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    sent_at_step: int = 0
    tier_hit: TierHit | None = None  # a pinned kvstore hit, until admission uses it
    # drafts the step in flight verifies after the last token (speculation.py); until its
    # result, the request's token count after that step is not known: it is not scheduled
    num_drafts: int = 0
    lora: LoraRef | None = None  # its LoRA adapter (None: the base model), kept to the end
    # the prompt's images (pixels included), kept until the request ends: a preempted
    # request recomputes its prompt, and its images with it (docs/vision.md)
    images: list[ImageInput] = field(default_factory=list)
    # their prefix-cache keys, (position, key) each (shared/prefix_hash.py image_keys)
    image_keys: tuple[tuple[int, str], ...] = ()

    @property
    def num_tokens(self) -> int:
        """Tokens known to the scheduler: prompt and outputs received so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_at_worker(self) -> int:
        """Tokens the worker will hold once its in-flight steps finish."""
        return self.num_tokens + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def reached_max_tokens(self) -> bool:
        """No more tokens to schedule: the last ones are already being sampled."""
        return len(self.output_token_ids) + self.num_pending_tokens >= self.sampling.max_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs asked for and not sent yet: the worker computes them for a
        request that comes to it with no outputs, so every prompt token is computed."""
        return self.sampling.prompt_logprobs is not None and not self.output_token_ids

    @property
    def is_prefilling(self) -> bool:
        return self.num_tokens_at_worker - self.num_computed_tokens > 1


def new_request_data(req: Request) -> NewRequestData:
    """The request in full for the worker (its blocks so far; its adapter; its images, the
    pixels only of those a chunk still needs: the others' spans and grids travel, since
    M-RoPE positions depend on every image of the prompt)."""
    lora = req.lora
    return NewRequestData(
        req.request_id, req.all_token_ids, req.sampling, list(req.block_table),
        req.num_computed_tokens, len(req.prompt_token_ids),
        lora_name=lora.name if lora else "", lora_path=lora.path if lora else "",
        lora_hash=lora.content_hash if lora else "",
        images=[image if image.offset + image.length > req.num_computed_tokens
                else msgspec.structs.replace(image, pixels=b"", pixel_table=b"")
                for image in req.images])
