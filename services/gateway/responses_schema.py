"""OpenAI's Responses API (``POST /v1/responses``): the request and response bodies as
pydantic models (validation, and the schemas in /openapi.json).

Input items that clients echo back from earlier responses may carry fields that do not
matter here (ids, statuses, annotations); they are allowed on items, while the top level
refuses unknown parameters, as the chat endpoints do.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal, Union

import structlog
from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError

from services.gateway.openapi import json_responses
from services.gateway.protocol import INT32_LIMIT
from shared.errors import InvalidRequest

log = structlog.get_logger()

MAX_TOP_LOGPROBS = 20
LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's includable extras; all but the logprobs concern items flotilla never produces
# (hosted tools, images, reasoning), so asking for them adds nothing.
Includable = Literal[
    "message.output_text.logprobs", "reasoning.encrypted_content", "file_search_call.results",
    "web_search_call.results", "web_search_call.action.sources", "message.input_image.image_url",
    "computer_call_output.output.image_url", "code_interpreter_call.outputs"]


def _one_of(pick: Callable[[Any], str | None], **members: Any) -> Any:
    """A union whose member ``pick(value)`` names. Its tags start with "~", so that error
    locations can leave them out (parse_request)."""
    def tag(value: Any) -> str | None:
        name = pick(value)
        return None if name is None else "~" + name

    return Annotated[Union[tuple(Annotated[member, Tag("~" + name)]
                                 for name, member in members.items())],
                     Discriminator(tag, custom_error_type="invalid_union_member",
                                   custom_error_message="its type must be one of: "
                                   + ", ".join(members))]


def _by_type(default: str | None = None) -> Callable[[Any], str | None]:
    """The ``type`` of a JSON object (``default`` where it has none)."""
    return lambda value: value.get("type", default) if isinstance(value, dict) else \
        getattr(value, "type", None)


def _text_or(value: Any) -> str:
    return "text" if isinstance(value, str) else "list"


def _choice_kind(value: Any) -> str | None:
    """tool_choice: a mode, or an object by its type."""
    return "mode" if isinstance(value, str) else _by_type()(value)


def _id_or_object(value: Any) -> str:
    return "id" if isinstance(value, str) else "object"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Echoed(BaseModel):
    """An item a client may send back from an earlier response, with fields (id, status,
    annotations) that do not matter here."""

    model_config = ConfigDict(extra="allow", strict=True)


class ResponsesInputText(_Echoed):
    type: Literal["input_text"]
    text: str


class ResponsesOutputText(_Echoed):
    type: Literal["output_text"]
    text: str


class ResponsesRefusal(_Echoed):
    type: Literal["refusal"]
    refusal: str


class ResponsesInputImage(_Echoed):
    """An image by URL (a data URL, or one the gateway may fetch: docs/vision.md)."""

    type: Literal["input_image"]
    image_url: str | None = None  # (a file_id is refused: flotilla keeps no files)
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # ignored: one resolution here


class ResponsesNonTextContent(_Echoed):
    """Files and audio: named so that the 400 says what is wrong."""

    type: Literal["input_file", "input_audio"]


ContentPart = _one_of(_by_type(), input_text=ResponsesInputText, output_text=ResponsesOutputText,
                      refusal=ResponsesRefusal, input_image=ResponsesInputImage,
                      input_file=ResponsesNonTextContent, input_audio=ResponsesNonTextContent)
Content = _one_of(_text_or, text=str, list=list[ContentPart])


class MessageItem(_Echoed):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(_Echoed):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str


class FunctionCallOutputItem(_Echoed):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content


class ReasoningItem(_Echoed):
    """Another model's reasoning, echoed back: dropped (this model reads none)."""

    type: Literal["reasoning"]


class ItemReference(_Echoed):
    type: Literal["item_reference"]
    id: str


InputItem = _one_of(_by_type("message"), message=MessageItem, function_call=FunctionCallItem,
                    function_call_output=FunctionCallOutputItem, reasoning=ReasoningItem,
                    item_reference=ItemReference)


class ResponsesFunctionTool(_Strict):
    """A function tool in the Responses shape: flat, no ``function`` wrapper."""

    type: Literal["function"]
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    defer_loading: bool | None = None


class ResponsesToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: str


class ResponsesAllowedTools(_Strict):
    """Only these of the declared tools may be called, in mode auto or required."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[ResponsesToolChoiceFunction] = Field(min_length=1)


class TextFormatText(_Strict):
    type: Literal["text"]


class TextFormatJsonObject(_Strict):
    type: Literal["json_object"]


class TextFormatJsonSchema(_Strict):
    type: Literal["json_schema"]
    name: str
    json_schema: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponsesTextConfig(_Strict):
    format: _one_of(_by_type(), text=TextFormatText, json_object=TextFormatJsonObject,
                    json_schema=TextFormatJsonSchema) | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # no effect


class ResponsesReasoning(_Strict):
    """Accepted for clients that always send it; this model has no reasoning to shape."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # no effect: no obfuscation field is sent


class ResponsesRequest(_Strict):
    model: str
    input: _one_of(_text_or, text=str, list=list[InputItem])
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, lt=INT32_LIMIT)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    tools: list[ResponsesFunctionTool] | None = None
    tool_choice: _one_of(_choice_kind, mode=Literal["none", "auto", "required"],
                         function=ResponsesToolChoiceFunction,
                         allowed_tools=ResponsesAllowedTools) | None = None
    parallel_tool_calls: bool | None = None
    text: ResponsesTextConfig | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    include: list[Includable] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    truncation: Literal["auto", "disabled"] | None = None
    reasoning: ResponsesReasoning | None = None
    metadata: dict[str, str] | None = Field(default=None, max_length=16)
    # no effect on a self-hosted model
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    # store and background need the response store (a 400 without it); the rest are
    # refused unless left out (or at their no-op value): they need stored conversations
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: _one_of(_id_or_object, id=str, object=dict[str, Any]) | None = None
    background: bool | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    context_management: list[dict[str, Any]] | None = None

    # what generate() reads off any request: no stop strings, priority or cache salt
    # here, and usage is always in the response
    stop_strings = property(lambda self: [])
    priority = property(lambda self: 0)
    cache_salt = property(lambda self: None)
    include_usage = property(lambda self: False)
    continuous_usage = property(lambda self: False)
    # what keeps a conversation on one replica (--routing kv)
    session_key = property(lambda self: self.prompt_cache_key or self.user)


def parse_request(payload: dict, accept_unknown_fields: bool = False) -> ResponsesRequest:
    """Validate a request body; a problem is a 400 naming the parameter as OpenAI would
    (``input[2].call_id``), without pydantic's union tags. With ``accept_unknown_fields``
    (the gateway's flag), unknown top-level parameters are dropped and logged instead."""
    unknown = sorted(set(payload) - set(ResponsesRequest.model_fields))
    if accept_unknown_fields and unknown:
        log.info("unknown_fields_ignored", request="ResponsesRequest", fields=unknown)
        payload = {key: value for key, value in payload.items() if key not in unknown}
    try:
        return ResponsesRequest.model_validate(payload)
    except ValidationError as exc:
        error = exc.errors()[0]
    param = ""
    for part in error["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not part.startswith("~"):
            param += f".{part}" if param else str(part)
    if error["type"] == "extra_forbidden":
        raise InvalidRequest(f"Unrecognized request argument supplied: {param}", param=param)
    message = error["msg"].removeprefix("Value error, ")
    raise InvalidRequest(f"{param}: {message}" if param else message, param=param or None)


# ---------------------------------------------------------------- the response body
class OutputTextPart(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[Any]  # always empty: no citations
    logprobs: list[dict[str, Any]]  # with include: ["message.output_text.logprobs"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"]
    content: list[OutputTextPart]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: Literal["in_progress", "completed", "incomplete"]
    call_id: str
    name: str
    arguments: str  # JSON text


class ResponsesInputTokensDetails(BaseModel):
    cached_tokens: int  # served by the prefix cache
    cache_write_tokens: int  # always 0: nothing is charged for writing the cache


class ResponsesOutputTokensDetails(BaseModel):
    reasoning_tokens: int  # always 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: ResponsesInputTokensDetails
    output_tokens: int
    output_tokens_details: ResponsesOutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """``POST /v1/responses`` without ``stream``; with it, the same object travels in the
    response.created, .in_progress and .completed (or .incomplete, .failed) events."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["queued", "in_progress", "completed", "incomplete", "failed", "cancelled"]
    error: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None
    model: str
    output: list[Annotated[Union[OutputMessage, OutputFunctionCall], Field(discriminator="type")]]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    text: dict[str, Any]
    top_logprobs: int
    truncation: Literal["disabled"]
    reasoning: dict[str, Any]
    store: bool
    background: bool
    previous_response_id: None
    metadata: dict[str, str]
    user: str | None
    safety_identifier: str | None
    prompt_cache_key: str | None
    service_tier: str
    usage: ResponseUsage | None


class ResponsesStreamEvent(BaseModel):
    """One event of a streamed response: ``event: <type>`` and this as its data. Which
    other fields an event has follows its type, as in OpenAI's API (docs/openai-api.md):
    response.created / .in_progress / .completed / .incomplete / .failed carry the
    ``response`` object; output_item.added / .done an ``item``; content_part.added / .done
    a ``part``; output_text.delta a ``delta``; function_call_arguments.delta / .done the
    call's ``delta`` or ``arguments``; error a ``message`` and ``code``."""

    model_config = ConfigDict(extra="allow")
    type: str
    sequence_number: int


def openapi_responses() -> dict[int, dict[str, Any]]:
    """The route's answers for /openapi.json: the response object, its stream's events
    (no ``[DONE]`` at the end, unlike chat), and OpenAI errors."""
    answers = json_responses(ResponseObject, stream=ResponsesStreamEvent)
    answers[200]["description"] = (
        "the response; with stream: server-sent events, each 'event: <type>' and "
        "'data: <ResponsesStreamEvent>', from response.created to response.completed "
        "(or .incomplete, or error and response.failed)")
    return answers
