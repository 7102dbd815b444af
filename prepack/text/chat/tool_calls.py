"""Tool calls read back out of generated text, in the layout a chat format writes them.

What a model learns to write for a call is the layout of its training rendering, so the parser
follows the chat format (`--tool-call-parser` names one for a jinja template), and its tags are the
ones the format renders (prepack/text/tool_markup.py):

- `hermes`: `<tool_call>\\n{"name": NAME, "arguments": {...}}\\n</tool_call>`, one block per call:
  Qwen3's template and the `qwen3` and `chatml` chat formats (prepack/text/chat/chatml.py);
- `functiongemma`: `<start_function_call>call:NAME{key:VALUE,...}<end_function_call>`, string
  values between `<escape>` tokens, objects `{k:v,...}`, lists `[v,...]`, other values as JSON
  (FunctionGemma's published layout, prepack/text/chat/templates/functiongemma_layout.jinja);
- `none`: the format has no call markup (gemma); no calls are read.

A call is malformed when its block is not closed (the reply hit --max-new-tokens), its body does
not parse, it has no name, or its arguments are not a JSON object. Arguments compare as JSON
values: key order and the spelling of numbers do not matter, types do (the string "5" is not 5).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from typing import Any

from prepack.text.tool_markup import FUNCTIONGEMMA_CALL, FUNCTIONGEMMA_ESCAPE, HERMES_CALL

__all__ = ["Call", "ParsedCalls", "PARSERS", "parser_names", "get_parser", "default_parser", "ParseError"]


@dataclasses.dataclass(frozen=True)
class Call:
    name: str
    arguments: Any  # a JSON value (an object for every well-formed call)

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments}


@dataclasses.dataclass(frozen=True)
class ParsedCalls:
    """The well-formed calls of a text, and how many call blocks it opened that were not."""

    calls: tuple[Call, ...] = ()
    malformed: int = 0

    @property
    def attempted(self) -> bool:
        """Whether the text opened any call block at all."""
        return bool(self.calls) or self.malformed > 0

    @property
    def valid(self) -> bool:
        """At least one call, and none malformed."""
        return bool(self.calls) and not self.malformed


class ParseError(ValueError):
    pass


def _blocks(text: str, open_tag: str, close_tag: str) -> tuple[list[str], int]:
    """The bodies of every closed open..close block, and the count of unclosed ones."""
    bodies, unclosed, pos = [], 0, 0
    while True:
        start = text.find(open_tag, pos)
        if start < 0:
            return bodies, unclosed
        end = text.find(close_tag, start + len(open_tag))
        nxt = text.find(open_tag, start + len(open_tag))
        if end < 0 or (0 <= nxt < end):
            unclosed += 1
            if nxt < 0:
                return bodies, unclosed
            pos = nxt
            continue
        bodies.append(text[start + len(open_tag):end])
        pos = end + len(close_tag)


def _arguments(value: Any) -> Any:
    """Arguments as an object; a JSON string holding one is read (templates write both)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ParseError(f"arguments are a string that is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise ParseError("arguments are not a JSON object")
    return value


def parse_hermes(text: str) -> ParsedCalls:
    bodies, malformed = _blocks(text, *HERMES_CALL)
    calls = []
    for body in bodies:
        try:
            obj = json.loads(body)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
                raise ParseError("no name")
            calls.append(Call(obj["name"], _arguments(obj.get("arguments", {}))))
        except (ValueError, ParseError):
            malformed += 1
    return ParsedCalls(tuple(calls), malformed)


_ESCAPE = FUNCTIONGEMMA_ESCAPE
_NAME = re.compile(r"call:([^{}<>\s]+)\{")


class _FunctionGemmaValue:
    """A recursive-descent reader of FunctionGemma's argument values."""

    def __init__(self, text: str) -> None:
        self.text, self.pos = text, 0

    def value(self) -> Any:
        t = self.text
        if t.startswith(_ESCAPE, self.pos):
            end = t.find(_ESCAPE, self.pos + len(_ESCAPE))
            if end < 0:
                raise ParseError(f"unclosed {_ESCAPE} string")
            out = t[self.pos + len(_ESCAPE):end]
            self.pos = end + len(_ESCAPE)
            return out
        if t.startswith("{", self.pos):
            return self.obj()
        if t.startswith("[", self.pos):
            return self.seq()
        match = re.compile(r"[^,}\]]*").match(t, self.pos)
        literal = match.group(0) if match else ""
        self.pos += len(literal)
        try:
            return json.loads(literal)
        except ValueError:
            raise ParseError(f"value {literal!r} is neither an {_ESCAPE} string nor JSON") from None

    def obj(self) -> dict[str, Any]:
        self.expect("{")
        out: dict[str, Any] = {}
        if self.take("}"):
            return out
        while True:
            colon = self.text.find(":", self.pos)
            if colon < 0:
                raise ParseError("a key without ':'")
            key = self.text[self.pos:colon]
            if not key or any(c in key for c in "{}[],<>"):
                raise ParseError(f"bad key {key!r}")
            self.pos = colon + 1
            out[key] = self.value()
            if self.take("}"):
                return out
            self.expect(",")

    def seq(self) -> list[Any]:
        self.expect("[")
        out: list[Any] = []
        if self.take("]"):
            return out
        while True:
            out.append(self.value())
            if self.take("]"):
                return out
            self.expect(",")

    def take(self, char: str) -> bool:
        if self.text.startswith(char, self.pos):
            self.pos += len(char)
            return True
        return False

    def expect(self, char: str) -> None:
        if not self.take(char):
            raise ParseError(f"expected {char!r} at {self.pos}")


def parse_functiongemma(text: str) -> ParsedCalls:
    bodies, malformed = _blocks(text, *FUNCTIONGEMMA_CALL)
    calls = []
    for body in bodies:
        match = _NAME.match(body)
        if not match:
            malformed += 1
            continue
        reader = _FunctionGemmaValue(body)
        reader.pos = match.end() - 1  # at the '{'
        try:
            arguments = reader.obj()
            if reader.pos != len(body):
                raise ParseError("text after the arguments")
        except ParseError:
            malformed += 1
            continue
        calls.append(Call(match.group(1), arguments))
    return ParsedCalls(tuple(calls), malformed)


def parse_none(text: str) -> ParsedCalls:
    return ParsedCalls()


PARSERS: dict[str, Callable[[str], ParsedCalls]] = {
    "hermes": parse_hermes,
    "functiongemma": parse_functiongemma,
    "none": parse_none,
}


def parser_names() -> tuple[str, ...]:
    return tuple(PARSERS)


def get_parser(name: str) -> Callable[[str], ParsedCalls]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown --tool-call-parser {name!r}; choose one of {', '.join(PARSERS)}") from None


def default_parser(chat_format: str, chat_template: str | None = None) -> str | None:
    """The parser a chat format's layout calls for: hermes for chatml/qwen3, none for gemma, and
    for a jinja template (hf) the layout its text spells; None when the template spells neither
    (then --tool-call-parser must name one to score calls)."""
    if chat_format in ("chatml", "qwen3"):
        return "hermes"
    if chat_format == "gemma":
        return "none"
    template = chat_template or ""
    if FUNCTIONGEMMA_CALL[0] in template:
        return "functiongemma"
    if HERMES_CALL[0] in template:
        return "hermes"
    return None


def reference_calls(calls: Sequence[Any]) -> tuple[Call, ...]:
    """A turn's ToolCalls (prepack/text/conversation.py) as Calls."""
    return tuple(Call(c.name, c.arguments) for c in calls)
