"""Dataset mixtures: the mixture file (`prepack pack --mixture FILE`) and the share rule.

The file (YAML, or JSON, which YAML reads too):

    weight_of: target_tokens        # or: examples
    max_repeats: 4                  # default 1: no source is upsampled
    sources:
      - name: alpaca                # [a-z0-9_-]+, unique
        input: data/alpaca.jsonl    # a spec or a list of specs, as --input takes
        format: alpaca              # plus the format's options: source_lang, target_lang, prompt_format
        weight: 3

Relative local input paths are relative to the file's folder. Sources are numbered 1..N in
file order; 0 is padding in a row's `source_ids`.

The share rule (one implementation: `budgets`, then `partial_count`), per max length L:
source i keeps K_i (examples, or target tokens, at L) and asks for share s_i = w_i / sum(w).
The output total is T = min_i(max_repeats * K_i / s_i): the scarcest source relative to its
weight sets it, and none is used more than max_repeats times. Source i's budget B_i = T * s_i
(exact rationals) is met by c_i = floor(B_i / K_i) whole copies of the source, then by one more
copy of the lowest-ranked examples (rank: stable hash, ties by example id) whose running weight
stays within the rest r_i = B_i - c_i * K_i. So the written weight is within one example of B_i.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

WEIGHT_OF = ("target_tokens", "examples")
TOP_KEYS = frozenset({"weight_of", "max_repeats", "sources"})
SOURCE_KEYS = frozenset({"name", "input", "format", "weight"})
FORMAT_OPTIONS = frozenset({"source_lang", "target_lang", "prompt_format"})
NAME_PATTERN = re.compile(r"[a-z0-9_-]+")
# Formats that template whole tables (oasst1 groups messages by tree before templating):
# a mixture reads per record, so these are refused there (use their per-record export, `chat`).
TABLE_FORMATS = frozenset({"oasst1"})
# Realized shares must be within this of the requested ones (fractions of 1).
SHARE_TOLERANCE = 0.005
# At most this many sources: the trainer's per-source loss sums are fixed-size vectors.
MAX_SOURCES = 64
# Rank buckets of the job's boundary search: the top RANK_BITS bits of an example's hash.
RANK_BITS = 12


class MixtureError(ValueError):
    """A mixture file that cannot be used; the message is one line naming the file and field."""


@dataclasses.dataclass(frozen=True)
class MixtureSource:
    index: int  # 1..N in file order
    name: str
    inputs: tuple[str, ...]  # resolved: relative local paths joined to the file's folder
    format: str
    weight: Fraction
    options: tuple[tuple[str, str], ...] = ()  # the format's options, sorted

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "inputs": list(self.inputs), "format": self.format,
                "options": dict(self.options), "weight": weight_json(self.weight)}


@dataclasses.dataclass(frozen=True)
class Mixture:
    path: str
    sha256: str  # of the file's bytes
    weight_of: str
    max_repeats: int
    sources: tuple[MixtureSource, ...]

    @property
    def weights(self) -> list[Fraction]:
        return [s.weight for s in self.sources]

    def requested_shares(self) -> list[float]:
        total = sum(self.weights)
        return [float(w / total) for w in self.weights]

    def inputs(self) -> tuple[str, ...]:
        """Every source's inputs, in file order: the job's inputs (input index = position here)."""
        return tuple(spec for s in self.sources for spec in s.inputs)

    def source_of_input(self) -> tuple[int, ...]:
        """The source (1..N) of each of `inputs()`."""
        return tuple(s.index for s in self.sources for _ in s.inputs)

    def same_sources(self, other: "Mixture") -> str | None:
        """None when `other` mixes the same sources (names, inputs, formats, options, order);
        else what differs, for a one-line refusal."""
        mine, theirs = [s.describe() for s in self.sources], [s.describe() for s in other.sources]
        if [m["name"] for m in mine] != [t["name"] for t in theirs]:
            return (f"sources {[t['name'] for t in theirs]} differ from the set's {[m['name'] for m in mine]}")
        for m, t in zip(mine, theirs):
            for key in ("inputs", "format", "options"):
                if m[key] != t[key]:
                    return f"source {t['name']!r}: {key} {t[key]!r} differ from the set's {m[key]!r}"
        return None

    def describe(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "weight_of": self.weight_of, "max_repeats": self.max_repeats,
                "sources": [s.describe() for s in self.sources]}

    @classmethod
    def from_description(cls, d: dict[str, Any], path: str = "") -> "Mixture":
        """The mixture a tokenized set recorded (`describe()`), to pack it again as it was."""
        try:
            sources = tuple(MixtureSource(i, s["name"], tuple(s["inputs"]), s["format"], Fraction(str(s["weight"])),
                                          tuple(sorted((k, str(v)) for k, v in s["options"].items())))
                            for i, s in enumerate(d["sources"], start=1))
            return cls(path, str(d["sha256"]), str(d["weight_of"]), int(d["max_repeats"]), sources)
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise MixtureError(f"the recorded mixture is malformed ({type(e).__name__}: {e})") from None


def weight_json(weight: Fraction) -> int | float:
    return int(weight) if weight.denominator == 1 else float(weight)


def load_mixture(path: str) -> Mixture:
    """Reads and validates a mixture file; raises MixtureError with one line."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise MixtureError(f"mixture file {path}: cannot be read ({e.strerror or e})") from None
    return parse_mixture(data, path)


def parse_mixture(data: bytes, path: str) -> Mixture:
    import yaml

    where = f"mixture file {path}"
    try:
        doc = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise MixtureError(f"{where}: not UTF-8 text") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark is not None else ""
        raise MixtureError(f"{where}: not valid YAML or JSON{at} ({getattr(e, 'problem', None) or e})") from None
    if not isinstance(doc, dict):
        raise MixtureError(f"{where}: must be a mapping with keys {', '.join(sorted(TOP_KEYS))}")
    unknown = sorted(str(k) for k in doc if k not in TOP_KEYS)
    if unknown:
        raise MixtureError(f"{where}: unknown key {unknown[0]!r}; expected {', '.join(sorted(TOP_KEYS))}")
    weight_of = doc.get("weight_of", "target_tokens")
    if weight_of not in WEIGHT_OF:
        raise MixtureError(f"{where}: weight_of must be target_tokens or examples, got {weight_of!r}")
    max_repeats = doc.get("max_repeats", 1)
    if isinstance(max_repeats, bool) or not isinstance(max_repeats, int) or max_repeats < 1:
        raise MixtureError(f"{where}: max_repeats must be a whole number of at least 1, got {max_repeats!r}")
    raw = doc.get("sources")
    if not isinstance(raw, list) or not raw:
        raise MixtureError(f"{where}: sources must be a non-empty list of sources")
    if len(raw) > MAX_SOURCES:
        raise MixtureError(f"{where}: {len(raw)} sources, at most {MAX_SOURCES}")
    base = os.path.dirname(os.path.abspath(path))
    sources: list[MixtureSource] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw, start=1):
        source = _parse_source(entry, i, base, where)
        if source.name in seen:
            raise MixtureError(f"{where}: source {i}: duplicate name {source.name!r}; names must be unique")
        seen.add(source.name)
        sources.append(source)
    return Mixture(os.path.abspath(path), hashlib.sha256(data).hexdigest(), weight_of, max_repeats, tuple(sources))


def _parse_source(entry: Any, index: int, base: str, where: str) -> MixtureSource:
    at = f"{where}: source {index}"
    if not isinstance(entry, dict):
        raise MixtureError(f"{at}: must be a mapping with name, input, format and weight")
    allowed = SOURCE_KEYS | FORMAT_OPTIONS
    unknown = sorted(str(k) for k in entry if k not in allowed)
    if unknown:
        raise MixtureError(f"{at}: unknown key {unknown[0]!r}; expected {', '.join(sorted(allowed))}")
    name = entry.get("name")
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        raise MixtureError(f"{at}: name {name!r} is malformed; use lowercase letters, digits, '_' and '-'")
    at = f"{where}: source {name!r}"
    for key in ("input", "format", "weight"):
        if key not in entry:
            raise MixtureError(f"{at}: missing key {key!r}")
    specs = entry["input"] if isinstance(entry["input"], list) else [entry["input"]]
    if not specs or not all(isinstance(s, str) and s for s in specs):
        raise MixtureError(f"{at}: input must be a spec or a non-empty list of specs, got {entry['input']!r}")
    fmt = entry["format"]
    if not isinstance(fmt, str) or not fmt:
        raise MixtureError(f"{at}: format must be a format name, got {fmt!r}")
    if fmt in TABLE_FORMATS:
        raise MixtureError(f"{at}: format {fmt!r} templates whole tables and cannot be mixed; "
                           "use its per-record export (format chat)")
    weight = _weight(entry["weight"], at)
    options = tuple(sorted((k, str(v)) for k, v in entry.items() if k in FORMAT_OPTIONS))
    try:
        from prepack.text.templates import get_template

        get_template(fmt, **dict(options))
    except ValueError as e:
        raise MixtureError(f"{at}: {e}") from None
    return MixtureSource(index, name, tuple(_resolve(s, base) for s in specs), fmt, weight, options)


def _weight(value: Any, at: str) -> Fraction:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise MixtureError(f"{at}: weight must be a positive number, got {value!r}")
    try:
        weight = Fraction(str(value))
    except (ValueError, ZeroDivisionError):
        raise MixtureError(f"{at}: weight must be a positive number, got {value!r}") from None
    if isinstance(value, float) and not math.isfinite(value) or weight <= 0:
        raise MixtureError(f"{at}: weight must be a positive number, got {value!r}")
    return weight


def _resolve(spec: str, base: str) -> str:
    """A relative local path joined to the mixture file's folder; URLs, hf:, tfds: and
    absolute paths as they are."""
    if re.match(r"^[a-z][a-z0-9+]*:", spec) or os.path.isabs(spec):
        return spec
    return os.path.normpath(os.path.join(base, spec))


# ----------------------------------------------------------------------------- the share rule


@dataclasses.dataclass(frozen=True)
class Budget:
    """One source's budget at one max length: `copies` whole copies, then examples of one more
    copy, lowest rank first, while their running weight stays within `rest`."""

    kept: int  # the source's kept weight K_i
    budget: Fraction  # B_i
    copies: int
    rest: Fraction

    def written(self, partial: int) -> int:
        return self.copies * self.kept + partial


def budgets(kept: Sequence[int], weights: Sequence[Fraction], max_repeats: int) -> list[Budget]:
    """Each source's budget from its kept weight (the module docstring's rule). A source with
    nothing kept makes the total 0 (the mix cannot be met: the caller says which)."""
    if len(kept) != len(weights) or not kept:
        raise ValueError("one kept size and one weight per source")
    total_w = sum(weights, Fraction(0))
    shares = [Fraction(w) / total_w for w in weights]
    total = min(Fraction(max_repeats * k) / s for k, s in zip(kept, shares))
    out = []
    for k, s in zip(kept, shares):
        b = total * s
        copies = min(max_repeats, math.floor(b / k)) if k else 0
        out.append(Budget(k, b, copies, b - copies * k))
    return out


def partial_count(weights_in_rank_order: Iterable[int], rest: Fraction) -> tuple[int, int]:
    """(examples, their weight) of the longest prefix whose running weight stays within rest."""
    taken = weight = 0
    for w in weights_in_rank_order:
        if weight + w > rest:
            break
        taken += 1
        weight += w
    return taken, weight


def limiting_source(kept: Sequence[int], weights: Sequence[Fraction]) -> int:
    """The 0-based source that sets the total (the scarcest relative to its weight)."""
    return min(range(len(kept)), key=lambda i: (Fraction(kept[i]) / weights[i], i))


def realized_shares(written: Sequence[int]) -> list[float]:
    total = sum(written)
    return [w / total if total else 0.0 for w in written]


def rank_bucket(hash64: int) -> int:
    return hash64 >> (64 - RANK_BITS)


# ----------------------------------------------------------------------------- what a set records


def source_figures(mixture: Mixture, tally: Any, max_length: int) -> list[dict[str, Any]]:
    """The manifest's `mixture.sources` at one max length, from the job's Tally
    (prepack.packing.accounting; its `sources` hold each source's own)."""
    from prepack.packing.accounting import Tally

    requested = mixture.requested_shares()
    per = [tally.sources.get(s.index, Tally()) for s in mixture.sources]
    written = [t.mix.get((max_length, "written_weight"), 0) for t in per]
    realized = realized_shares(written)
    out = []
    for source, t, want, got, w in zip(mixture.sources, per, requested, realized, written):
        kept = t.mix.get((max_length, "kept_weight"), 0)
        out.append({
            "name": source.name,
            "format": source.format,
            "weight": weight_json(source.weight),
            "requested_share": round(want, 6),
            "realized_share": round(got, 6),
            "examples_read": t.examples_read,
            "examples_written": t.mix.get((max_length, "written"), 0),
            "examples_unique": t.mix.get((max_length, "unique"), 0),
            "examples_dropped": t.examples_dropped(max_length),
            "examples_split": t.split.get(max_length, 0),
            "split_pieces": t.split_pieces.get(max_length, 0),
            "kept_weight": kept,
            "written_weight": w,
            "repeats": round(w / kept, 6) if kept else 0.0,
            "tokens": t.mix.get((max_length, "tokens"), 0),
            "target_tokens": t.mix.get((max_length, "target_tokens"), 0),
        })
    return out


def mixture_manifest(mixture: Mixture, tally: Any, max_length: int) -> dict[str, Any]:
    """The manifest's top-level `mixture` object at one max length."""
    figures = source_figures(mixture, tally, max_length)
    kept = [f["kept_weight"] for f in figures]
    return {"sha256": mixture.sha256, "weight_of": mixture.weight_of, "max_repeats": mixture.max_repeats,
            "limiting_source": mixture.sources[limiting_source(kept, mixture.weights)].name if all(kept) else None,
            "sources": figures}


def check_sources(mixture: Mixture, figures: list[dict[str, Any]], max_length: int, allow_short: bool,
                  max_bad_fraction: float) -> tuple[list[str], list[str]]:
    """(problems that fail the job, notes) for one max length: the per-source identity, the
    per-source bad fraction, a source with no usable examples, and shares off by more than
    SHARE_TOLERANCE (a problem unless allow_short)."""
    from prepack.packing.bad_records import too_many_bad_records

    problems, notes = [], []
    for f in figures:
        dropped = sum(f["examples_dropped"].values())
        arrived = f["examples_read"] - f["examples_split"] + f["split_pieces"]
        if arrived != f["examples_unique"] + dropped:
            problems.append(f"L={max_length}: mixture source {f['name']!r}: examples read {f['examples_read']} != "
                            f"unique written {f['examples_unique']} + dropped {dropped}")
        bad = sum(v for k, v in f["examples_dropped"].items() if not _length_reason(k))
        line = too_many_bad_records(bad, f["examples_read"], f["examples_dropped"], max_bad_fraction)
        if line is not None:
            problems.append(f"mixture source {f['name']!r}: {line}")
        if not f["kept_weight"]:
            problems.append(f"mixture source {f['name']!r} has no usable examples at max length {max_length} "
                            f"({f['examples_read']} read, dropped {f['examples_dropped']}); check its input and format")
    if problems:
        return problems, notes
    kept = [f["kept_weight"] for f in figures]
    limit = figures[limiting_source(kept, mixture.weights)]["name"]
    off = [f for f in figures if abs(f["realized_share"] - f["requested_share"]) > SHARE_TOLERANCE]
    if off:
        said = ", ".join(f"{f['name']!r} reached {f['realized_share']:.2%} of {mixture.weight_of} (asked "
                         f"{f['requested_share']:.2%})" for f in off)
        line = (f"L={max_length}: the mix misses its shares by more than {SHARE_TOLERANCE:.1%}: {said}; source "
                f"{limit!r} limits the mix (used {mixture.max_repeats}x, max_repeats)")
        if allow_short:
            notes.append(line + "; published anyway (--allow-short-mix)")
        else:
            problems.append(line + "; add examples or max_repeats, or pass --allow-short-mix")
    return problems, notes


def _length_reason(reason: str) -> bool:
    from prepack.packing.accounting import NOT_BAD_INPUT

    return reason in NOT_BAD_INPUT


def preview(mixture: Mixture, kept_examples: Sequence[int], kept_targets: Sequence[int], max_length: int
            ) -> list[dict[str, Any]]:
    """Preflight's per-source table at one L, before anything is packed: each source's kept
    size, its budget by the share rule, and the share and repeats that budget gives (the job
    meets each budget to within one example, by rank)."""
    kept = list(kept_examples if mixture.weight_of == "examples" else kept_targets)
    out = []
    result = budgets(kept, mixture.weights, mixture.max_repeats)
    total = sum(float(b.budget) for b in result)
    limit = limiting_source(kept, mixture.weights) if all(kept) else None
    for i, (source, b, want) in enumerate(zip(mixture.sources, result, mixture.requested_shares())):
        out.append({"max_length": max_length, "source": source.name, "format": source.format,
                    "weight": weight_json(source.weight), "kept_examples": int(kept_examples[i]),
                    "kept_target_tokens": int(kept_targets[i]), "kept_weight": int(kept[i]),
                    "budget": round(float(b.budget), 3), "requested_share": round(want, 6),
                    "realized_share": round(float(b.budget) / total, 6) if total else 0.0,
                    "repeats": round(float(b.budget) / kept[i], 6) if kept[i] else 0.0,
                    "limiting": i == limit})
    return out
