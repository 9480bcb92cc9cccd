"""OpenAI tool calling: check a request's tools, plan the prompt and the output constraint,
and parse tool calls back out of the generated text, delta by delta. Pure: no I/O.

Modes (docs/tool-calling.md):
- ``none``: the prompt shows no tools; the output is plain content.
- ``auto``: the prompt lists the tools; the model may write Hermes-style
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks among its text.
- ``required``: the output is constrained to a JSON array of ``{"name", "arguments"}`` calls.
- ``named``: the output is constrained to the named tool's arguments object.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.json_scanner import JsonScanner
from shared.grammar import grammar_for
from shared.errors import InvalidRequest
from shared.messages import StructuredSpec

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}
_CHOICES = ("none", "auto", "required")


def empty_parameters() -> dict[str, Any]:
    """The schema of a function declared without ``parameters``: an object, no properties."""
    return {"type": "object", "properties": {}}


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with tools.

    ``tools_for_prompt`` goes to ``EncodeRequest.tools``; ``structured`` (required and
    named modes) to ``SamplingParams.structured``; ``parameters`` maps every declared
    tool's name to its parameters schema; ``named`` is the forced tool's name.
    """

    mode: str  # "none" | "auto" | "required" | "named"
    tools_for_prompt: list[dict[str, Any]] | None = None
    structured: StructuredSpec | None = None
    parameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    named: str | None = None
    parallel_tool_calls: bool = True


def plan_tools(tools: list[dict] | None, tool_choice: str | dict | None,
               parallel_tool_calls: bool | None) -> ToolPlan:
    """Check the OpenAI ``tools``/``tool_choice``/``parallel_tool_calls`` and plan the
    request; raises InvalidRequest naming the parameter at fault."""
    parameters = _check_tools(tools)
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("'parallel_tool_calls' must be a boolean",
                             param="parallel_tool_calls")
    parallel = parallel_tool_calls is not False
    mode, named = _check_choice(tool_choice, parameters)
    if mode == "none":
        return ToolPlan("none", parameters=parameters, parallel_tool_calls=parallel)
    if mode == "auto":
        return ToolPlan("auto", tools_for_prompt=list(tools), parameters=parameters,
                        parallel_tool_calls=parallel)
    if mode == "required":
        schema = _calls_schema(parameters, parallel)
        prompt_tools = list(tools)
    else:
        schema = parameters[named]
        prompt_tools = [t for t in tools if t["function"]["name"] == named]
    _check_enforceable(tools, {t["function"]["name"] for t in prompt_tools})
    spec = StructuredSpec(kind="json_schema", json_schema=json.dumps(schema, ensure_ascii=False))
    return ToolPlan(mode, tools_for_prompt=prompt_tools, structured=spec, parameters=parameters,
                    named=named, parallel_tool_calls=parallel)


def _check_tools(tools: Any) -> dict[str, dict[str, Any]]:
    if tools is None:
        return {}
    if not isinstance(tools, list) or not tools:
        raise InvalidRequest("'tools' must be a non-empty list of tool objects", param="tools")
    parameters: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or set(tool) - _TOOL_KEYS:
            raise InvalidRequest(f"'{where}' must be an object with only 'type' and 'function'",
                                 param=where)
        if tool.get("type") != "function":
            raise InvalidRequest(f"'{where}.type' must be 'function'", param=f"{where}.type")
        function = tool.get("function")
        if not isinstance(function, dict) or set(function) - _FUNCTION_KEYS:
            raise InvalidRequest(f"'{where}.function' must be an object with 'name' and optional "
                                 "'description', 'parameters', 'strict'", param=f"{where}.function")
        name = function.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequest(f"'{where}.function.name' must be 1 to 64 letters, digits, "
                                 "underscores or dashes", param=f"{where}.function.name")
        if name in parameters:
            raise InvalidRequest(f"the tool name '{name}' is declared twice",
                                 param=f"{where}.function.name")
        if not isinstance(function.get("description", ""), str):
            raise InvalidRequest(f"'{where}.function.description' must be a string",
                                 param=f"{where}.function.description")
        schema = function.get("parameters", empty_parameters())
        if not isinstance(schema, dict) or schema.get("type", "object") != "object":
            raise InvalidRequest(f"'{where}.function.parameters' must be a JSON schema of "
                                 "type 'object'", param=f"{where}.function.parameters")
        if not isinstance(function.get("strict", False), bool):
            raise InvalidRequest(f"'{where}.function.strict' must be a boolean",
                                 param=f"{where}.function.strict")
        parameters[name] = schema
    return parameters


def _check_enforceable(tools: list[dict], names: set[str]) -> None:
    """The parameters schemas the output will be constrained to must compile to a grammar."""
    for i, tool in enumerate(tools):
        function = tool["function"]
        if function["name"] not in names:
            continue
        schema = json.dumps(function.get("parameters", empty_parameters()))
        try:
            grammar_for(StructuredSpec(kind="json_schema", json_schema=schema))
        except ValueError as exc:
            raise InvalidRequest(f"'tools[{i}].function.parameters' cannot constrain the "
                                 f"output: {exc}", param=f"tools[{i}].function.parameters") from None


def _check_choice(tool_choice: Any, parameters: dict[str, Any]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if parameters else "none"), None
    if isinstance(tool_choice, str) and tool_choice in _CHOICES:
        if tool_choice == "required" and not parameters:
            raise InvalidRequest("tool_choice 'required' needs 'tools'", param="tool_choice")
        if tool_choice == "auto" and not parameters:
            return "none", None  # nothing to call
        return tool_choice, None
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not (isinstance(tool_choice, dict) and set(tool_choice) == _TOOL_KEYS
            and tool_choice["type"] == "function" and isinstance(function, dict)
            and set(function) == {"name"} and isinstance(function["name"], str)):
        raise InvalidRequest("'tool_choice' must be 'none', 'auto', 'required' or "
                             '{"type": "function", "function": {"name": ...}}',
                             param="tool_choice")
    if not parameters:
        raise InvalidRequest("a named tool_choice needs 'tools'", param="tool_choice")
    if function["name"] not in parameters:
        raise InvalidRequest(f"tool_choice names the function '{function['name']}', which is "
                             "not in 'tools'", param="tool_choice")
    return "named", function["name"]


def _calls_schema(parameters: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """A non-empty JSON array of calls, each ``{"name": <a tool>, "arguments": <its schema>}``."""
    calls = [{"type": "object",
              "properties": {"name": {"const": name}, "arguments": schema},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, schema in parameters.items()]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ToolCallParser:
    """Tool calls out of one choice's text, fed delta by delta.

    ``feed`` and ``finish`` return OpenAI chat-completion delta fragments (``{"content"}``
    or ``{"tool_calls": [...]}``); nothing the model wrote is lost: text that is not a
    valid call comes back as content.
    """

    def __init__(self, plan: ToolPlan, make_call_id: Callable[[], str] = new_call_id) -> None:
        self.plan = plan
        self.make_call_id = make_call_id
        self._text = ""  # auto: text not yet emitted; required/named: all text
        self._inside = False  # auto: within a <tool_call> block
        self._held_space = ""  # auto: trailing whitespace, dropped next to a call
        self._content_parts: list[str] = []
        self._calls: list[dict[str, Any]] = []
        self._scan = JsonScanner(level=1 if plan.mode == "required" else 0)
        self._consumed = 0  # required/named: end of the last call's JSON

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        return [{**call, "function": dict(call["function"])} for call in self._calls]

    @property
    def has_tool_calls(self) -> bool:
        return bool(self._calls)

    @property
    def content(self) -> str | None:
        text = "".join(self._content_parts)
        return None if self._calls and not text else text

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._text += text
        if self.plan.mode in ("required", "named"):
            self._feed_json(out)
        elif self.plan.mode == "auto":
            self._feed_auto(out)
        else:
            self._add_content(out, self._text)
            self._text = ""
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The rest, at the end of the output. Call it once; feed nothing after it."""
        out: list[dict[str, Any]] = []
        if self.plan.mode in ("required", "named"):
            if not self._calls:
                self._add_content(out, self._text)
            else:  # what follows the last call: a truncated or invalid one, say
                rest = self._text[self._consumed:].strip().lstrip(",").strip()
                self._add_content(out, "" if rest == "]" else rest)
        else:
            self._emit_text(out, self._text)  # held-back tag start or unterminated block
            if not self._calls:
                self._add_content(out, self._held_space)
        self._text, self._inside, self._held_space, self._consumed = "", False, "", 0
        self._scan = JsonScanner(self._scan.level)
        return out

    # ------------------------------------------------------------- auto mode
    def _feed_auto(self, out: list[dict[str, Any]]) -> None:
        while True:
            if not self._inside:
                start = self._text.find(TOOL_CALL_START)
                if start < 0:
                    cut = len(self._text) - _partial_tag(self._text, TOOL_CALL_START)
                    self._emit_text(out, self._text[:cut])
                    self._text = self._text[cut:]
                    return
                self._emit_text(out, self._text[:start])
                self._text, self._inside = self._text[start:], True
            end = self._text.find(TOOL_CALL_END)
            if end < 0:
                return
            end += len(TOOL_CALL_END)
            block, self._text, self._inside = self._text[:end], self._text[end:], False
            call = None
            if self.plan.parallel_tool_calls or not self._calls:
                call = self._parse_call(block[len(TOOL_CALL_START):-len(TOOL_CALL_END)])
            if call is None:
                self._emit_text(out, block)
            else:
                self._held_space = ""
                out.extend(self._add_call(*call))

    def _emit_text(self, out: list[dict[str, Any]], text: str) -> None:
        """Content, holding back trailing whitespace (dropped if a call follows)."""
        text = self._held_space + text
        body = text.rstrip()
        self._held_space = text[len(body):]
        self._add_content(out, body)

    # ------------------------------------------------------------- required / named
    def _feed_json(self, out: list[dict[str, Any]]) -> None:
        opener = "[" if self.plan.mode == "required" else "{"
        for start, end in self._scan.feed(self._text, opener):
            element = self._text[start:end]
            call = self._parse_call(element) if self.plan.mode == "required" else \
                self._named_call(element)
            if call is None:  # not a call after all: it and what follows are content
                self._scan.dead = True
                return
            self._consumed = end
            out.extend(self._add_call(*call))

    def _named_call(self, text: str) -> tuple[str, str] | None:
        arguments = _loads(text)
        return None if not isinstance(arguments, dict) else (self.plan.named, _dumps(arguments))

    # ------------------------------------------------------------- shared
    def _parse_call(self, text: str) -> tuple[str, str] | None:
        """``(name, arguments JSON)`` for ``{"name": <a declared tool>, "arguments": {...}}``."""
        call = _loads(text.strip())
        if not isinstance(call, dict) or call.get("name") not in self.plan.parameters:
            return None
        arguments = call.get("arguments", call.get("parameters", {}))
        if isinstance(arguments, str):
            arguments = _loads(arguments)
        return (call["name"], _dumps(arguments)) if isinstance(arguments, dict) else None

    def _add_content(self, out: list[dict[str, Any]], text: str) -> None:
        if text:
            self._content_parts.append(text)
            out.append({"content": text})

    def _add_call(self, name: str, arguments: str) -> list[dict[str, Any]]:
        index, call_id = len(self._calls), self.make_call_id()
        self._calls.append({"id": call_id, "type": "function",
                            "function": {"name": name, "arguments": arguments}})
        return [{"tool_calls": [{"index": index, "id": call_id, "type": "function",
                                 "function": {"name": name, "arguments": ""}}]},
                {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}]


def finish_reason(plan: ToolPlan | None, parser: ToolCallParser | None,
                  engine_finish_reason: str | None) -> str | None:
    """OpenAI's finish reason: "tool_calls" when an auto or required answer called tools
    and ended on its own; a named tool_choice answers "stop"; "length" stays."""
    if engine_finish_reason != "stop" or plan is None or parser is None:
        return engine_finish_reason
    if plan.mode in ("auto", "required") and parser.has_tool_calls:
        return "tool_calls"
    return "stop"


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could begin ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
