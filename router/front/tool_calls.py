"""OpenAI tool calling in the Hermes format (what the Qwen2 / Qwen2.5 chat templates
teach): the request's tools and tool_choice, the constraint a forced choice puts on
the output, and the output read back as tool calls, whole or streamed.

Follows vLLM's `hermes` tool parser and its tool_choice handling:
- "auto": the model writes content, then `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>` blocks. The content is the text before the first block. A block that is
  not such JSON leaves the whole output as content, with no calls; a last block cut off
  by max_tokens counts when its body parses.
- a named function: the output is held to that function's parameters schema and is
  the call's arguments.
- "required": the output is held to a JSON array of {"name", "parameters"} objects,
  one per call.
- "none" (OpenAI's default when there are no tools): no constraint, no parsing.
Streamed, content goes out as it comes, except a tail that could still open a call
(whitespace, then a prefix of `<tool_call>`); each call goes out whole when its block
closes, and whitespace between calls is dropped.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Callable, Literal

from pydantic import BaseModel, ConfigDict, Field

from pdserve.engine.errors import InvalidRequestError
from pdserve.engine.sampling_params import StructuredOutputsParams

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# vLLM's schema for a function declared without parameters.
NO_PARAMETERS = {"type": "object", "properties": {}}
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = Field(None, description="accepted; arguments are held to the "
                                "schema only when tool_choice forces a call")


class Tool(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCallIn(BaseModel):
    model_config = ConfigDict(strict=True)
    name: str
    arguments: str  # JSON text, as this API answered it


class ToolCallIn(BaseModel):
    """A call an assistant message of the history made, sent back by the client."""
    model_config = ConfigDict(strict=True)
    id: str
    type: Literal["function"]
    function: FunctionCallIn

    def template_form(self) -> dict:
        """As chat templates take it: arguments as an object when they parse (vLLM
        parses them too; Qwen's template would print a JSON string quoted)."""
        arguments = _loads(self.function.arguments, default=self.function.arguments)
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": arguments}}


def resolve_tool_choice(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """OpenAI's default: "auto" when there are tools, else "none"."""
    if tool_choice is None:
        return "auto" if tools else "none"
    return tool_choice


def check_tools(tools: list[Tool] | None, tool_choice: ToolChoice | None) -> ToolChoice:
    """Raises InvalidRequestError naming the field at fault; returns the choice resolved."""
    names = [tool.function.name for tool in tools or ()]
    duplicate = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if duplicate is not None:
        raise InvalidRequestError("tools", f"function {duplicate!r} is declared twice")
    choice = resolve_tool_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise InvalidRequestError("tool_choice", f"names function {choice.function.name!r}, "
                                  "which tools does not declare")
    if choice == "required" and not names:
        raise InvalidRequestError("tool_choice", '"required" needs tools')
    return choice


def constraint_for(tools: list[Tool] | None,
                   tool_choice: ToolChoice | None) -> StructuredOutputsParams | None:
    """The structured output a forced choice needs (tools and choice checked)."""
    choice = resolve_tool_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        function = next(t.function for t in tools if t.function.name == choice.function.name)
        return StructuredOutputsParams(json=json.dumps(_schema_of(function)))
    if choice == "required":
        return StructuredOutputsParams(json=json.dumps(_calls_schema(tools)))
    return None


def _schema_of(function: FunctionDefinition) -> dict:
    return function.parameters or NO_PARAMETERS


def _calls_schema(tools: list[Tool]) -> dict:
    """vLLM's "required" schema: one or more calls, each naming a tool and carrying
    arguments that satisfy that tool's schema."""
    def call(tool: Tool) -> dict:
        return {"type": "object",
                "properties": {"name": {"enum": [tool.function.name]},
                               "parameters": _schema_of(tool.function)},
                "required": ["name", "parameters"], "additionalProperties": False}
    return {"type": "array", "minItems": 1, "items": {"anyOf": [call(t) for t in tools]}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # JSON text of the arguments object (as the model wrote it if not JSON)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}

    def delta(self, index: int) -> dict:
        """The whole call as one streamed chunk's delta."""
        return {"tool_calls": [{"index": index, **self.to_openai()}]}


MakeId = Callable[[], str]


def parse_tool_calls(text: str, tools: list[Tool] | None, tool_choice: ToolChoice | None,
                     make_id: MakeId = new_call_id) -> tuple[str | None, list[ToolCall]]:
    """A whole output as (content, tool calls), under the request's choice."""
    choice = resolve_tool_choice(tools, tool_choice)
    if choice == "none":
        return text, []
    if choice == "auto":
        return parse_hermes(text, make_id)
    calls = calls_from_constrained(text, tools, choice, make_id)
    return (None, calls) if calls else (text, [])


def parse_hermes(text: str, make_id: MakeId = new_call_id) -> tuple[str | None, list[ToolCall]]:
    start = text.find(CALL_OPEN)
    if start < 0:
        return text, []
    calls = []
    for block in _BLOCK.finditer(text):
        closed, cut = block.group(1), block.group(2)
        call = _hermes_call(closed if closed is not None else _without_close(cut), make_id)
        if call is None:
            return text, []
        calls.append(call)
    return text[:start].strip() or None, calls


def calls_from_constrained(text: str, tools: list[Tool] | None, tool_choice: ToolChoice,
                           make_id: MakeId = new_call_id) -> list[ToolCall]:
    """The calls a named or "required" choice's output holds; [] when a "required"
    output is not the array (cut off by max_tokens)."""
    choice = resolve_tool_choice(tools, tool_choice)
    if isinstance(choice, NamedToolChoice):
        arguments = _loads(text, default=None)
        return [ToolCall(make_id(), choice.function.name,
                         text if arguments is None else _dumps(arguments))]
    if choice != "required":
        raise ValueError(f"tool_choice {choice!r} forces no call")
    items = _loads(text, default=None)
    if not (isinstance(items, list) and all(
            isinstance(i, dict) and isinstance(i.get("name"), str) and "parameters" in i
            for i in items)):
        return []
    return [ToolCall(make_id(), i["name"], _dumps(i["parameters"])) for i in items]


def _hermes_call(body: str, make_id: MakeId) -> ToolCall | None:
    call = _loads(body, default=None)
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments"), (dict, str))):
        return None
    arguments = call["arguments"]
    return ToolCall(make_id(), call["name"],
                    arguments if isinstance(arguments, str) else _dumps(arguments))


def _loads(text: str, default):
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return default


def _dumps(value) -> str:
    return json.dumps(value, ensure_ascii=False)  # as vLLM: non-ASCII kept as written


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (short of all of it)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1)
                 if text.endswith(tag[:n])), 0)


def _without_close(body: str) -> str:
    """A cut-off block's body, less a closing tag cut off mid-way."""
    return body[:len(body) - _partial_tag(body, CALL_CLOSE)]


def _content(text: str) -> list[dict]:
    return [{"content": text}] if text else []


class HermesStreamParser:
    """Reads "auto" output as it streams; feed() and finish() return the chat deltas
    to send, each {"content": ...} or {"tool_calls": [one whole call]}."""

    def __init__(self, make_id: MakeId = new_call_id):
        self._make_id = make_id
        self._pending = ""  # not sent yet: a tail that may open a call, or an open call's body
        self._in_call = False
        self._num_calls = 0

    @property
    def has_calls(self) -> bool:
        return self._num_calls > 0

    @property
    def _awaited(self) -> str:
        return CALL_CLOSE if self._in_call else CALL_OPEN

    def feed(self, delta_text: str) -> list[dict]:
        self._pending += delta_text
        deltas = []
        while (at := self._pending.find(self._awaited)) >= 0:
            head, self._pending = self._pending[:at], self._pending[at + len(self._awaited):]
            # Whitespace before a call is dropped; a malformed block is sent as content.
            deltas += (self._call(head) or _content(CALL_OPEN + head + CALL_CLOSE)
                       if self._in_call else _content(head.rstrip()))
            self._in_call = not self._in_call
        if not self._in_call:
            held = len(self._pending) - _partial_tag(self._pending, CALL_OPEN)
            sendable = len(self._pending[:held].rstrip())
            deltas += _content(self._pending[:sendable])
            self._pending = self._pending[sendable:]
        return deltas

    def finish(self) -> list[dict]:
        rest, self._pending = self._pending, ""
        if self._in_call:
            self._in_call = False
            return self._call(_without_close(rest)) or _content(CALL_OPEN + rest)
        return _content("" if self.has_calls and not rest.strip() else rest)

    def _call(self, body: str) -> list[dict]:
        call = _hermes_call(body, self._make_id)
        if call is None:
            return []
        self._num_calls += 1
        return [call.delta(self._num_calls - 1)]


class ConstrainedStreamParser:
    """Reads a forced choice's output as it streams. Named: a first delta names the
    call, then the output streams as its arguments. "required": the array is read
    whole at finish() (a call's name is known only once its object is)."""

    def __init__(self, tools: list[Tool] | None, tool_choice: ToolChoice,
                 make_id: MakeId = new_call_id):
        choice = resolve_tool_choice(tools, tool_choice)
        if not (isinstance(choice, NamedToolChoice) or choice == "required"):
            raise ValueError(f"tool_choice {choice!r} forces no call")
        self._tools, self._choice, self._make_id = tools, choice, make_id
        self._text = ""  # "required" only: the output so far
        self._named_started = False
        self._required_calls = 0

    @property
    def has_calls(self) -> bool:
        return self._named_started or self._required_calls > 0

    def feed(self, delta_text: str) -> list[dict]:
        if self._choice == "required":
            self._text += delta_text
            return []
        deltas = []
        if not self._named_started:
            self._named_started = True
            deltas.append(ToolCall(self._make_id(), self._choice.function.name, "").delta(0))
        if delta_text:
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": delta_text}}]})
        return deltas

    def finish(self) -> list[dict]:
        if self._choice != "required":
            return [] if self._named_started else self.feed("")
        calls = calls_from_constrained(self._text, self._tools, "required", self._make_id)
        self._required_calls = len(calls)
        return [call.delta(i) for i, call in enumerate(calls)] or _content(self._text)


def stream_parser(tools: list[Tool] | None, tool_choice: ToolChoice | None,
                  make_id: MakeId = new_call_id
                  ) -> HermesStreamParser | ConstrainedStreamParser | None:
    """The parser a streamed request needs; None when tool calls are off ("none")."""
    choice = resolve_tool_choice(tools, tool_choice)
    if choice == "none":
        return None
    if choice == "auto":
        return HermesStreamParser(make_id)
    return ConstrainedStreamParser(tools, choice, make_id)
