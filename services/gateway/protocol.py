"""OpenAI request schemas (validation) and response shapes.

Parameters OpenAI defines that flotilla does not implement are accepted only at their
no-op values; anything else is a 400 that names the parameter, never silently ignored.
Unknown parameters are a 400 too, as with OpenAI. Extensions (vLLM's names): top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, priority, cache_salt.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.errors import InvalidRequest
from shared.messages import ChatMessage, FunctionCall, SamplingParams, StructuredSpec, ToolCall

MAX_N = 128  # sequences per request (n, best_of; over all prompts of a batch)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_TOP_LOGPROBS = 20  # chat top_logprobs, as OpenAI
MAX_COMPLETION_LOGPROBS = 5  # completions logprobs, as OpenAI


class _Strict(BaseModel):
    # strict: "5" is not a number, as in OpenAI's API
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Strict):
    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; -1 or 0: off
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)  # extension
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    min_tokens: int = Field(default=0, ge=0)  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)  # extension
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = 0  # extension: lower runs first under --scheduling-policy priority
    cache_salt: str | None = Field(default=None, min_length=1)  # extension: prefix-cache isolation

    @model_validator(mode="after")
    def _check_common(self):
        if isinstance(self.stop, list) and len(self.stop) > 16:
            raise _ParameterError("stop", "at most 16 stop strings", code="invalid_value")
        if self.stream_options is not None and not self.stream:
            raise _ParameterError("stream_options", "stream_options is only allowed when "
                                        "stream is true", code="invalid_value")
        if isinstance(self.stop, list) and any(not s for s in self.stop):
            raise _ParameterError("stop", "stop strings must not be empty",
                                        code="invalid_value")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int, vocab_size: int, *, logprobs: int | None = None,
                        prompt_logprobs: int | None = None,
                        structured: StructuredSpec | None = None) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        if self.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must not exceed max_tokens "
                                 f"({max_tokens})", param="min_tokens")
        for token_id in self.stop_token_ids or []:
            _check_token_id(token_id, vocab_size, "stop_token_ids")
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0), seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias=_logit_bias(self.logit_bias, vocab_size), min_tokens=self.min_tokens,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured=structured)


def _check_token_id(token_id: int, vocab_size: int, param: str) -> None:
    if not 0 <= token_id < vocab_size:
        raise InvalidRequest(f"token id {token_id} is outside the vocabulary of {vocab_size} "
                             "tokens", param=param)


def _logit_bias(logit_bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """OpenAI's {"token id": bias in [-100, 100]} as token ids."""
    biases: dict[int, float] = {}
    for key, bias in (logit_bias or {}).items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, not {key!r}",
                                 param="logit_bias") from None
        _check_token_id(token_id, vocab_size, "logit_bias")
        if not -100.0 <= bias <= 100.0:
            raise InvalidRequest(f"logit_bias values must be in [-100, 100], not {bias}",
                                 param="logit_bias")
        biases[token_id] = float(bias)
    return biases


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        _unsupported(bool(self.suffix), "suffix", "suffix is not supported")
        if self.best_of is not None:
            if self.best_of < self.n:
                raise _ParameterError("best_of", f"best_of ({self.best_of}) must be at "
                                            f"least n ({self.n})", code="invalid_value")
            if self.stream and self.best_of > 1:
                raise _ParameterError("best_of", "best_of cannot be used with stream",
                                            code="invalid_value")
        return self

    @property
    def num_sequences(self) -> int:
        """Sequences to generate: best_of of them, of which the n best are returned."""
        return self.best_of or self.n

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts of the request: one, or a batch (a list of strings or of token lists)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompts = list(prompt)
        else:
            prompts = [prompt]
        if len(prompts) > MAX_PROMPTS:
            raise InvalidRequest(f"at most {MAX_PROMPTS} prompts per request", param="prompt")
        if not prompts or any(not p for p in prompts):
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if len(prompts) * self.num_sequences > MAX_N:
            raise InvalidRequest(f"prompts x {'best_of' if self.best_of else 'n'} must be at most "
                                 f"{MAX_N}", param="prompt")
        return prompts


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCallParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str


class ToolCallParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # clients echo back fields we do not use
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_roles(self):
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a message with role 'tool' needs the tool_call_id it answers")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self

    def to_message(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        tool_calls = [ToolCall(id=call.id, function=FunctionCall(
            name=call.function.name, arguments=call.function.arguments))
            for call in self.tool_calls] if self.tool_calls else None
        return ChatMessage(role=self.role, content=content, name=self.name,
                           tool_calls=tool_calls, tool_call_id=self.tool_call_id)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise _ParameterError("top_logprobs", "top_logprobs requires logprobs to be "
                                        "true", code="invalid_value")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """None without logprobs; else how many top alternatives each token shows."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    tools: list[dict[str, Any]] | None = None  # counted as the chat template renders them
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeHTTPRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class _ParameterError(ValueError):
    def __init__(self, param: str, message: str, code: str = "unsupported_parameter") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def _unsupported(condition: bool, param: str, message: str) -> None:
    if condition:
        raise _ParameterError(param, message)


def parse_request(model_cls: type[_Strict], payload: Any):
    """Validate ``payload``; any problem becomes an InvalidRequest naming the parameter."""
    try:
        return model_cls.model_validate(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
        ctx_error = (error.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _ParameterError):
            raise InvalidRequest(str(ctx_error), param=ctx_error.param,
                                 code=ctx_error.code) from None
        location = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise InvalidRequest(f"Unrecognized request argument supplied: {location}",
                                 param=location) from None
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{location}: {message}" if location else message,
                             param=location) from None
