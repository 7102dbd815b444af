"""`prepack report --generations BASE.jsonl TUNED.jsonl`: runs of `prepack generate` side by side.

Each file is read as written by a stranger (one JSON object per line with the keys `prepack
generate` writes, each of its type); the runs must hold the same prompts (ids). Nothing a line
says that its texts decide is believed: exact match and the tool calls (with the parser the line
names) are recomputed from the completion and the reference (train/generation/score.py's `from_texts`), and
a line whose stored score disagrees, or whose score fields are missing or of another type, is
refused naming the file and line. The reference NLL needs the model and is taken as written (a
finite number or null), and labelled so ("as stored, not measured here"). Each line is read with a
bound (MAX_LINE_BYTES), as UTF-8 and JSON, any failure one line (prepack.hostile_input.untrusted.jsonl_values). The summary of each run comes from its lines (`summarize`); a run
generated without `--score` is scored here by exact match alone. The table
has one row per metric and one column per run, the change against the first run beside it; the
prompts whose exact match differs between the first and the last run follow, a few of each way.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from typing import Any

from prepack.hostile_input.untrusted import jsonl_values, shown, shown_with_type
from prepack.text.chat import tool_calls
from train.generation import score as score_lib

SHOWN_CHANGES = 3  # prompts shown per direction (fixed, broken)
# A line holds one completion and one reference (no prompt text): a model's whole context of text is
# far less. A longer line is refused after reading this much of it.
MAX_LINE_BYTES = 64 << 20


class GenerationsError(ValueError):
    """A generations file that cannot be compared: one line naming the file and line."""


@dataclasses.dataclass(frozen=True)
class GenerationRun:
    label: str
    path: str
    lines: list[dict[str, Any]]
    summary: dict[str, Any]

    @property
    def by_id(self) -> dict[str, dict[str, Any]]:
        return {line["id"]: line for line in self.lines}


# A line's fields and their JSON types (bool is not an int here: True is no token count).
LINE_TYPES = {"id": (str, "a string"), "completion": (str, "a string"), "reference": (str, "a string"),
              "completion_tokens": (int, "a whole number"), "stop_reason": (str, "a string")}
SCORE_TYPES = {"exact_match": (bool, "true or false"), "reference_tokens": (int, "a whole number")}
CALL_TYPES = {"expected": (int, "a whole number"), "made": (int, "a whole number"), "malformed": (int, "a whole number"),
              "valid": (bool, "true or false"), "names_match": (bool, "true or false"),
              "full_match": (bool, "true or false"), "parser": (str, "a tool-call parser's name")}


def _typed(where: str, obj: dict[str, Any], types: dict[str, tuple[type, str]], prefix: str) -> None:
    for key, (kind, said) in types.items():
        if key not in obj:
            raise GenerationsError(f"{where}: {prefix}{key} is missing: not a line `prepack generate` wrote")
        value = obj[key]
        if type(value) is not kind or (kind is int and value < 0):
            raise GenerationsError(f"{where}: {prefix}{key} is {shown_with_type(value)}, not {said}")


def _scored(line: dict[str, Any], where: str) -> dict[str, Any]:
    """A line with its score, checked against its texts; exact match computed here when the run was not scored."""
    _typed(where, line, LINE_TYPES, "")
    if "score" not in line:
        return {**line, "score": {"exact_match": score_lib.exact_match(line["completion"], line["reference"]),
                                  "reference_nll": None, "reference_tokens": 0}}
    stored = line["score"]
    if not isinstance(stored, dict):
        raise GenerationsError(f"{where}: score is {shown_with_type(stored)}, not an object")
    _typed(where, stored, SCORE_TYPES, "score.")
    nll = stored.get("reference_nll", "missing")
    if nll is not None and not (type(nll) in (int, float) and math.isfinite(nll) and nll >= 0):
        raise GenerationsError(f"{where}: score.reference_nll is {shown_with_type(nll)}, not a finite number or null")
    parser = None
    if "calls" in stored:
        if not isinstance(stored["calls"], dict):
            raise GenerationsError(f"{where}: score.calls is {shown_with_type(stored['calls'])}, not an object")
        _typed(where, stored["calls"], CALL_TYPES, "score.calls.")
        parser = stored["calls"]["parser"]
        if parser not in tool_calls.parser_names():
            raise GenerationsError(f"{where}: score.calls.parser is {shown(parser)}, not one of "
                                   f"{', '.join(tool_calls.parser_names())}")
    recomputed = score_lib.from_texts(line["completion"], line["reference"], parser)
    for key, value in [("exact_match", recomputed["exact_match"]),
                       *((f"calls.{k}", v) for k, v in recomputed.get("calls", {}).items())]:
        have = stored["exact_match"] if key == "exact_match" else stored["calls"][key.removeprefix("calls.")]
        if have != value:
            raise GenerationsError(
                f"{where}: score.{key} is {json.dumps(have)}, but the texts say {json.dumps(value)} (recomputed from the "
                f"completion {shown(line['completion'], 40)} and the reference {shown(line['reference'], 40)}); a score "
                "its own texts contradict is not believed: generate the file again")
    return line


def load(raw: str) -> GenerationRun:
    label, sep, path = raw.partition("=")
    if not (sep and label and os.sep not in label and not os.path.exists(raw)):
        label, path = os.path.splitext(os.path.basename(raw))[0], raw
    if not os.path.isfile(path):
        raise GenerationsError(f"--generations {path}: no such file")
    lines = []
    for where, line in jsonl_values(path, GenerationsError, MAX_LINE_BYTES, "a line `prepack generate` wrote"):
        missing = [k for k in LINE_TYPES if not isinstance(line, dict) or k not in line]
        if missing:
            raise GenerationsError(f"{where}: not a `prepack generate` line (no {', '.join(missing)})")
        lines.append(_scored(line, where))
    if not lines:
        raise GenerationsError(f"{path}: no generations")
    ids = [line["id"] for line in lines]
    if len(set(ids)) != len(ids):
        raise GenerationsError(f"{path}: an id appears twice ({next(i for i in ids if ids.count(i) > 1)!r})")
    return GenerationRun(label, path, lines, score_lib.summarize(lines))


def load_all(raws: Sequence[str]) -> list[GenerationRun]:
    runs = [load(raw) for raw in raws]
    first = set(runs[0].by_id)
    for run in runs[1:]:
        if set(run.by_id) != first:
            extra, missing = sorted(set(run.by_id) - first), sorted(first - set(run.by_id))
            raise GenerationsError(f"{run.path} and {runs[0].path} hold different prompts ({len(missing)} only in the "
                                   f"first, e.g. {missing[:1]}; {len(extra)} only in the other, e.g. {extra[:1]}): generate "
                                   "both from the same --input and options")
    return runs


METRICS = (
    ("exact_match", "exact match", "rate"),
    # Taken as the file states it (recomputing it needs the model): the label says so.
    ("reference_nll", "reference NLL (as stored, not measured here)", "nll"),
    ("valid_call_rate", "valid call rate", "rate"),
    ("function_name_accuracy", "function name accuracy", "rate"),
    ("full_call_accuracy", "full call accuracy", "rate"),
    ("no_call_accuracy", "no-call accuracy", "rate"),
    ("completion_tokens_mean", "completion tokens (mean)", "num"),
)


def _cell(value: Any, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "rate":
        return f"{value:.1%}"
    if kind == "nll":
        return f"{value:.3f}"
    return f"{value:.1f}"


def _change(first: Any, last: Any, kind: str) -> str:
    if first is None or last is None:
        return "-"
    delta = last - first
    if kind == "rate":
        return f"{delta * 100:+.1f} pp"
    return f"{delta:+.3f}" if kind == "nll" else f"{delta:+.1f}"


def table(runs: Sequence[GenerationRun]) -> tuple[list[str], list[list[str]]]:
    """(headers, rows): one row per metric any run has, a column per run, the change last - first."""
    headers = ["metric", *(run.label for run in runs)] + (["change"] if len(runs) > 1 else [])
    rows = [["prompts", *(str(run.summary["prompts"]) for run in runs)] + ([""] if len(runs) > 1 else [])]
    for key, name, kind in METRICS:
        values = [run.summary.get(key) for run in runs]
        if all(v is None for v in values):
            continue
        rows.append([name, *(_cell(v, kind) for v in values)] + ([_change(values[0], values[-1], kind)] if len(runs) > 1 else []))
    stops = sorted({reason for run in runs for reason in run.summary["stop_reasons"]})
    for reason in stops:
        counts = [run.summary["stop_reasons"].get(reason, 0) for run in runs]
        rows.append([f"stop: {reason}", *map(str, counts)] + ([""] if len(runs) > 1 else []))
    return headers, rows


def changed_prompts(runs: Sequence[GenerationRun]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(direction, first run's line, last run's line) for prompts whose exact match differs:
    "fixed" (wrong first, right last) then "broken", a few of each, in input order."""
    if len(runs) < 2:
        return []
    first, last = runs[0].by_id, runs[-1].by_id
    out = []
    for direction, want in (("fixed", (False, True)), ("broken", (True, False))):
        found = [(direction, first[i], last[i]) for i in first
                 if (bool(first[i]["score"]["exact_match"]), bool(last[i]["score"]["exact_match"])) == want]
        out += found[:SHOWN_CHANGES]
    return out


def page_section(page: Any, runs: Sequence[GenerationRun]) -> None:
    """The report page's section: the table, then the changed prompts as a table of their own."""
    page.add("h2", "Generations")
    page.add("p", "Runs of `prepack generate` on the same prompts: " + ", ".join(f"{r.label} ({r.path})" for r in runs)
             + ". Exact match: the completion equals the record's own reply after stripping, recomputed here from the "
             "texts; reference NLL: the reply's mean token NLL under the run's model (lower is better), as each file "
             "states it: the report has no model to measure it with.")
    headers, rows = table(runs)
    page.add("table", headers, rows)
    changes = changed_prompts(runs)
    if changes:
        page.add("h3", f"Prompts whose exact match changed ({runs[0].label} to {runs[-1].label})")
        page.add("table", ["change", "id", "reference", runs[0].label, runs[-1].label],
                 [[d, a["id"], a["reference"][:200], a["completion"][:200], b["completion"][:200]] for d, a, b in changes])


def render_text(runs: Sequence[GenerationRun]) -> str:
    headers, rows = table(runs)
    widths = [max(len(r[c]) for r in [headers, *rows]) for c in range(len(headers))]
    lines = ["  ".join(cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(row, widths)))
             for row in [headers, *rows]]
    changes = changed_prompts(runs)
    if changes:
        lines.append("")
        lines.append(f"prompts whose exact match changed from {runs[0].label} to {runs[-1].label} (a few of each way):")
        for direction, a, b in changes:
            lines.append(f"  {direction} {a['id']}")
            lines.append(f"    reference: {a['reference'][:160]!r}")
            lines.append(f"    {runs[0].label}: {a['completion'][:160]!r}")
            lines.append(f"    {runs[-1].label}: {b['completion'][:160]!r}")
    return "\n".join(lines)
