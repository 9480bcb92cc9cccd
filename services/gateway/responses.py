"""OpenAI's Responses API (``POST /v1/responses``) over the chat path. Pure: no I/O.

A Responses request is a chat request in another shape: its ``input`` items become chat
messages (``instructions`` the system message first, ``function_call`` items an assistant
turn's tool calls, ``function_call_output`` items tool turns), its flat function tools the
chat tools ``tool_calls.plan_tools`` checks, its ``text.format`` the ``response_format``
``structured.response_format_spec`` checks. Generation, tool-call parsing and structured
output are the chat path's; responses_output.py shapes the result, responses_schema.py
holds the bodies' schemas.

``store: true`` and ``background: true`` keep the response in the response store
(NATS JetStream: response_store.py, response_replay.py) when the gateway has one, else
they are a 400 naming the parameter; what needs stored conversations
(``previous_response_id``, ``conversation``, ``item_reference``) is always a 400.
``store`` left out means false here (OpenAI's default is true), so the SDKs' default
calls, which do not send it, work without a store. docs/openai-api.md has the table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from services.gateway.protocol import SAMPLING_EPS
from services.gateway.responses_schema import (
    LOGPROBS_INCLUDE, FunctionCallItem, FunctionCallOutputItem, ItemReference, MessageItem,
    ResponsesAllowedTools, ResponsesFunctionTool, ResponsesInputImage, ResponsesNonTextContent,
    ResponsesRefusal,
    ResponsesRequest, ResponsesToolChoiceFunction, TextFormatJsonObject, TextFormatJsonSchema,
    TextFormatText)
from services.gateway.structured import response_format_spec
from services.gateway.tool_calls import ToolPlan, plan_tools
from shared.errors import InvalidRequest
from shared.messages import (ChatMessage, FunctionCall, GenerationDefaults, SamplingParams,
                             StructuredSpec, ToolCall)
from shared.messages import ContentPart as WirePart

# without the response store (no JetStream, or --response-retention-s 0)
NO_STORE = ("{param} needs the response store (NATS JetStream and --response-retention-s > 0), "
            "which this deployment does not have")
_NEEDS_STORE = {
    "store": (lambda v: v is True, NO_STORE.format(param="store: true") +
              ". Leave store out or set it to false"),
    "background": (lambda v: v is True, NO_STORE.format(param="background: true")),
}
_REFUSED = {
    "previous_response_id": (lambda v: v is not None, "previous_response_id is not supported: "
                             "flotilla keeps no responses. Send the whole conversation in input"),
    "conversation": (lambda v: v is not None, "conversation is not supported: flotilla keeps no "
                     "conversations. Send the whole conversation in input"),
    "prompt": (lambda v: v is not None, "prompt (a stored prompt template) is not supported"),
    "max_tool_calls": (lambda v: v is not None, "max_tool_calls is not supported"),
    "context_management": (lambda v: bool(v), "context_management is not supported"),
    "truncation": (lambda v: v == "auto", "truncation 'auto' is not supported: an input too "
                   "long for the context is refused"),
}


@dataclass(frozen=True)
class ResponsesPlan:
    """What the gateway needs to run a Responses request on the chat path."""

    messages: list[ChatMessage]
    tool_plan: ToolPlan
    structured: StructuredSpec | None
    num_logprobs: int | None  # None: no logprobs asked
    image_urls: list[str] = field(default_factory=list)  # the input's images, in order


def plan_response(req: ResponsesRequest, store_available: bool = False) -> ResponsesPlan:
    """Check what the schema cannot and map the request onto the chat path
    (``store_available``: the gateway has the response store, so store and background
    are honoured)."""
    refusals = _REFUSED if store_available else {**_NEEDS_STORE, **_REFUSED}
    for param, (refused, message) in refusals.items():
        if refused(getattr(req, param)):
            raise InvalidRequest(message, param=param, code="unsupported_parameter")
    if any(tool.defer_loading for tool in req.tools or []):
        raise InvalidRequest("defer_loading (tool search) is not supported",
                             param="tools", code="unsupported_parameter")
    tools, tool_choice = _allowed(req.tools, req.tool_choice)
    tool_plan = _relabelled(lambda: plan_tools(
        [_chat_tool(tool) for tool in tools] if tools else None,
        _chat_tool_choice(tool_choice), req.parallel_tool_calls))
    format_ = req.text.format if req.text else None
    structured = tool_plan.structured or _relabelled(lambda: response_format_spec(
        _response_format(format_)))
    wants_logprobs = LOGPROBS_INCLUDE in (req.include or [])
    return ResponsesPlan(chat_messages(req), tool_plan, structured,
                         (req.top_logprobs or 0) if wants_logprobs else None,
                         _image_urls(req))


def sampling_params(req: ResponsesRequest, plan: ResponsesPlan, max_tokens: int,
                    defaults: GenerationDefaults = GenerationDefaults()) -> SamplingParams:
    """The request's temperature and top_p, else the model's (generation_config.json), else
    OpenAI's; the model's top_k, min_p and repetition_penalty, which Responses cannot set."""
    temperature = _first(req.temperature, defaults.temperature, 1.0)
    top_p = _first(req.top_p, defaults.top_p, 1.0)
    top_k = max(0, _first(defaults.top_k, 0))
    if temperature < SAMPLING_EPS:  # as on the chat path: a tiny temperature is greedy
        temperature = 0.0
    if top_p < SAMPLING_EPS:
        top_p, top_k = 1.0, 1
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
        min_p=_first(defaults.min_p, 0.0),
        repetition_penalty=_first(defaults.repetition_penalty, 1.0),
        logprobs=plan.num_logprobs, structured=plan.structured)


def _first(*values):
    return next(value for value in values if value is not None)


def chat_messages(req: ResponsesRequest) -> list[ChatMessage]:
    """The request's instructions and input items as chat messages. Function calls join
    the assistant turn before them (one turn may call several tools)."""
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions else []
    items = [MessageItem(role="user", content=req.input)] if isinstance(req.input, str) \
        else req.input
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role,
                                        content=_text(item.content, f"{where}.content"),
                                        parts=_parts(item.content)))
        elif isinstance(item, FunctionCallItem):
            call = ToolCall(id=item.call_id, function=FunctionCall(name=item.name,
                                                                   arguments=item.arguments))
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = msgspec.structs.replace(
                    last, tool_calls=[*(last.tool_calls or []), call])
            else:
                messages.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", tool_call_id=item.call_id,
                                        content=_text(item.output, f"{where}.output")))
        elif isinstance(item, ItemReference):
            raise InvalidRequest("item_reference is not supported: flotilla keeps no items. "
                                 "Send the item itself", param=where,
                                 code="unsupported_parameter")
        # ReasoningItem: nothing this model can read
    if not any(m.role != "system" for m in messages):
        raise InvalidRequest("input must hold at least one message or function call output",
                             param="input")
    return messages


def _text(content: str | list, where: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, ResponsesNonTextContent):
            raise InvalidRequest(f"{part.type} content is not supported: the model reads text "
                                 "only", param=f"{where}[{j}]", code="unsupported_parameter")
        if isinstance(part, ResponsesInputImage):
            if part.image_url is None:
                raise InvalidRequest("an input_image needs an image_url (flotilla keeps no "
                                     "files for a file_id)", param=f"{where}[{j}]",
                                     code="unsupported_parameter")
            continue
        parts.append(part.refusal if isinstance(part, ResponsesRefusal) else part.text)
    return "".join(parts)


def _parts(content: str | list) -> list[WirePart] | None:
    """A message with images: its parts in order (docs/vision.md); None without images."""
    if isinstance(content, str) or not any(isinstance(p, ResponsesInputImage) for p in content):
        return None
    return [WirePart(type="image") if isinstance(part, ResponsesInputImage) else
            WirePart(type="text", text=part.refusal if isinstance(part, ResponsesRefusal)
                     else part.text) for part in content]


def _image_urls(req: ResponsesRequest) -> list[str]:
    """The input's image URLs, in order (what _parts marks)."""
    if isinstance(req.input, str):
        return []
    return [part.image_url for item in req.input if isinstance(item, MessageItem)
            and not isinstance(item.content, str) for part in item.content
            if isinstance(part, ResponsesInputImage)]


def _chat_tool(tool: ResponsesFunctionTool) -> dict[str, Any]:
    function = {"name": tool.name, "description": tool.description,
                "parameters": tool.parameters, "strict": tool.strict}
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _allowed(tools: list[ResponsesFunctionTool] | None, choice: Any
             ) -> tuple[list[ResponsesFunctionTool] | None, Any]:
    """An allowed_tools choice keeps only the tools it names, in its mode."""
    if not isinstance(choice, ResponsesAllowedTools):
        return tools, choice
    declared = {tool.name for tool in tools or []}
    names = [allowed.name for allowed in choice.tools]
    missing = [name for name in names if name not in declared]
    if missing:
        raise InvalidRequest(f"allowed_tools names {missing[0]!r}, which is not in 'tools'",
                             param="tool_choice", code="invalid_value")
    return [tool for tool in tools if tool.name in names], choice.mode


def _chat_tool_choice(choice: str | ResponsesToolChoiceFunction | None) -> str | dict | None:
    if isinstance(choice, ResponsesToolChoiceFunction):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def _response_format(format_: TextFormatText | TextFormatJsonObject | TextFormatJsonSchema | None
                     ) -> dict | None:
    if not isinstance(format_, TextFormatJsonSchema):
        return None if format_ is None else {"type": format_.type}
    body = {"name": format_.name, "schema": format_.json_schema,
            "description": format_.description, "strict": format_.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in body.items() if v is not None}}


_CHAT_NAMES = (("response_format.json_schema.schema", "text.format.schema"),
               ("response_format.json_schema", "text.format"),
               ("response_format", "text.format"), (".function.", "."), (".function", ""))


def _relabelled(check):
    """Run a chat-path check; its errors name the Responses parameters (flat tools,
    ``text.format``) instead of the chat ones."""
    try:
        return check()
    except InvalidRequest as exc:
        message, param = exc.message, exc.param
        for chat_name, name in _CHAT_NAMES:
            message = message.replace(chat_name, name)
            param = param.replace(chat_name, name) if param else param
        raise InvalidRequest(message, param=param, code=exc.code) from None


def echo_fields(req: ResponsesRequest, sampling: SamplingParams) -> dict[str, Any]:
    """The request's settings as a response object repeats them (temperature and top_p:
    the ones used)."""
    format_ = req.text.format if req.text and req.text.format else TextFormatText(type="text")
    tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
    return {
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p,
        "tools": [tool.model_dump(exclude_none=True) for tool in req.tools or []],
        "tool_choice": tool_choice if isinstance(tool_choice, str) else tool_choice.model_dump(),
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "text": {"format": format_.model_dump(by_alias=True, exclude_none=True),
                 "verbosity": (req.text.verbosity if req.text else None) or "medium"},
        "top_logprobs": req.top_logprobs or 0, "truncation": "disabled",
        "reasoning": {"effort": None, "summary": None}, "store": req.store is True,
        "background": req.background is True,
        "previous_response_id": None, "metadata": req.metadata or {}, "user": req.user,
        "safety_identifier": req.safety_identifier, "prompt_cache_key": req.prompt_cache_key,
        "service_tier": "default",
    }
