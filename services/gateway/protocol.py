"""OpenAI request schemas: validation, and the request bodies /openapi.json publishes.

Every parameter of OpenAI's chat-completions and completions requests is declared here
and is one of three kinds (docs/openai-api.md has the table): implemented; accepted and
ignored, because it has no effect on a self-hosted model (``store: false``, ``metadata``,
``service_tier``...); or refused with a 400 naming it, because honouring it is impossible
here (audio output, web search...). A null means the parameter's default. Unknown
parameters are a 400, as with OpenAI, unless the gateway runs with
``--accept-unknown-fields`` (then they are dropped and logged). Extensions (vLLM's names):
top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority,
cache_salt; and flotilla's own ``speculative`` (false: no speculative drafts for this
request).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
import structlog
from pydantic import Field, StringConstraints, ValidationError, field_validator, model_validator

from services.gateway.chat_params import (ChatMessageParam, PredictionContent, ResponseFormat,
                                          Tool, ToolChoice, tools_and_choice)
from services.gateway.request_base import (OpenAIModel, ParameterError, exact_ints, only_null,
                                           only_schema, refuse_if)
from shared.errors import InvalidRequest
from shared.messages import GenerationDefaults, SamplingParams, StructuredSpec

log = structlog.get_logger()

MAX_N = 128  # sequences per request (n, best_of; over all prompts of a batch)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20  # chat top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs, as OpenAI
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
SAMPLING_EPS = 1e-5  # a temperature or top_p below this is greedy
MIN_REPETITION_PENALTY = 0.01  # logits are divided by it: smaller ones overflow

INT32_LIMIT = 2**31  # counts and token ids fit an int32: anything larger is a 400, not an
# overflow deeper in (msgpack carries at most 64 bits)
TokenId = Annotated[int, Field(ge=0, lt=INT32_LIMIT)]
_TOKEN_ID_CHECK = Annotated[int, msgspec.Meta(ge=0, lt=INT32_LIMIT)]  # the same bounds, in C
TokenIdKey = Annotated[str, StringConstraints(pattern=r"^-?[0-9]+$")]
LogitBias = Annotated[float, Field(ge=-100.0, le=100.0)]
# parameters whose value is a map: an error inside one names the parameter itself
_MAP_PARAMETERS = ("logit_bias", "metadata")
_DEPRECATED = {"deprecated": True}  # in OpenAI's schema


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # ignored: no obfuscation padding is added
    # extension (vLLM's): with include_usage, every chunk carries the usage so far
    continuous_usage_stats: bool = False


class _SamplingFields(OpenAIModel):
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)  # 0: the top token only
    top_k: int | None = Field(default=None, ge=-1, lt=INT32_LIMIT)  # extension; -1, 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(default=0, ge=0, lt=INT32_LIMIT)  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, ge=MIN_REPETITION_PENALTY,
                                              le=10.0)  # extension
    logit_bias: dict[TokenIdKey, LogitBias] | None = None  # {"token id": bias}
    user: str | None = None  # an end-user id: with --routing kv, its requests share a replica
    # extension: lower runs first under --scheduling-policy priority
    priority: int = Field(default=0, ge=-INT32_LIMIT, lt=INT32_LIMIT)
    cache_salt: str | None = Field(default=None, min_length=1)  # extension: prefix-cache isolation
    speculative: bool = True  # extension (flotilla's): false opts out of speculative drafts

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "stream_options is only allowed when "
                                 "stream is true", code="invalid_value")
        return self

    @property
    def stop_strings(self) -> list[str]:
        """The stop strings; an empty one could only stop before any text, so it is none."""
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [stop for stop in stops if stop]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every chunk (vLLM's ``continuous_usage_stats``, with include_usage)."""
        return self.include_usage and self.stream_options.continuous_usage_stats

    @property
    def session_key(self) -> str | None:
        """What keeps a conversation on one replica (routing.py's sessions)."""
        return self.user

    def sampling_params(self, max_tokens: int, vocab_size: int, *,
                        defaults: GenerationDefaults = GenerationDefaults(),
                        logprobs: int | None = None, prompt_logprobs: int | None = None,
                        structured: StructuredSpec | None = None) -> SamplingParams:
        """The request's sampling; a parameter it leaves out takes the model's default
        (generation_config.json), then OpenAI's."""
        if self.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                 f"({max_tokens})", param="min_tokens")
        for token_id in self.stop_token_ids or []:
            _check_token_id(token_id, vocab_size, "stop_token_ids")
        top_p = _first(self.top_p, defaults.top_p, 1.0)
        top_k = max(0, _first(self.top_k, defaults.top_k, 0))
        if top_p < SAMPLING_EPS:  # (next to) no probability mass: only the top token is left
            top_p, top_k = 1.0, 1
        temperature = _first(self.temperature, defaults.temperature, 1.0)
        if temperature < SAMPLING_EPS:  # logits / a tiny temperature overflow: it is greedy
            temperature = 0.0
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature,
            top_p=top_p, top_k=top_k, seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_p=_first(self.min_p, defaults.min_p, 0.0),
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=_first(self.repetition_penalty, defaults.repetition_penalty, 1.0),
            logit_bias=_logit_bias(self.logit_bias, vocab_size), min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured,
            speculative=self.speculative)


def _first(*values):
    return next(value for value in values if value is not None)


def _check_token_id(token_id: int, vocab_size: int, param: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise InvalidRequest(f"token id {token_id} is outside the vocabulary of {vocab_size} "
                             "tokens", param=param)


def _logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]} as token ids."""
    biases: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        token_id = int(key)
        _check_token_id(token_id, vocab_size, "logit_bias")
        biases[token_id] = float(bias)
    return biases


def default_max_tokens(defaults: GenerationDefaults, operator_limit: int) -> int | None:
    """The output limit of a request that sets none: the smaller of the model's
    max_new_tokens and the gateway's --max-tokens-default (0: none); None: no limit but
    the context."""
    limits = [limit for limit in (defaults.max_new_tokens, operator_limit or None) if limit]
    return min(limits) if limits else None


Prompt = str | list[str] | Annotated[list[TokenId], Field(min_length=1)] | \
    list[list[TokenId]] | None


class CompletionRequest(_SamplingFields):
    prompt: Prompt  # "" or null: the model starts a new document
    max_tokens: int = Field(default=COMPLETIONS_DEFAULT_MAX_TOKENS, ge=1, lt=INT32_LIMIT)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = Field(default=None, json_schema_extra=only_schema(
        {"type": "string", "maxLength": 0}, "no insertion (fill-in-the-middle)"))

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids_at_once(cls, value: Any, validate):
        """A valid token-id prompt is taken as checked in C: pydantic's union would first
        try it as a list of strings, making an error per id (~3.5 ms for 16k ids). Anything
        else goes through the union, so every error reads as before."""
        if isinstance(value, list) and value:
            token_ids = exact_ints(value, _TOKEN_ID_CHECK)
            if token_ids is not None:
                return token_ids
        return validate(value)

    @model_validator(mode="after")
    def _check_completion(self):
        refuse_if(bool(self.suffix), "suffix", "suffix is not supported")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise ParameterError("best_of", f"best_of ({self.best_of}) must be at "
                                     f"least n ({self.n})", code="invalid_value")
            if self.stream and self.best_of > 1:
                raise ParameterError("best_of", "best_of cannot be used with stream",
                                     code="invalid_value")
        return self

    @property
    def num_sequences(self) -> int:
        """Sequences to generate: best_of of them, of which the n best are returned."""
        return self.best_of or self.n

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of strings or of token
        lists); an empty prompt stays empty (``prompts_or_document_start`` fills it)."""
        prompt = self.prompt
        if prompt is None:
            prompts: list = [""]
        elif isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompts = list(prompt)
        else:
            prompts = [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        if not prompts:
            raise InvalidRequest("prompt must not be an empty list", param="prompt")
        if any(isinstance(p, list) and not p for p in prompts):
            raise InvalidRequest("a token-id prompt must not be empty", param="prompt")
        if len(prompts) * self.num_sequences > MAX_N:
            raise InvalidRequest(f"prompts x {'best_of' if self.best_of else 'n'} must be at most "
                                 f"{MAX_N}", param="prompt")
        return prompts

    def prompts_or_document_start(self, document_start_token_id: int | None
                                  ) -> list[str | list[int]]:
        """The prompts, an empty one (or a null prompt) replaced by the token that starts
        a document, so the model writes as from the start of a new one (as OpenAI does)."""
        prompts = self.prompts
        if document_start_token_id is None:
            if any(p == "" for p in prompts):
                raise InvalidRequest("prompt must not be empty", param="prompt")
            return prompts
        return [[document_start_token_id] if p == "" else p for p in prompts]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, lt=INT32_LIMIT,
                                   json_schema_extra=_DEPRECATED)
    max_completion_tokens: int | None = Field(default=None, ge=1, lt=INT32_LIMIT)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # true: kept in the response store, readable and resumable (docs/openai-api.md)
    store: bool | None = None
    # accepted and ignored: no effect on a self-hosted model (docs/openai-api.md)
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None  # with --routing kv, its requests share a replica
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    safety_identifier: str | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    modalities: list[Literal["text", "audio"]] | None = Field(
        default=None, json_schema_extra=only_schema({"type": "array", "items": {"const": "text"}},
                                                    "text output only"))
    prediction: PredictionContent | None = None  # a speed-up hint; the output is the same
    # refused unless null: they cannot be honoured here (the schema says null only)
    audio: dict[str, Any] | None = Field(default=None, json_schema_extra=only_null(
        "audio output is not supported"))
    web_search_options: dict[str, Any] | None = Field(default=None, json_schema_extra=only_null(
        "web search is not supported"))
    moderation: dict[str, Any] | None = Field(default=None, json_schema_extra=only_null(
        "moderation is not supported"))
    functions: list[dict[str, Any]] | None = Field(default=None, json_schema_extra=only_null(
        "deprecated: declare tools", deprecated=True))
    function_call: str | dict[str, Any] | None = Field(default=None, json_schema_extra=only_null(
        "deprecated: use tool_choice", deprecated=True))

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs", "top_logprobs requires logprobs to be "
                                 "true", code="invalid_value")
        refuse_if(bool(self.store) and self.n != 1, "store", "store: true takes n = 1")
        refuse_if("audio" in (self.modalities or []), "modalities",
                  "audio output is not supported: modalities may only hold 'text'")
        refuse_if(self.audio is not None, "audio", "audio output is not supported")
        refuse_if(self.web_search_options is not None, "web_search_options",
                  "web search is not supported")
        refuse_if(self.moderation is not None, "moderation", "moderation is not supported")
        refuse_if(self.functions is not None, "functions",
                  "functions is deprecated and not supported: declare 'tools'")
        refuse_if(self.function_call is not None, "function_call",
                  "function_call is deprecated and not supported: use 'tool_choice'")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """None without logprobs; else how many top alternatives each token shows."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def session_key(self) -> str | None:
        return self.prompt_cache_key or self.user

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tools_and_choice(self) -> tuple[list[dict] | None, str | dict | None]:
        """tools and tool_choice as tool_calls.plan_tools takes them."""
        return tools_and_choice(self.tools, self.tool_choice)


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    tools: list[Tool] | None = None  # counted as the chat template renders them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    def tool_dicts(self) -> list[dict] | None:
        return tools_and_choice(self.tools, None)[0]


class DetokenizeHTTPRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


class LoadLoraAdapterRequest(OpenAIModel):
    """vLLM's /v1/load_lora_adapter body (docs/lora.md)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # replace an adapter registered under this name


class UnloadLoraAdapterRequest(OpenAIModel):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # vLLM's; accepted, adapters are named here


def parse_request(model_cls: type[OpenAIModel], payload: Any,
                  accept_unknown_fields: bool = False):
    """Validate ``payload``; any problem becomes an InvalidRequest naming the parameter.
    With ``accept_unknown_fields``, top-level parameters the model does not declare are
    dropped and logged instead."""
    if accept_unknown_fields and isinstance(payload, dict):
        unknown = sorted(set(payload) - set(model_cls.model_fields))
        if unknown:
            log.info("unknown_fields_ignored", request=model_cls.__name__, fields=unknown)
            payload = {k: v for k, v in payload.items() if k not in unknown}
    try:
        return model_cls.model_validate(payload)
    except ValidationError as exc:
        raise _invalid_request(exc.errors()) from None


def _invalid_request(errors: list[dict]) -> InvalidRequest:
    """The error to report: one a validator raised on purpose (it names its parameter)
    before pydantic's own, e.g. of the other members of a union."""
    for error in errors:
        ctx_error = (error.get("ctx") or {}).get("error")
        if isinstance(ctx_error, ParameterError):
            return InvalidRequest(str(ctx_error), param=ctx_error.param, code=ctx_error.code)
    error = errors[0]
    loc = error["loc"]
    location = (str(loc[0]) if loc and loc[0] in _MAP_PARAMETERS else
                ".".join(str(part) for part in loc)) or None
    if error["type"] == "extra_forbidden":
        return InvalidRequest(f"Unrecognized request argument supplied: {location}",
                              param=location)
    message = error["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"{location}: {message}" if location else message, param=location)
