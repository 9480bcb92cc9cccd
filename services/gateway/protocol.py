"""OpenAI request schemas (validation) and response shapes.

Parameters OpenAI defines that flotilla does not implement yet are accepted only at
their no-op values; anything else is a 400 that names the parameter, never silently
ignored. Unknown parameters are a 400 too, as with OpenAI.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from shared.errors import InvalidRequest
from shared.messages import ChatMessage, SamplingParams


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
    top_k: int | None = Field(default=None, ge=-1)  # vLLM extension; -1 or 0: off
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False  # extension
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    priority: int = 0  # extension: lower runs first under --scheduling-policy priority
    cache_salt: str | None = Field(default=None, min_length=1)  # extension: prefix-cache isolation

    @model_validator(mode="after")
    def _check_common(self):
        _unsupported(self.n != 1, "n", "n > 1 is not supported yet")
        _unsupported(bool(self.presence_penalty), "presence_penalty", "presence_penalty is not supported yet")
        _unsupported(bool(self.frequency_penalty), "frequency_penalty", "frequency_penalty is not supported yet")
        _unsupported(bool(self.logit_bias), "logit_bias", "logit_bias is not supported yet")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        if isinstance(self.stop, list) and any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        return self

    @property
    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        temperature = 1.0 if self.temperature is None else self.temperature
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=max(0, self.top_k or 0), seed=self.seed,
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        _unsupported(self.echo, "echo", "echo is not supported yet")
        _unsupported(self.logprobs is not None, "logprobs", "logprobs is not supported yet")
        _unsupported(self.best_of not in (None, 1), "best_of", "best_of is not supported yet")
        _unsupported(bool(self.suffix), "suffix", "suffix is not supported")
        return self

    @property
    def single_prompt(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise InvalidRequest("send one prompt per request (batched prompts are not "
                                     "supported yet)", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        return prompt


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessageParam(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # clients echo back fields we do not use
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def to_message(self) -> ChatMessage:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return ChatMessage(role=self.role, content=content, name=self.name)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        _unsupported(bool(self.logprobs) or self.top_logprobs is not None, "logprobs",
                     "logprobs are not supported yet")
        _unsupported(self.response_format is not None and self.response_format.type != "text",
                     "response_format", "structured outputs are not supported yet")
        _unsupported(bool(self.tools), "tools", "tool calling is not supported yet")
        _unsupported(self.tool_choice not in (None, "none"), "tool_choice",
                     "tool calling is not supported yet")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeHTTPRequest(_Strict):
    model: str | None = None
    tokens: list[int]


class _UnsupportedParameter(ValueError):
    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _unsupported(condition: bool, param: str, message: str) -> None:
    if condition:
        raise _UnsupportedParameter(param, message)


def parse_request(model_cls: type[_Strict], payload: Any):
    """Validate ``payload``; any problem becomes an InvalidRequest naming the parameter."""
    try:
        return model_cls.model_validate(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
        ctx_error = (error.get("ctx") or {}).get("error")
        if isinstance(ctx_error, _UnsupportedParameter):
            raise InvalidRequest(str(ctx_error), param=ctx_error.param,
                                 code="unsupported_parameter") from None
        location = ".".join(str(part) for part in error["loc"]) or None
        if error["type"] == "extra_forbidden":
            raise InvalidRequest(f"Unrecognized request argument supplied: {location}",
                                 param=location) from None
        message = error["msg"].removeprefix("Value error, ")
        raise InvalidRequest(f"{location}: {message}" if location else message,
                             param=location) from None


# ---------------------------------------------------------------- responses
def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int = 0) -> dict:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens,
            "prompt_tokens_details": {"cached_tokens": num_cached_tokens}}


def completion_response(request_id: str, model: str, text: str, finish_reason: str | None,
                        token_usage: dict) -> dict:
    return {"id": request_id, "object": "text_completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": token_usage}


def completion_chunk(request_id: str, model: str, created: int, text: str,
                     finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_response(request_id: str, model: str, text: str, finish_reason: str | None,
                  token_usage: dict) -> dict:
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": None, "finish_reason": finish_reason}],
            "usage": token_usage}


def chat_chunk(request_id: str, model: str, created: int, delta: dict,
               finish_reason: str | None) -> dict:
    return {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None,
                         "finish_reason": finish_reason}]}


def usage_chunk(request_id: str, model: str, created: int, obj: str, token_usage: dict) -> dict:
    return {"id": request_id, "object": obj, "created": created, "model": model, "choices": [],
            "usage": token_usage}
