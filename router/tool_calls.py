"""Tool calling: the grammar that forces a call (`tool_choice` "required" or a named function) and the parsers
that find calls in generated text: NemotronH's `<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>`, and
a generic JSON one (the whole output is a call object, or a list of them, as the forcing grammar produces).
Parsing is lenient about raw control characters in strings (the grammar engine lets a model emit them)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

_NEMOTRON = ("<TOOLCALL>", "</TOOLCALL>")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def body(self) -> dict[str, Any]:
        """The call as a non-streaming message's `tool_calls[]` entry (no `index`: that field belongs to
        streamed deltas only, as in the OpenAI API)."""
        return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def forced_call_schema(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    """JSON schema of one call object {"name", "arguments"}: to `name`, or to any of `tools`."""
    def one(tool: dict[str, Any]) -> dict[str, Any]:
        fn = tool["function"]
        params = fn.get("parameters") or {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}

    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    return one(chosen[0]) if len(chosen) == 1 else {"anyOf": [one(t) for t in chosen]}


def _calls(value: Any, names: set[str]) -> list[ToolCall] | None:
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or item.get("name") not in names:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        calls.append(ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    return calls or None


def parse_tool_calls(text: str, names: set[str]) -> tuple[str | None, list[ToolCall]]:
    """(content before the calls or None, calls) from generated text; no calls: (text, [])."""
    start = text.find(_NEMOTRON[0])
    if start >= 0:
        end = text.find(_NEMOTRON[1], start)
        inner = text[start + len(_NEMOTRON[0]) : end if end >= 0 else len(text)]
        try:
            calls = _calls(json.loads(inner, strict=False), names)
        except json.JSONDecodeError:
            calls = None
        if calls:
            return (text[:start].strip() or None), calls
    try:
        calls = _calls(json.loads(text, strict=False), names)
    except json.JSONDecodeError:
        calls = None
    return (None, calls) if calls else (text, [])
