"""A YAML (and so JSON) reader for config files others can write (the `--mixture` file).

PyYAML's safe loader still lets one line of config cost gigabytes or a traceback: an alias
bomb expands to billions of nodes, a 100,000-deep nesting recurses past Python's limit, a
5,001-digit integer raises inside int(), and a duplicate key silently wins. This loader
refuses anchors and aliases, duplicate keys and merge keys (`<<`) with one line naming the
line of the file, stops composing past MAX_DEPTH levels, and reads a number written with more
than MAX_NUMBER_CHARS characters as a LongNumber (never converted, so the caller's type check
refuses it naming its field). The caller caps the file's size before calling.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import yaml
from yaml.events import AliasEvent

# Mappings and lists nested deeper than this are refused (a mixture file needs 4).
MAX_DEPTH = 32
# Numbers written with more characters than this are not converted.
MAX_NUMBER_CHARS = 40


class StrictYamlError(ValueError):
    """The text is not YAML this reader accepts; the message is one line."""


class LongNumber:
    """A number written with too many characters to convert safely."""

    def __init__(self, chars: int) -> None:
        self.chars = chars

    def __repr__(self) -> str:
        return f"<a number written with {self.chars:,} characters>"


def _line(node_or_event: Any) -> str:
    mark = getattr(node_or_event, "start_mark", None)
    return f"line {mark.line + 1}: " if mark is not None else ""


class _StrictLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, AliasEvent) or getattr(event, "anchor", None) is not None:
            raise StrictYamlError(f"{_line(event)}anchors and aliases (&name, *name) are not allowed; "
                                  "write each value out")
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise StrictYamlError(f"{_line(event)}nested more than {MAX_DEPTH} levels deep")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
        if not isinstance(node, yaml.MappingNode):
            raise StrictYamlError(f"{_line(node)}expected a mapping")
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise StrictYamlError(f"{_line(key_node)}merge keys (<<) are not allowed; write each key out")
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable) or isinstance(key, LongNumber):
                raise StrictYamlError(f"{_line(key_node)}a key must be a plain value")
            if key in out:
                raise StrictYamlError(f"{_line(key_node)}duplicate key {str(key)[:40]!r}; each key may appear once")
            out[key] = self.construct_object(value_node, deep=deep)
        return out


def _bounded(convert: Any) -> Any:
    def construct(loader: yaml.SafeLoader, node: Any) -> Any:
        text = loader.construct_scalar(node)
        if len(text) > MAX_NUMBER_CHARS:
            return LongNumber(len(text))
        return convert(loader, node)

    return construct


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _bounded(yaml.SafeLoader.construct_yaml_int))
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _bounded(yaml.SafeLoader.construct_yaml_float))


def load(text: str) -> Any:
    """The document in `text`; raises StrictYamlError (one line) for what this reader refuses
    and for text that is not YAML or JSON."""
    loader = _StrictLoader(text)
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}: " if mark is not None else ""
        problem = " ".join(str(getattr(e, "problem", None) or e).split())
        raise StrictYamlError(f"{at}not valid YAML or JSON ({problem[:120]})") from None
    except RecursionError:  # not reachable within MAX_DEPTH; kept so no traceback escapes
        raise StrictYamlError(f"nested more than {MAX_DEPTH} levels deep") from None
    finally:
        loader.dispose()
