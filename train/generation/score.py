"""`prepack generate --score`: each completion against the record's own reference reply.

Per prompt (the `score` object of its JSONL line):
- `exact_match`: the completion equals the reference reply after stripping whitespace (both as
  the chat format decodes them, special tokens written out, the closing end-of-turn left off);
- `reference_nll`: the reference's mean token NLL under the model, teacher-forced after the
  prompt (train/generation/generate.py computes it through the training loss's output projection); it moves
  long before exact match does;
- `calls` (when the run reads tool calls): the reference's calls (from the record) and the
  completion's (prepack/text/chat/tool_calls.py).

The summary (`summarize`) over all prompts:
- `exact_match`: the fraction of prompts matched exactly;
- `reference_nll`: the token-weighted mean NLL over every reference token (as an eval loss is);
- tool calls, where a parser reads them: `valid_call_rate` (of the prompts whose reference calls:
  the completion makes at least one call and none malformed), `function_name_accuracy` (the called
  names, in order, equal the reference's), `full_call_accuracy` (names and arguments equal as
  JSON), and `no_call_accuracy` (of the prompts whose reference makes no call: the completion
  makes none either). A rate whose prompts are absent is null.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from prepack.text.chat.tool_calls import Call, ParsedCalls, get_parser

# The summary's rates, in the order tables show them; `label` is the column head.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("exact_match", "exact_match"),
    ("reference_nll", "reference_nll"),
    ("valid_call_rate", "valid_call"),
    ("function_name_accuracy", "name_acc"),
    ("full_call_accuracy", "full_call"),
    ("no_call_accuracy", "no_call"),
)


@dataclasses.dataclass(frozen=True)
class CallScore:
    expected: int  # calls the reference makes
    made: int  # well-formed calls in the completion
    malformed: int
    valid: bool
    names_match: bool
    full_match: bool

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def score_calls(reference: Sequence[Call], parsed: ParsedCalls) -> CallScore:
    names_match = [c.name for c in parsed.calls] == [c.name for c in reference] and not parsed.malformed
    full_match = names_match and all(_same_json(a.arguments, b.arguments) for a, b in zip(parsed.calls, reference))
    return CallScore(len(reference), len(parsed.calls), parsed.malformed, parsed.valid, names_match, full_match)


def _same_json(a: Any, b: Any) -> bool:
    """Equal as JSON values: 1 == 1.0, but True is not 1 and "5" is not 5."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_json(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same_json(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def exact_match(completion: str, reference: str) -> bool:
    return completion.strip() == reference.strip()


def record_score(completion: str, reference: str, nll_sum: float | None, reference_tokens: int,
                 calls: CallScore | None, parser: str | None = None) -> dict[str, Any]:
    """The `score` object of one JSONL line; `calls` carry the parser that read them, so that a
    reader can read the texts again (`from_texts`)."""
    out: dict[str, Any] = {
        "exact_match": exact_match(completion, reference),
        "reference_nll": _finite(nll_sum / reference_tokens) if nll_sum is not None and reference_tokens else None,
        "reference_tokens": reference_tokens,
    }
    if calls is not None:
        out["calls"] = {**calls.as_json(), "parser": parser}
    return out


def from_texts(completion: str, reference: str, parser: str | None) -> dict[str, Any]:
    """What a line's score says that its texts alone decide: exact match, and with a parser the calls,
    the reference's read from its own text (it is the record's reply as the chat format renders it)."""
    out: dict[str, Any] = {"exact_match": exact_match(completion, reference)}
    if parser is not None:
        parse = get_parser(parser)
        out["calls"] = {**score_calls(parse(reference).calls, parse(completion)).as_json(), "parser": parser}
    return out


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None


def _rate(hits: int, total: int) -> float | None:
    return hits / total if total else None


def summarize(lines: Iterable[Mapping[str, Any]], parser: str | None = None) -> dict[str, Any]:
    """The summary over the scored lines of a generations JSONL (each with its `score`)."""
    lines = list(lines)
    scores = [line["score"] for line in lines]
    n = len(scores)
    nll_tokens = sum(s["reference_tokens"] for s in scores if s.get("reference_nll") is not None)
    nll_sum = sum(s["reference_nll"] * s["reference_tokens"] for s in scores if s.get("reference_nll") is not None)
    out: dict[str, Any] = {
        "prompts": n,
        "exact_match": _rate(sum(bool(s["exact_match"]) for s in scores), n),
        "reference_nll": nll_sum / nll_tokens if nll_tokens else None,
        "reference_tokens": nll_tokens,
        "completion_tokens_mean": (sum(line["completion_tokens"] for line in lines) / n) if n else None,
        "stop_reasons": dict(sorted(Counter(line["stop_reason"] for line in lines).items())),
        "tool_call_parser": parser,
    }
    calls = [s["calls"] for s in scores if "calls" in s]
    expect = [c for c in calls if c["expected"]]
    none = [c for c in calls if not c["expected"]]
    out.update({
        "call_prompts": len(expect) if calls else None,
        "no_call_prompts": len(none) if calls else None,
        "valid_call_rate": _rate(sum(c["valid"] for c in expect), len(expect)),
        "function_name_accuracy": _rate(sum(c["names_match"] for c in expect), len(expect)),
        "full_call_accuracy": _rate(sum(c["full_match"] for c in expect), len(expect)),
        "no_call_accuracy": _rate(sum(not c["made"] and not c["malformed"] for c in none), len(none)),
    })
    return out


def _cell(key: str, value: Any) -> str:
    if value is None:
        return "-"
    if key == "reference_nll":
        return f"{value:.3f}"
    return f"{value:.1%}"


def table(summaries: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    """The printed table: one row per run (name, summary), the rates as columns; columns of
    tool-call rates only when some run has them."""
    columns = [(key, label) for key, label in COLUMNS
               if key in ("exact_match", "reference_nll") or any(s.get(key) is not None for _, s in summaries)]
    width = max([len("run")] + [len(name) for name, _ in summaries])
    head = f"{'run':<{width}}  {'prompts':>7}  " + "  ".join(f"{label:>13}" for _, label in columns)
    rows = [head]
    for name, s in summaries:
        rows.append(f"{name:<{width}}  {s.get('prompts', 0):>7}  " + "  ".join(f"{_cell(k, s.get(k)):>13}" for k, _ in columns))
    return "\n".join(rows)
