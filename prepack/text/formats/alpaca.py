"""Format `alpaca`: {instruction, input, output}."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.formats.fields import Columns, RequiredColumns, check_record, get_optional_str, get_str, require_nonblank
from prepack.text.formats.single_turn import SingleTurnFormat


@dataclass(frozen=True)
class AlpacaTemplate(SingleTurnFormat, RequiredColumns):
    """{instruction, input, output}: prompt = instruction, plus "\\n\\n" + input when the
    input is non-blank (Alpaca leaves it "" for instruction-only tasks). `columns` renames
    instruction, input and output (e.g. "instruction=question,output=answer")."""

    columns: str = ""

    name: ClassVar[str] = "alpaca"
    COLUMNS: ClassVar[dict[str, str]] = {"instruction": "instruction", "input": "input", "output": "output"}

    def __post_init__(self) -> None:
        cols = Columns(self.columns, self.COLUMNS, self.name)
        object.__setattr__(self, "_keys", (cols["instruction"], cols["input"], cols["output"]))
        object.__setattr__(self, "_required", (cols["instruction"], cols["output"]))

    def to_pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        record = check_record(record)
        ik, xk, ok = self._keys  # type: ignore[attr-defined]
        instruction = get_str(record, ik, ik, "the task instruction")
        extra = get_optional_str(record, xk, xk, "the optional task input")
        output = get_str(record, ok, ok, "the target response")
        require_nonblank(instruction, "empty_prompt", ik, "instruction text")
        require_nonblank(output, "empty_response", ok, "response text")
        return (instruction + "\n\n" + extra if extra.strip() else instruction), output
