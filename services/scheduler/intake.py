"""A request between its arrival and its place in the queue, pure. The core validates it
(the one time), gives it its place in line and, when its connector looks requests up in a
kvstore, the blocks to ask about (``PrefixQuery``); the service then asks the connector
for a hit (an await) and the core queues it. ``Arrivals`` holds the requests in between:
a duplicate of one is refused at once, and an abort meanwhile is kept for when it queues.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from services.scheduler.block_manager import BlockManager
from services.scheduler.request import Request, TierHit
from services.scheduler.siblings import shares_prompt, sibling_requests
from shared.lora_adapters import LoraRef
from shared.messages import GenerateRequest, choice_request_ids
from shared.prefix_hash import extra_keys, image_keys, usable_block_hashes


@dataclass(frozen=True)
class PrefixQuery:
    """What to ask the kvstore about a request: its usable full blocks' hashes (all but
    the block of its last token), of which the first ``num_gpu_blocks`` are cached here."""

    block_hashes: list[bytes]
    num_gpu_blocks: int


@dataclass(eq=False)
class Arrival:
    """A validated request with its place in line (taken on arrival, before any lookup)."""

    request: GenerateRequest
    seq: int
    query: PrefixQuery | None  # None: no lookup (no kvstore, or it cannot use cached blocks)
    lora: LoraRef | None = None  # its adapter (None: the base model)
    request_ids: list[str] = field(init=False)  # its n choices'
    aborted: bool = False  # an abort came while it was being looked up

    def __post_init__(self) -> None:
        self.request_ids = choice_request_ids(self.request.request_id, self.request.n)

    @property
    def token_ids(self) -> list[int]:
        """Its known tokens: the prompt, and the outputs of a resumed request."""
        return [*self.request.prompt_token_ids, *self.request.output_token_ids]

    @property
    def block_hashes(self) -> list[bytes]:
        """The query's block hashes (not computed twice), or none yet."""
        return list(self.query.block_hashes) if self.query is not None else []


def request_keys(request: GenerateRequest, model_name: str,
                 lora: LoraRef | None) -> tuple[str, ...]:
    """The prefix-cache extra keys of a request's blocks (shared/prefix_hash.py)."""
    return extra_keys(model_name, request.cache_salt, lora.cache_key if lora else "")


def request_image_keys(request: GenerateRequest) -> tuple[tuple[int, str], ...]:
    """Its images' keys, each for the block of its first placeholder (prefix_hash.py)."""
    return image_keys([(image.offset, image.hash) for image in request.images])


def prefix_query(request: GenerateRequest, block_manager: BlockManager, model_name: str,
                 prefix_caching: bool, lora: LoraRef | None = None) -> PrefixQuery | None:
    """The blocks of a request to look up in the kvstore, or None when it cannot use
    cached blocks (no prefix caching, or every prompt token's logprobs wanted)."""
    if not prefix_caching or request.sampling.prompt_logprobs is not None:
        return None
    token_ids = list(request.prompt_token_ids) + list(request.output_token_ids)
    block_hashes = usable_block_hashes(token_ids, block_manager.block_size,
                                       request_keys(request, model_name, lora),
                                       request_image_keys(request))
    num_gpu = len(block_manager.cached_prefix(block_hashes, token_ids))
    return PrefixQuery(block_hashes, num_gpu)


def queue_entries(arrival: Arrival, tier_hit: TierHit | None, seqs: Iterator[int],
                  model_name: str, by_priority: bool, prefix_caching: bool) -> list[Request]:
    """What an arrived request queues as: its n siblings (siblings.py), the leader first
    with the arrival's place in line and ``tier_hit`` (its siblings then find those
    blocks in the GPU prefix cache), the others next from ``seqs``."""
    request = arrival.request
    priority = request.priority if by_priority else 0
    arrival_time = request.arrival_time or time.time()
    shares = shares_prompt(request, prefix_caching)
    entries: list[Request] = []
    for sibling in sibling_requests(request):
        leader = entries[0] if entries else None
        entries.append(Request(
            sibling.request_id, list(request.prompt_token_ids), sibling.sampling,
            request.output_subject, (priority, next(seqs) if leader else arrival.seq),
            request_keys(request, model_name, arrival.lora), arrival_time,
            images=request.images, image_keys=request_image_keys(request),
            leader=leader if shares else None,
            output_token_ids=list(request.output_token_ids),
            num_outputs_sent=1 if request.output_token_ids else 0,
            block_hashes=arrival.block_hashes, tier_hit=None if leader else tier_hit,
            lora=arrival.lora))
    return entries


class Arrivals:
    """The requests that arrived and are not queued yet, by request id."""

    def __init__(self) -> None:
        self._by_id: dict[str, Arrival] = {}

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, arrival: Arrival) -> None:
        self._by_id.update(dict.fromkeys(arrival.request_ids, arrival))

    def remove(self, arrival: Arrival) -> None:
        for request_id in arrival.request_ids:
            if self._by_id.get(request_id) is arrival:
                del self._by_id[request_id]

    def abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            arrival = self._by_id.get(request_id)
            if arrival is not None:
                arrival.aborted = True
