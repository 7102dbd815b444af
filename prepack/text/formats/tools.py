"""Tools and tool calls as published datasets write them, read strictly.

`tools` (a record's column, in any message format): a list of function schemas, or a JSON string
of one; `[]`, `""` and null mean no tools. Each schema is an object with a `name`, bare
(`{name, description, parameters}`, ShareGPT/glaive) or in the OpenAI wrapper
(`{type: function, function: {name, ...}}`). Parameters pass through unvalidated: public sets
write `"type": "OBJECT"`, `"dict"`, `"str"`, and a chat format writes them as given.

A call: `{name, arguments}` or `{type?, id?, function: {name, arguments}}`, its arguments an object
or a JSON string of one. A call naming a function the record's tools do not list is refused when
the record lists tools.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from prepack.text.conversation import RecordError, ToolCall, json_text
from prepack.text.formats.fields import describe

__all__ = ["read_tools", "read_call", "read_calls_json", "tool_name"]


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _INVALID


_INVALID = object()


def tool_name(schema: Any) -> str | None:
    """The function name of one tool schema (bare or in the OpenAI wrapper), None when it has none."""
    if not isinstance(schema, Mapping):
        return None
    inner = schema.get("function")
    if isinstance(inner, Mapping):
        schema = inner
    name = schema.get("name")
    return name if isinstance(name, str) and name.strip() else None


def read_tools(value: Any, path: str) -> tuple[tuple[Any, ...], frozenset[str]]:
    """(the tool schemas as given, their names); () when the record offers none."""
    if value is None or value == "" or value == []:
        return (), frozenset()
    if isinstance(value, str):
        parsed = _loads(value)
        if parsed is _INVALID:
            raise RecordError("bad_tools", path, f"field '{path}': expected a list of function schemas or a JSON "
                              f"string of one, got a string that is not valid JSON")
        if parsed is None or parsed == []:
            return (), frozenset()
        value = parsed
    if not isinstance(value, (list, tuple)):
        raise RecordError("bad_tools", path, f"field '{path}': expected a list of function schemas, got {describe(value)}")
    names: list[str] = []
    for i, schema in enumerate(value):
        name = tool_name(schema)
        if name is None:
            raise RecordError("bad_tools", f"{path}[{i}]", f"field '{path}[{i}]': expected a function schema with a "
                              f"name (bare, or under 'function'), got {describe(schema)}")
        names.append(name)
    return tuple(value), frozenset(names)


def read_call(value: Any, path: str, tool_names: frozenset[str]) -> ToolCall:
    """One call, `{name, arguments}` or `{type?, id?, function: {name, arguments}}`."""
    if not isinstance(value, Mapping):
        raise RecordError("bad_tool_call", path, f"field '{path}': expected a tool call object "
                          f"{{name, arguments}} or {{function: {{name, arguments}}}}, got {describe(value)}")
    call_id = value.get("id")
    inner = value.get("function")
    where = path
    if inner is not None:
        if not isinstance(inner, Mapping):
            raise RecordError("bad_tool_call", f"{path}.function", f"field '{path}.function': expected an object "
                              f"{{name, arguments}}, got {describe(inner)}")
        value, where = inner, f"{path}.function"
    name = value.get("name")
    if not isinstance(name, str) or not name.strip():
        raise RecordError("bad_tool_call", f"{where}.name", f"field '{where}.name': expected the function's name, "
                          f"got {describe(name)}")
    if tool_names and name not in tool_names:
        shown = ", ".join(sorted(tool_names)[:8])
        raise RecordError("unknown_tool", f"{where}.name", f"field '{where}.name': the call names function {name!r}, "
                          f"which the record's tools do not list ({shown})")
    if "arguments" not in value or value["arguments"] is None:
        raise RecordError("bad_tool_call", f"{where}.arguments", f"field '{where}.arguments': missing; expected the "
                          "call's arguments as an object or a JSON string of one")
    arguments = value["arguments"]
    if isinstance(arguments, str):
        parsed = _loads(arguments)
        if parsed is _INVALID:
            raise RecordError("bad_tool_call", f"{where}.arguments", f"field '{where}.arguments': not valid JSON "
                              f"({describe(arguments)}); expected an object or a JSON string of one")
        if not isinstance(parsed, dict):
            raise RecordError("bad_tool_call", f"{where}.arguments", f"field '{where}.arguments': expected a JSON "
                              f"object, got {describe(parsed)}")
        return ToolCall(name, parsed, arguments, call_id if isinstance(call_id, str) else None)
    if not isinstance(arguments, dict):
        raise RecordError("bad_tool_call", f"{where}.arguments", f"field '{where}.arguments': expected an object or a "
                          f"JSON string of one, got {describe(arguments)}")
    return ToolCall(name, arguments, json_text(arguments), call_id if isinstance(call_id, str) else None)


def read_calls_json(text: Any, path: str, tool_names: frozenset[str]) -> tuple[ToolCall, ...]:
    """A ShareGPT function_call turn's value, or a `tool_call` content part's: one call or a list
    of calls (parallel), as an object or JSON text."""
    value = text
    if isinstance(text, str):
        value = _loads(text)
        if value is _INVALID:
            raise RecordError("bad_tool_call", path, f"field '{path}': not valid JSON ({describe(text)}); expected a "
                              "call {\"name\": ..., \"arguments\": ...} or a list of them")
    if isinstance(value, list):
        if not value:
            raise RecordError("bad_tool_call", path, f"field '{path}': an empty list of calls")
        return tuple(read_call(v, f"{path}[{i}]", tool_names) for i, v in enumerate(value))
    return (read_call(value, path, tool_names),)
