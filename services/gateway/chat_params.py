"""The parts of a chat-completions request: messages and their content parts, tools and
tool_choice, response_format and prediction, in OpenAI's shapes.

Image parts (``image_url``) are taken for a vision-language model (docs/vision.md; the
route refuses them for a text-only one); audio and file parts are a 400 naming them. Tools are checked and planned by ``tool_calls.plan_tools``, which
takes the plain dicts these models hand on.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from services.gateway.request_base import OpenAIModel, ParameterError, refused_model
from shared.errors import InvalidRequest
from shared.messages import ChatMessage, FunctionCall, ToolCall
from shared.messages import ContentPart as WirePart


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class RefusalPart(OpenAIModel):
    """An assistant's earlier refusal, shown to the model as its text."""

    type: Literal["refusal"]
    refusal: str


class _NonTextPart(BaseModel):
    """Image, audio and file parts: known, refused (the model reads text only)."""

    model_config = ConfigDict(extra="allow", strict=True,
                              json_schema_extra=refused_model("this model reads text only"))

    @model_validator(mode="after")
    def _refuse(self):
        raise ParameterError("messages", f"content parts of type '{self.type}' are not "
                             "supported: this model reads text only")


class ImageUrl(OpenAIModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # ignored: one resolution here


class ImagePart(OpenAIModel):
    type: Literal["image_url"]
    image_url: ImageUrl


class AudioPart(_NonTextPart):
    type: Literal["input_audio"]
    input_audio: dict[str, Any]


class FilePart(_NonTextPart):
    type: Literal["file"]
    file: dict[str, Any]


ContentPart = Annotated[TextPart | RefusalPart | ImagePart | AudioPart | FilePart,
                       Field(discriminator="type")]


class FunctionCallParam(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    name: str
    arguments: str


class ToolCallParam(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam


class _MessageParam(OpenAIModel):
    # clients echo back fields of earlier responses that we do not use (audio, ...)
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _tool_calls_only_from_the_assistant(self):
        if self.role != "assistant" and (self.model_extra or {}).get("tool_calls"):
            raise ValueError("only assistant messages carry tool_calls")
        return self

    @property
    def image_urls(self) -> list[str]:
        """The URLs of the message's image parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [part.image_url.url for part in self.content if isinstance(part, ImagePart)]

    def to_message(self) -> ChatMessage:
        content, parts = self.content, None
        if isinstance(content, list):
            if any(isinstance(part, ImagePart) for part in content):
                parts = [WirePart(type="image") if isinstance(part, ImagePart) else
                         WirePart(type="text", text=_part_text(part)) for part in content]
            content = "".join(_part_text(part) for part in content)
        calls = getattr(self, "tool_calls", None)
        if content is None and not calls:  # an assistant turn that said nothing
            content = ""
        tool_calls = [ToolCall(id=call.id, function=FunctionCall(
            name=call.function.name, arguments=call.function.arguments))
            for call in calls] if calls else None
        return ChatMessage(role=self.role, content=content, name=self.name,
                           tool_calls=tool_calls, tool_call_id=getattr(self, "tool_call_id", None),
                           parts=parts)


def _part_text(part) -> str:
    """A part's text (an image part has none)."""
    if isinstance(part, TextPart):
        return part.text
    return part.refusal if isinstance(part, RefusalPart) else ""


class SystemMessageParam(_MessageParam):
    role: Literal["system"]
    content: str | list[ContentPart]


class DeveloperMessageParam(_MessageParam):
    role: Literal["developer"]
    content: str | list[ContentPart]


class UserMessageParam(_MessageParam):
    role: Literal["user"]
    content: str | list[ContentPart]


class AssistantMessageParam(_MessageParam):
    role: Literal["assistant"]
    tool_calls: list[ToolCallParam] | None = None
    refusal: str | None = None  # an earlier refusal; its text is in content if shown at all


class ToolMessageParam(_MessageParam):
    role: Literal["tool"]
    content: str | list[ContentPart]
    tool_call_id: str  # the call this message answers


# One message of a conversation, by role (as OpenAI's schema has them).
ChatMessageParam = Annotated[SystemMessageParam | DeveloperMessageParam | UserMessageParam |
                             AssistantMessageParam | ToolMessageParam,
                             Field(discriminator="role")]


class FunctionDefinition(OpenAIModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None


class FunctionTool(OpenAIModel):
    type: Literal["function"]
    function: FunctionDefinition


class CustomTool(OpenAIModel):
    """A free-form or grammar-constrained custom tool: refused (function tools only)."""

    model_config = ConfigDict(extra="allow", json_schema_extra=refused_model("function tools only"))
    type: Literal["custom"]
    custom: dict[str, Any]

    @model_validator(mode="after")
    def _refuse(self):
        raise ParameterError("tools", "custom tools are not supported: declare function tools")


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"]
    function: NamedFunction


class AllowedTools(OpenAIModel):
    mode: Literal["auto", "required"]
    tools: list[NamedToolChoice] = Field(min_length=1)


class AllowedToolsChoice(OpenAIModel):
    """Only these of the declared tools may be called, in mode auto or required."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools

    def names(self) -> list[str]:
        return [tool.function.name for tool in self.allowed_tools.tools]


class NamedCustomToolChoice(OpenAIModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=refused_model("function tools only"))
    type: Literal["custom"]
    custom: dict[str, Any]

    @model_validator(mode="after")
    def _refuse(self):
        raise ParameterError("tool_choice", "custom tools are not supported")


Tool = Annotated[FunctionTool | CustomTool, Field(discriminator="type")]
ToolChoice = Literal["none", "auto", "required"] | Annotated[
    NamedToolChoice | AllowedToolsChoice | NamedCustomToolChoice, Field(discriminator="type")]


def tools_and_choice(tools: list[FunctionTool] | None,
                     tool_choice: ToolChoice | None) -> tuple[list[dict] | None, str | dict | None]:
    """The tools and tool_choice as plan_tools takes them (plain dicts); an allowed_tools
    choice keeps only the tools it names, in its mode."""
    tool_dicts = [tool.model_dump(exclude_unset=True) for tool in tools] \
        if tools is not None else None
    if isinstance(tool_choice, AllowedToolsChoice):
        names = tool_choice.names()
        declared = {tool["function"]["name"] for tool in tool_dicts or []}
        missing = [name for name in names if name not in declared]
        if missing:
            raise InvalidRequest(f"allowed_tools names {missing[0]!r}, which is not in 'tools'",
                                 param="tool_choice", code="invalid_value")
        return [t for t in tool_dicts if t["function"]["name"] in names], \
            tool_choice.allowed_tools.mode
    if isinstance(tool_choice, BaseModel):
        return tool_dicts, tool_choice.model_dump(exclude_unset=True)
    return tool_dicts, tool_choice


class JsonSchemaFormat(OpenAIModel):
    model_config = ConfigDict(extra="allow")
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    """text, json_object or json_schema; structured.response_format_spec checks it."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def as_dict(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True, by_alias=True)


class PredictionContent(OpenAIModel):
    """Predicted output: a speed-up hint elsewhere, ignored here (the output is the same)."""

    type: Literal["content"]
    content: str | list[TextPart]
