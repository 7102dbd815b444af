"""Format `prompt_response`: {prompt, response}."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from prepack.text.formats.fields import Columns, RequiredColumns, check_record, get_str, require_nonblank
from prepack.text.formats.single_turn import SingleTurnFormat


@dataclass(frozen=True)
class PromptResponseTemplate(SingleTurnFormat, RequiredColumns):
    """{prompt, response}: one user turn and one assistant turn."""

    columns: str = ""

    name: ClassVar[str] = "prompt_response"
    COLUMNS: ClassVar[dict[str, str]] = {"prompt": "prompt", "response": "response"}

    def __post_init__(self) -> None:
        cols = Columns(self.columns, self.COLUMNS, self.name)
        object.__setattr__(self, "_keys", (cols["prompt"], cols["response"]))
        object.__setattr__(self, "_required", self._keys)  # type: ignore[attr-defined]

    def to_pair(self, record: Mapping[str, Any]) -> tuple[str, str]:
        record = check_record(record)
        pk, rk = self._keys  # type: ignore[attr-defined]
        prompt = get_str(record, pk, pk, "the user prompt")
        response = get_str(record, rk, rk, "the target response")
        require_nonblank(prompt, "empty_prompt", pk, "prompt text")
        require_nonblank(response, "empty_response", rk, "response text")
        return prompt, response
