"""The wire contract: every message exchanged between flotilla services.

The kvstore's own protocol and the step plan's KV parts are in shared/kv_messages.py, the schedulers' stats in
shared/scheduler_stats.py, LoRA adapters' identity and run-time load/unload in
shared/lora_adapters.py (all encoded by ``encode``/``decode`` here). All messages are
frozen msgspec Structs encoded as MessagePack. From the first
release on, evolve them only by adding fields with defaults, so an old peer still decodes a
new message; until then the protocol changes freely. Hot-path
messages (step plans, results, token outputs) use ``array_like=True`` (positional
encoding, no field names on the wire) and ``gc=False``; for those, new fields go last.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec
from msgspec import Struct

from shared import kv_messages, scheduler_stats
from shared.lora_adapters import (  # (their wire messages live there)
    BaseShapes, LoraLoadRequest, LoraRef, LoraReply, LoraUnloadRequest,
)
from shared.kv_messages import KvLoad, KvStoreRun  # noqa: F401 (the plan's; re-exported)
from shared.media_messages import ContentPart, ImageInput  # noqa: F401 (re-exported)

T = TypeVar("T")


# ----------------------------------------------------------------- common
class ErrorInfo(Struct, frozen=True, kw_only=True):
    """An error carried across the bus (reply header) or inside a request's output.

    ``status`` is the HTTP status the gateway should answer with; ``type`` and
    ``code`` follow OpenAI's error object.
    """

    status: int
    message: str
    type: str = "internal_error"
    code: str | None = None
    param: str | None = None


class HealthReply(Struct, frozen=True, kw_only=True):
    service: str
    instance_id: str
    status: str = "ok"
    detail: dict[str, str | int | float | bool] = {}


class Empty(Struct, frozen=True):
    """A request with no arguments (health checks, info queries)."""


# ----------------------------------------------------------------- sampling
class StructuredSpec(Struct, frozen=True, kw_only=True, gc=False):
    """A constraint on the output text, enforced by a token mask while sampling.

    ``kind`` is ``json_object`` (any JSON object) or ``json_schema`` (``json_schema`` holds
    the schema as JSON text, already validated by the gateway).
    """

    kind: str
    json_schema: str = ""


class SamplingParams(Struct, frozen=True, kw_only=True, gc=False):
    """How to pick each next token, and when to stop (token-level conditions only;
    stop strings are the tokenizer's job)."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # divides (or multiplies, if negative) logits of prompt+output tokens
    logit_bias: dict[int, float] = {}  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens exist
    # None: no logprobs; k >= 0: the sampled token's log-probability and the k most likely
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    structured: StructuredSpec | None = None
    speculative: bool = True  # False: never drafted for (--speculative-config), this request

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)


class TokenLogprobs(Struct, frozen=True, array_like=True, gc=False):
    """The log-probabilities behind one token: its own, and the ``k`` most likely
    (log_softmax of the model's raw logits, before any sampling adjustment)."""

    token_id: int
    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


# ----------------------------------------------------------------- tokenizer
class FunctionCall(Struct, frozen=True, kw_only=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Struct, frozen=True, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct, frozen=True, kw_only=True, omit_defaults=True):
    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None  # a tool turn: which call this result answers
    # a message with images: its parts in order (content then holds its text alone)
    parts: list[ContentPart] | None = None


class EncodeRequest(Struct, frozen=True, kw_only=True):
    """Exactly one of ``prompt`` (raw text or token ids) or ``messages`` (chat) is set."""

    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    # OpenAI tool definitions ({"type": "function", "function": {...}}) for the chat template
    tools: list[dict[str, Any]] | None = None
    # the encoded images (PNG, JPEG, ...) the messages' image parts name, in order, fetched
    # and checked against the byte limit by the gateway (docs/vision.md)
    images: list[bytes] = []


class EncodeReply(Struct, frozen=True, kw_only=True):
    token_ids: list[int]
    images: list[ImageInput] = []  # the request's images, preprocessed, in prompt order


class DecodeRequest(Struct, frozen=True, kw_only=True):
    token_ids: list[int]
    skip_special_tokens: bool = True


class DecodeReply(Struct, frozen=True, kw_only=True):
    text: str


class GenerationDefaults(Struct, frozen=True, kw_only=True):
    """The model's own sampling defaults (its generation_config.json), applied by the
    gateway to a request that leaves the parameter out; None: the model sets none."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_new_tokens: int | None = None


class TokenizerInfo(Struct, frozen=True, kw_only=True):
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    has_chat_template: bool
    generation_defaults: GenerationDefaults = GenerationDefaults()
    # what a completions prompt of "" or null starts from (<|endoftext|>, else BOS, else EOS)
    document_start_token_id: int | None = None
    accepts_images: bool = False  # a vision-language model (docs/vision.md)


# ----------------------------------------------------------------- scheduler
class GenerateRequest(Struct, frozen=True, kw_only=True):
    """gateway -> scheduler: a tokenized request to run."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    output_subject: str  # where this request's RequestOutputs are published
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first (with --scheduling-policy priority)
    cache_salt: str | None = None  # isolates this tenant's prefix-cache entries
    # n > 1: n sequences from one prompt (ids from choice_request_ids), sharing its KV blocks
    n: int = 1
    # a migrated request (its replica died): the tokens it had generated, which the client
    # already has; the scheduler resumes after them as after a preemption (n must be 1)
    output_token_ids: list[int] = []
    # the LoRA adapter it runs with, by its registered name ("": the base model)
    lora_name: str = ""
    # the prompt's images, in prompt order (vision-language models; docs/vision.md)
    images: list[ImageInput] = []


def choice_request_ids(request_id: str, n: int) -> list[str]:
    """The ids under which the n sequences of a request run and report."""
    return [request_id] if n == 1 else [f"{request_id}-{index}" for index in range(n)]


class SubmitReply(Struct, frozen=True, kw_only=True):
    scheduler_id: str  # aborts for this request go to this scheduler


class AbortRequest(Struct, frozen=True, kw_only=True):
    request_ids: list[str]


class RequestOutput(Struct, frozen=True, array_like=True, gc=False, kw_only=True):
    """scheduler -> gateway: the tokens one request produced in one step. Keyword-only: nine
    fields are too many to read by position (the wire order is still the field order)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    num_prompt_tokens: int = 0
    error: ErrorInfo | None = None
    # set on a request's first output only:
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    queue_time_s: float = 0.0  # arrival to first scheduled
    logprobs: list[TokenLogprobs] = []  # one per new token, when the request asked
    # first output only, when asked: one per prompt token (the first has none: None)
    prompt_logprobs: list[TokenLogprobs | None] = []

    @classmethod
    def failure(cls, request_id: str, num_prompt_tokens: int, error: ErrorInfo) -> RequestOutput:
        """The last output of a request that failed: no tokens, finish_reason "error"."""
        return cls(request_id=request_id, new_token_ids=[], finish_reason="error",
                   num_prompt_tokens=num_prompt_tokens, error=error)


class OutputBatch(Struct, frozen=True, array_like=True, gc=False):
    outputs: list[RequestOutput]
    # wall clock (time.time()) when the scheduler sent it; 0: not stamped. The gateway's
    # delivery-lag metric (publish -> chunk written) reads it: across hosts it includes
    # their clock offset.
    published_at: float = 0.0


class SchedulerBlockEvent(Struct, frozen=True, kw_only=True):
    """scheduler -> gateways (routing): block hashes that became findable in its GPU
    prefix cache, or left it, since the last event (the last change of a hash wins).
    ``seq`` counts up from 1 per ``scheduler_id``; a restarted scheduler has a new id (its
    epoch), and a gap means missed events (ask for a snapshot)."""

    scheduler_id: str
    replica_id: str
    seq: int
    stored_hashes: list[bytes] = []
    removed_hashes: list[bytes] = []
    timestamp: float = 0.0


class BlockSnapshotRequest(Struct, frozen=True, kw_only=True):
    """gateway -> one scheduler (or kvstore): every block hash it holds now, a page at a
    time. ``offset`` 0 takes a new snapshot; later pages name it by its ``snapshot_seq``."""

    offset: int = 0
    snapshot_seq: int = 0


class BlockSnapshotPart(Struct, frozen=True, kw_only=True):
    namespace: str = ""  # a kvstore namespace; "" for a scheduler's GPU cache
    tier: str = "gpu"  # "gpu", "host" or "disk"
    block_hashes: list[bytes] = []


class BlockSnapshotReply(Struct, frozen=True, kw_only=True):
    """One page of a snapshot: the holder's state after its event ``seq`` (later events
    apply on top); ``num_hashes`` in the whole snapshot, this page's from ``offset``."""

    source_id: str  # the scheduler_id, or the kvstore's store_id
    seq: int
    num_hashes: int
    offset: int = 0
    parts: list[BlockSnapshotPart] = []


# ----------------------------------------------------------------- worker
class NewRequestData(Struct, frozen=True, array_like=True, gc=False):
    """A request the worker has not seen (or must recompute after preemption):
    sent in full once; afterwards only its id and new blocks travel."""

    request_id: str
    token_ids: list[int]  # prompt, plus outputs so far when resumed
    sampling: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int = 0
    # how many of token_ids are the prompt (0: all of them); a resumed request's seeded
    # draws continue from its output index
    num_prompt_tokens: int = 0
    # the LoRA adapter the request runs with, by its registered name ("": the base model)
    lora_name: str = ""
    # the request's W3C trace context, set only where the scheduler makes spans: the
    # worker's span of the step that first computes it joins its trace (docs/tracing.md)
    traceparent: str = ""
    # the adapter's directory and content hash (shared/lora_adapters.py), so a worker
    # registers an adapter loaded at run time on first use, and a reloaded one anew
    lora_path: str = ""
    lora_hash: str = ""
    # the prompt's images whose placeholders are not computed yet (docs/vision.md)
    images: list[ImageInput] = []


class ScheduledRequest(Struct, frozen=True, array_like=True, gc=False):
    request_id: str
    num_new_tokens: int  # tokens to compute this step, from the worker's num_computed
    new_block_ids: list[int] = []
    # speculative decoding: positions guessed to follow the request's last known token,
    # computed in this step after it (num_new_tokens counts them) and verified against the
    # model; what was kept comes back in StepResult.accepted_draft_ids
    num_drafts: int = 0
    # the drafts' tokens where the scheduler proposed them (n-gram, suffix); [] where the
    # worker's proposer fills the slots (its draft model: method draft_model)
    draft_token_ids: list[int] = []


class StepPlan(Struct, frozen=True, array_like=True, gc=False):
    step_id: int
    new_requests: list[NewRequestData]
    scheduled: list[ScheduledRequest]  # in batch order; includes the new requests
    finished_request_ids: list[str] = []  # forget these (finished, aborted, preempted)
    # the worker instance the scheduler attached to: a restarted worker (empty cache) refuses
    # the plan rather than read KV it never computed; "" skips the check
    worker_id: str = ""
    kv_loads: list[KvLoad] = []  # before the step: host slots -> KV blocks
    kv_stores: list[KvStoreRun] = []  # after the step: KV blocks -> the kvstore
    # LoRA adapter versions unloaded or replaced that no request uses any more
    # (LoraRef.cache_key, "name:content hash"): the worker drops its copies
    forgotten_loras: list[str] = []


class StepResult(Struct, frozen=True, array_like=True, gc=False):
    """One sampled token for every scheduled request that reached the end of its
    known tokens this step (a partial prompt chunk samples nothing)."""

    step_id: int
    request_ids: list[str]
    sampled_token_ids: list[int]
    step_time_s: float = 0.0
    # aligned with request_ids: the sampled token's logprobs where the request asked
    logprobs: list[TokenLogprobs | None] = []
    # request id -> logprobs of the prompt tokens computed this step (positions 1.., in order)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # the plan's kv_loads: bytes copied from host slots, and how fast (0: none this step)
    kv_load_bytes: int = 0
    kv_load_bytes_per_s: float = 0.0
    # aligned with request_ids when the step verified drafts: the drafts each request kept,
    # in order (they precede its sampled token; [] for one given none); [] when none were sent
    accepted_draft_ids: list[list[int]] = []
    # the draft model's catch-up this step: tokens it computed besides each drafted request's
    # last known one (a request new to drafts: its context), a one-off cost the scheduler's
    # draft cap leaves out of its step times
    num_draft_catch_up_tokens: int = 0
    # a MoE model's routing since the worker's previous report (about once a second, on
    # some results only): [sparse layer, in layer order][global expert id] -> tokens routed
    # there; [] when the model is dense or this result carries no report
    expert_token_counts: list[list[int]] = []
    # the vision encoder this step (docs/vision.md): images run through it, images its
    # cache already held, and its seconds
    num_images_encoded: int = 0
    num_encoder_cache_hits: int = 0
    encoder_time_s: float = 0.0
    # new requests of the plan the worker refused at arrival (an adapter it cannot read:
    # arrival_refusals.py), each with its reason; the rest of the step ran without them
    refused_request_ids: list[str] = []
    refusal_reasons: list[str] = []

    @property
    def num_accepted_drafts(self) -> list[int]:
        """Per request (aligned with request_ids), the drafts kept; [] when none were sent."""
        return [len(kept) for kept in self.accepted_draft_ids]


class WorkerInfo(Struct, frozen=True, kw_only=True):
    worker_id: str
    replica_id: str
    model_name: str
    num_blocks: int
    block_size: int
    max_model_len: int
    eos_token_ids: list[int]
    kv_cache_bytes: int
    device: str
    dtype: str
    # the kvstore this worker is attached to ("": none); the scheduler looks prefixes up there
    kv_namespace: str = ""
    kv_node_id: str = ""
    # the draft model that fills draft slots (speculative decoding's draft_model; "": none)
    draft_model: str = ""
    # with LoRA enabled: what an adapter must fit (the scheduler checks adapters loaded at
    # run time against it); None: LoRA off
    lora_base: BaseShapes | None = None


# Every message type, for tests and tooling.
ALL_MESSAGES: tuple[type[Struct], ...] = (
    ErrorInfo, HealthReply, Empty, StructuredSpec, SamplingParams, TokenLogprobs, FunctionCall,
    ToolCall, ChatMessage, EncodeRequest, EncodeReply, DecodeRequest, DecodeReply,
    GenerationDefaults, TokenizerInfo, GenerateRequest, SubmitReply, AbortRequest, RequestOutput,
    OutputBatch, SchedulerBlockEvent, BlockSnapshotRequest, BlockSnapshotPart,
    BlockSnapshotReply, NewRequestData, ScheduledRequest, StepPlan, StepResult, WorkerInfo,
    LoraRef, BaseShapes, LoraLoadRequest, LoraUnloadRequest, LoraReply,
    *kv_messages.KV_MESSAGES, *scheduler_stats.STATS_MESSAGES,
)

_encoder = msgspec.msgpack.Encoder()


def encode(message: Struct) -> bytes:
    return _encoder.encode(message)


_decoders: dict[type, msgspec.msgpack.Decoder] = {}


def decode(data: bytes, message_type: type[T]) -> T:
    decoder = _decoders.get(message_type)
    if decoder is None:
        decoder = _decoders[message_type] = msgspec.msgpack.Decoder(message_type)
    return decoder.decode(data)
