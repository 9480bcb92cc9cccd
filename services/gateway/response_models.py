"""The response bodies of the API in OpenAI's shapes, for /openapi.json.

The gateway builds its responses as plain dicts (``choices.py``, ``generation.py``: no
model on the hot path); these models describe them, and the schemathesis test
(tests/integration/test_schemathesis.py) checks every response it gets against them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

ChatFinishReason = Literal["stop", "length", "tool_calls"]


class PromptTokensDetails(BaseModel):
    cached_tokens: int = Field(description="prompt tokens served by the prefix cache")


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int = Field(description="generated tokens over every choice")
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = Field(description="the token's exact bytes")


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None
    refusal: list[TokenLogprob] | None


class FunctionCallBody(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as a JSON text")


class ToolCallBody(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCallBody


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCallBody] | None = Field(
        default=None, description="present when the model called tools")


class ChatChoiceBody(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoiceBody]
    usage: Usage


class FunctionCallDelta(BaseModel):
    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta | None = None


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: ChatFinishReason | None


class ChatCompletionChunk(BaseModel):
    """One ``data:`` event of a streamed chat completion (then ``data: [DONE]``)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = Field(default=None, description="with stream_options.include_usage: "
                                "null, then in the last chunk (no choices) the usage")


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None] = Field(description="null for the prompt's first token")
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoiceBody(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """A completion; streamed, each ``data:`` event is one of these with ``usage`` null or
    absent (then ``data: [DONE]``)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoiceBody]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int = Field(description="the context length, in tokens")
    input_modalities: list[str] = Field(default=["text"], description=(
        "what a prompt may hold: text, and image for a vision-language model"))
    root: str | None = Field(default=None, description="a LoRA adapter's directory")
    parent: str | None = Field(default=None, description="a LoRA adapter's base model")


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, and the event that ends a failed stream."""

    error: ErrorBody


class Liveness(BaseModel):
    live: bool


class Readiness(BaseModel):
    ready: bool
    status: Literal["ok", "unavailable"]


class HealthReport(Readiness):
    live: bool
    services: dict[str, dict[str, Any]] = Field(description="each service's answer")
    replicas: dict[str, dict[str, Any]] = Field(description="each replica's readiness")
