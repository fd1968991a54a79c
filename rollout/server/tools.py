"""Forced tool calls: OpenAI `tools` + `tool_choice` turned into a JSON schema the output must follow, and the
generated text turned back into the message's `tool_calls`.

`tool_choice` "none", "auto" or absent constrains nothing: the chat template renders the tools and the model answers
as it likes (its text comes back as `content`; this server parses no free-form tool calls). A named function
(`{"type": "function", "function": {"name": ...}}`) forces its arguments: the output is a JSON object valid under
the function's `parameters`. "required" forces one call of any of the tools: the output is
`{"name": ..., "arguments": {...}}` with arguments valid for the tool it names (one call per choice: parallel calls
are not forced). A forced call comes back as `tool_calls` with finish_reason "tool_calls"; one cut short by
max_tokens comes back as plain content with finish_reason "length".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from rollout.server.errors import OpenAIError
from rollout.server.protocol import ChatMessage, ToolCall, ToolCallFunction

ANY_OBJECT: dict[str, Any] = {"type": "object"}  # a function without `parameters` takes any JSON object


@dataclass(frozen=True)
class ToolCallText:
    """A forced call decoded from the output: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ForcedToolCall:
    """What the output must be: the named function's arguments (`name` set), or a call of any tool (`name` None)."""

    name: str | None
    schema: dict[str, Any]

    def parse(self, text: str) -> ToolCallText | None:
        """The call the output spells, or None if it is not a complete call (it was cut short)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.name is not None:
            return ToolCallText(self.name, text) if isinstance(value, dict) else None
        if not (isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value):
            return None
        return ToolCallText(value["name"], json.dumps(value["arguments"], ensure_ascii=False))


    def message(self, text: str, finish_reason: str | None) -> tuple[ChatMessage, str | None]:
        """The assistant message and finish_reason of a choice: the call as `tool_calls` when the output is one,
        else the text as content (an output cut short by max_tokens)."""
        call = self.parse(text) if finish_reason == "stop" else None
        if call is None:
            return ChatMessage(content=text), finish_reason
        function = ToolCallFunction(name=call.name, arguments=call.arguments)
        return ChatMessage(content=None, tool_calls=[ToolCall(id=new_call_id(), function=function)]), "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def forced_tool_call(tools: list[dict[str, Any]] | None, tool_choice: Any) -> ForcedToolCall | None:
    """The call `tool_choice` forces among `tools`, or None; OpenAIError (400) naming the field at fault."""
    if tool_choice is None or tool_choice in ("none", "auto"):
        return None
    functions = _functions(tools)
    if not functions:
        raise OpenAIError("'tool_choice' forces a tool call but 'tools' lists none; pass the tools, or drop "
                          "tool_choice.", param="tool_choice")
    if tool_choice == "required":
        cases = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                  "required": ["name", "arguments"]} for name, params in functions.items()]
        return ForcedToolCall(None, cases[0] if len(cases) == 1 else {"anyOf": cases})
    name = _named_function(tool_choice)
    if name not in functions:
        raise OpenAIError(f"'tool_choice' names function {name!r}, which is not in 'tools' (it has "
                          f"{sorted(functions)}).", param="tool_choice")
    return ForcedToolCall(name, functions[name])


def _named_function(tool_choice: Any) -> str:
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(name, str):
        raise OpenAIError("'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}.", param="tool_choice")
    return name


def _functions(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """name -> parameters schema of each function tool, checked for shape."""
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools or []):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise OpenAIError("Each tool must be {\"type\": \"function\", \"function\": {\"name\": ..., "
                              "\"parameters\": {...}}}.", param=f"tools[{i}]")
        params = function.get("parameters") or ANY_OBJECT
        if not isinstance(params, dict):
            raise OpenAIError("A function's 'parameters' must be a JSON schema object.",
                              param=f"tools[{i}].function.parameters")
        functions[name] = params
    return functions
