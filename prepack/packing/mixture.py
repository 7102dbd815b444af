"""Dataset mixtures: the mixture file (`prepack pack --mixture FILE`) and the share rule.

The file (YAML, or JSON, which YAML reads too):

    weight_of: target_tokens        # or: examples
    max_repeats: 4                  # default 1: no source is upsampled
    sources:
      - name: alpaca                # [a-z0-9_-]+, unique
        input: data/alpaca.jsonl    # a spec or a list of specs, as --input takes
        format: alpaca              # plus the format's options: source_lang, target_lang, prompt_format,
                                    # columns: {instruction: question}, roles: {assistant: bot} (as --columns, --roles)
        weight: 3

Relative input paths are relative to the file's folder, local or gs:// (`_resolve`; the file is
read through the storage interface by prepack/mixture_file.py). The file is hostile input, checked
before any work (one line naming the file, the source and the field): at most MAX_FILE_BYTES,
no YAML anchors or aliases, no duplicate keys, at most 32 levels deep (prepack/hostile_input/strict_yaml.py);
weights an int, a float or a decimal string from 1e-9 to 1e12; max_repeats 1 to 1,000; format
options strings. A tokenized set's recorded mixture (`--from-tokens`) takes the same checks. Sources are numbered 1..N in
file order; 0 is padding in a row's `source_ids`.

The share rule (one implementation: `budgets`, then `partial_pick`), per max length L:
source i keeps K_i (examples, or target tokens, at L) and asks for share s_i = w_i / sum(w).
The output total is T = min_i(max_repeats * K_i / s_i): the scarcest source relative to its
weight sets it, and none is used more than max_repeats times. Source i's budget B_i = T * s_i
(exact rationals) is met by c_i = floor(B_i / K_i) whole copies of the source, then by one more
copy of examples in rank order (rank: stable hash, ties by example id), each taken when it still
fits in what is left of the rest r_i = B_i - c_i * K_i: the rank cut (the longest prefix that
fits), then the next-ranked examples that still fit (the partial pick). When whole examples
cannot bring every share within SHARE_TOLERANCE, the closest mix is published and the manifest
says so (`shares_met: false`, each source's `granularity`); only scarcity fails the job.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import posixpath
import re
from collections.abc import Iterable, Sequence
from fractions import Fraction
from typing import Any

# At most this many sources in a set (source_ids 1..MAX_SOURCES in its rows): the trainer's
# per-source loss sums are fixed-size vectors of this length + 1.
MAX_SOURCES = 64
WEIGHT_OF = ("target_tokens", "examples")
TOP_KEYS = frozenset({"weight_of", "max_repeats", "sources"})
SOURCE_KEYS = frozenset({"name", "input", "format", "weight"})
FORMAT_OPTIONS = frozenset({"source_lang", "target_lang", "prompt_format", "columns", "roles"})
# The options a file writes as a mapping (canonical name: record's name), as --columns/--roles take them;
# a source records them in their canonical text, `name=value,...` sorted (prepack/text/formats/fields.py).
MAPPING_OPTIONS = frozenset({"columns", "roles"})
NAME_PATTERN = re.compile(r"[a-z0-9_-]+")
# Formats that template whole tables (oasst1 groups messages by tree before templating):
# a mixture reads per record, so these are refused there (use their per-record export, `chat`).
TABLE_FORMATS = frozenset({"oasst1"})
# Realized shares must be within this of the requested ones (fractions of 1).
SHARE_TOLERANCE = 0.005
# A source is used at most this many times (max_repeats): 10^6 of a 100-example source runs for minutes.
MAX_REPEATS = 1000
# Weights: a plain int or float, or a decimal string of this form, within these bounds.
DECIMAL_WEIGHT = re.compile(r"[0-9]{1,18}(\.[0-9]{1,18})?([eE][+-]?[0-9]{1,2})?")
MIN_WEIGHT, MAX_WEIGHT = Fraction(1, 10**9), Fraction(10**12)
# A mixture file is read only up to this size (checked before parsing).
MAX_FILE_BYTES = 1 << 20
# Bounds of the text fields: names and format names, format options, input specs, specs per source.
MAX_NAME_CHARS, MAX_OPTION_CHARS, MAX_SPEC_CHARS, MAX_SPECS = 64, 200, 4096, 10_000
MAX_MAPPING_CHARS = 64 * (2 * MAX_OPTION_CHARS + 2)  # a mapping's text: at most 64 pairs of two names
# What a tokenized set records of its mixture (`Mixture.describe()`).
RECORD_KEYS = frozenset({"sha256", "weight_of", "max_repeats", "sources"})
RECORD_SOURCE_KEYS = frozenset({"name", "inputs", "format", "options", "weight"})
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

    @classmethod
    def single(cls, inputs: Sequence[str], fmt: str, options: Iterable[tuple[str, str]] = ()) -> "Mixture":
        """A plain `--input/--format` run: one source of weight 1, each example written once."""
        return cls("", "", "examples", 1, (MixtureSource(1, fmt or "input", tuple(inputs), fmt, Fraction(1),
                                                         tuple(sorted(options))),))

    @property
    def recorded(self) -> bool:
        """Whether the sets record this mixture: a mixture file's, or a tokenized set's record of
        one. Their rows carry each token's source (row formats 2 and 4) and their manifests the
        `mixture` object; a plain run's one source is not recorded, so its sets keep the plain
        formats and their bytes. The one rule every "is this a mixture set" question reads."""
        return bool(self.sha256)

    def naming(self, source: int) -> str:
        """How a message names source `source` (1..N) before what is wrong with it: a recorded
        mixture's by name; a plain run's one source is the run's --input, named by the message."""
        return f"mixture source {self.sources[source - 1].name!r}: " if self.recorded else ""

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
    def from_description(cls, d: Any, where: str = "the recorded mixture") -> "Mixture":
        """The mixture a tokenized set recorded (`describe()`), to pack it again as it was; checked
        as a file is (`validate_recorded`), since a copied set's manifest is anyone's to edit."""
        return validate_recorded(d, where)


def weight_json(weight: Fraction) -> int | float:
    return int(weight) if weight.denominator == 1 else float(weight)


def parse_mixture(data: bytes, path: str) -> Mixture:
    """The mixture in a file's bytes, validated (the checks of `_source`, shared with
    `validate_recorded`); raises MixtureError with one line naming the file, source and field."""
    from prepack.hostile_input import strict_yaml

    where = f"mixture file {path}"
    if len(data) > MAX_FILE_BYTES:
        raise MixtureError(f"{where}: larger than {MAX_FILE_BYTES:,} bytes; a mixture file names its sources' "
                           "inputs, it does not hold data")
    try:
        doc = strict_yaml.load(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise MixtureError(f"{where}: not UTF-8 text") from None
    except strict_yaml.StrictYamlError as e:
        raise MixtureError(f"{where}: {e}") from None
    if not isinstance(doc, dict):
        raise MixtureError(f"{where}: must be a mapping with keys {', '.join(sorted(TOP_KEYS))}, got {_got(doc)}")
    _known_keys(doc, TOP_KEYS, where)
    weight_of = _weight_of(doc.get("weight_of", "target_tokens"), where)
    max_repeats = _max_repeats(doc.get("max_repeats", 1), where)
    base = _folder_of(path)
    sources: list[MixtureSource] = []
    for i, entry in enumerate(_source_list(doc.get("sources"), where), start=1):
        at = f"{where}: source {i}"
        if not isinstance(entry, dict):
            raise MixtureError(f"{at}: must be a mapping with name, input, format and weight, got {_got(entry)}")
        _known_keys(entry, SOURCE_KEYS | FORMAT_OPTIONS, at)
        name = _name(entry.get("name"), at, sources)
        at = f"{where}: source {name!r}"
        for key in ("input", "format", "weight"):
            if key not in entry:
                raise MixtureError(f"{at}: missing key {key!r}")
        specs = [entry["input"]] if isinstance(entry["input"], str) else entry["input"]
        options = {k: (_mapping_text(v, k, at) if k in MAPPING_OPTIONS else v) for k, v in entry.items() if k in FORMAT_OPTIONS}
        sources.append(_source(i, name, _specs(specs, at, "input"), entry["format"], entry["weight"], options, at, base))
    _one_kind(sources, where)
    return Mixture(_absolute(path), hashlib.sha256(data).hexdigest(), weight_of, max_repeats, tuple(sources))


def _one_kind(sources: Sequence[MixtureSource], where: str) -> None:
    """Preference pairs (format `preference`: rows of two-sided units) and single examples do not
    share a set: the sources are all one or all the other."""
    from prepack.text.formats import template_class

    kinds = {s.name: template_class(s.format).yields_preference for s in sources}
    if len(set(kinds.values())) > 1:
        pairs = sorted(n for n, k in kinds.items() if k)
        others = sorted(n for n, k in kinds.items() if not k)
        raise MixtureError(f"{where}: sources {pairs} are preference pairs and {others} are not; a set holds one kind "
                           "(pack them apart)")


def validate_recorded(d: Any, where: str) -> Mixture:
    """The mixture a tokenized set records (`Mixture.describe()`), checked field by field with
    the file's checks: weights, max_repeats, names, formats and options as a file must have them."""
    if not isinstance(d, dict):
        raise MixtureError(f"{where}: must be an object with keys {', '.join(sorted(RECORD_KEYS))}, got {_got(d)}")
    _known_keys(d, RECORD_KEYS, where)
    for key in sorted(RECORD_KEYS):
        if key not in d:
            raise MixtureError(f"{where}: missing key {key!r}")
    if not isinstance(d["sha256"], str) or not re.fullmatch(r"[0-9a-f]{64}", d["sha256"]):
        raise MixtureError(f"{where}: sha256 must be 64 lowercase hex digits, got {_got(d['sha256'])}")
    weight_of, max_repeats = _weight_of(d["weight_of"], where), _max_repeats(d["max_repeats"], where)
    sources: list[MixtureSource] = []
    for i, entry in enumerate(_source_list(d["sources"], where), start=1):
        at = f"{where}: source {i}"
        if not isinstance(entry, dict):
            raise MixtureError(f"{at}: must be an object with keys {', '.join(sorted(RECORD_SOURCE_KEYS))}, "
                               f"got {_got(entry)}")
        _known_keys(entry, RECORD_SOURCE_KEYS, at)
        name = _name(entry.get("name"), at, sources)
        at = f"{where}: source {name!r}"
        for key in sorted(RECORD_SOURCE_KEYS):
            if key not in entry:
                raise MixtureError(f"{at}: missing key {key!r}")
        if not isinstance(entry["inputs"], list):
            raise MixtureError(f"{at}: inputs must be a list of specs, got {_got(entry['inputs'])}")
        if not isinstance(entry["options"], dict):
            raise MixtureError(f"{at}: options must be an object, got {_got(entry['options'])}")
        _known_keys(entry["options"], FORMAT_OPTIONS, f"{at}: options")
        sources.append(_source(i, name, _specs(entry["inputs"], at, "inputs"), entry["format"], entry["weight"],
                               entry["options"], at, None))
    return Mixture("", d["sha256"], weight_of, max_repeats, tuple(sources))


def _got(value: Any) -> str:
    """A value in a message: its kind and a length-capped form, never its whole repr."""
    from prepack.hostile_input.strict_yaml import LongNumber
    from prepack.hostile_input.untrusted import shown_with_type

    return repr(value) if isinstance(value, LongNumber) else shown_with_type(value)


def _known_keys(mapping: dict[Any, Any], allowed: frozenset[str], at: str) -> None:
    from prepack.hostile_input.untrusted import shown

    unknown = sorted((k for k in mapping if k not in allowed), key=lambda k: shown(k))
    if unknown:
        raise MixtureError(f"{at}: unknown key {shown(unknown[0], 40)}; expected {', '.join(sorted(allowed))}")


def _weight_of(value: Any, where: str) -> str:
    if not isinstance(value, str) or value not in WEIGHT_OF:
        raise MixtureError(f"{where}: weight_of must be target_tokens or examples, got {_got(value)}")
    return value


def _max_repeats(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_REPEATS:
        raise MixtureError(f"{where}: max_repeats must be a whole number from 1 to {MAX_REPEATS:,}, got {_got(value)}")
    return value


def _source_list(value: Any, where: str) -> list[Any]:
    if not isinstance(value, list) or not value:
        raise MixtureError(f"{where}: sources must be a non-empty list of sources, got {_got(value)}")
    if len(value) > MAX_SOURCES:
        raise MixtureError(f"{where}: {len(value)} sources, at most {MAX_SOURCES}")
    return value


def _name(value: Any, at: str, earlier: Sequence[MixtureSource]) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS or not NAME_PATTERN.fullmatch(value):
        raise MixtureError(f"{at}: name {_got(value)} is malformed; use up to {MAX_NAME_CHARS} lowercase letters, "
                           "digits, '_' and '-'")
    if any(s.name == value for s in earlier):
        raise MixtureError(f"{at}: duplicate name {value!r}; names must be unique")
    return value


def _specs(value: Any, at: str, field: str) -> list[str]:
    if (not isinstance(value, list) or not value or len(value) > MAX_SPECS
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_SPEC_CHARS for s in value)):
        raise MixtureError(f"{at}: {field} must be a spec or a list of 1 to {MAX_SPECS:,} specs of at most "
                           f"{MAX_SPEC_CHARS:,} characters, got {_got(value)}")
    return value


def _source(index: int, name: str, specs: list[str], fmt: Any, weight: Any, options: dict[Any, Any], at: str,
            base: str | None) -> MixtureSource:
    """One source's checks, for a file's source and a recorded one alike (`base` None: the
    recorded inputs were resolved when the file was read)."""
    if not isinstance(fmt, str) or not 0 < len(fmt) <= MAX_NAME_CHARS:
        raise MixtureError(f"{at}: format must be a format name, got {_got(fmt)}")
    if fmt in TABLE_FORMATS:
        raise MixtureError(f"{at}: format {fmt!r} templates whole tables and cannot be mixed; "
                           "use its per-record export (format chat)")
    for key, value in options.items():
        bound = MAX_MAPPING_CHARS if key in MAPPING_OPTIONS else MAX_OPTION_CHARS
        if not isinstance(value, str) or not 0 < len(value) <= bound:
            raise MixtureError(f"{at}: {key} must be a string of 1 to {bound} characters (quote it), "
                               f"got {_got(value)}")
    try:
        from prepack.text.formats import ResolvedFormat

        ResolvedFormat.checked(fmt, options)
    except (ValueError, TypeError) as e:
        raise MixtureError(f"{at}: {e}") from None
    inputs = tuple(specs) if base is None else tuple(_resolve(s, base) for s in specs)
    return MixtureSource(index, name, inputs, fmt, _weight(weight, at), tuple(sorted(options.items())))


def _mapping_text(value: Any, key: str, at: str) -> str:
    """A file's `columns:` or `roles:` mapping (canonical name: the record's name) as its text."""
    from prepack.text.formats.fields import MAX_PAIRS, mapping_text

    if not isinstance(value, dict) or not value or len(value) > MAX_PAIRS:
        raise MixtureError(f"{at}: {key} must be a mapping of 1 to {MAX_PAIRS} names (e.g. {key}: "
                           f"{{{'messages: dialog' if key == 'columns' else 'assistant: bot'}}}), got {_got(value)}")
    for name, given in value.items():
        for part in (name, given):
            if not isinstance(part, str) or not 0 < len(part) <= MAX_OPTION_CHARS or "," in part or "=" in part:
                raise MixtureError(f"{at}: {key} names must be strings of 1 to {MAX_OPTION_CHARS} characters without "
                                   f"',' or '=', got {_got(part)}")
    return mapping_text(value.items())


def _weight(value: Any, at: str) -> Fraction:
    """A positive, finite weight from MIN_WEIGHT to MAX_WEIGHT: an int, a float or a decimal
    string (DECIMAL_WEIGHT; never an exponent that builds a 10^100,000,000 numerator)."""
    rule = (f"weight must be a positive number from {float(MIN_WEIGHT):g} to {float(MAX_WEIGHT):g} "
            "(an int, a float or a decimal string)")
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise MixtureError(f"{at}: {rule}, got {_got(value)}")
    if isinstance(value, str) and not DECIMAL_WEIGHT.fullmatch(value):
        raise MixtureError(f"{at}: {rule}, got {_got(value)}")
    if isinstance(value, float) and not math.isfinite(value) or isinstance(value, int) and value.bit_length() > 64:
        raise MixtureError(f"{at}: {rule}, got {_got(value)}")
    weight = Fraction(str(value))
    if not MIN_WEIGHT <= weight <= MAX_WEIGHT:
        raise MixtureError(f"{at}: {rule}, got {_got(value)}")
    return weight


def _absolute(path: str) -> str:
    return path if _is_url(path) else os.path.abspath(path)


def _folder_of(path: str) -> str:
    return path.rsplit("/", 1)[0] if _is_url(path) else os.path.dirname(os.path.abspath(path))


def _is_url(spec: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+]*:", spec) is not None


def _resolve(spec: str, base: str) -> str:
    """A relative path joined to the mixture file's folder (an absolute local one, or a URL's
    such as gs://BUCKET/dir) and normalised ('.' and '..' taken out, never above the folder's
    root: / or the bucket); URLs, hf:, tfds: and absolute paths as they are."""
    if _is_url(spec) or os.path.isabs(spec):
        return spec
    root, folder = _root_and_folder(base)
    return root + posixpath.normpath(posixpath.join(folder, spec))


def _root_and_folder(base: str) -> tuple[str, str]:
    """('gs://BUCKET', '/dir') of a URL folder, ('', '/abs/dir') of a local one: the rest of
    the join is one rule for both."""
    if not _is_url(base):
        return "", base
    scheme, _, rest = base.partition("://")
    host, _, folder = rest.partition("/")
    return f"{scheme}://{host}", "/" + folder


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


def partial_pick(weights_in_rank_order: Iterable[int], rest: Fraction) -> tuple[list[int], int]:
    """(positions taken, their weight): in rank order, each example that still fits in what is
    left of rest. The first one left out is the rank cut; those taken after it fill what the
    cut leaves (one chat example can be 1.7% of a small mix: a cut alone misses by that)."""
    taken: list[int] = []
    weight = 0
    for at, w in enumerate(weights_in_rank_order):
        if weight + w <= rest:
            taken.append(at)
            weight += w
    return taken, weight


def fill_bound(left: Fraction, weight_of: str, max_length: int) -> int:
    """The largest weight an example past a source's rank-cut bucket can have and still be
    picked: at most what is left there, and under the first example the cut leaves out, which
    weighs at most one example's most (1, or the L - 1 targets after a row's first token)."""
    heaviest = 1 if weight_of == "examples" else max_length - 1
    return max(0, min(math.floor(left), heaviest - 1))


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
            # Only when the set windowed an example at this L (--overlong window), so other mixtures' manifests stay as they were.
            **({"examples_windowed": t.windowed.get(max_length, 0), "window_pieces": t.window_pieces.get(max_length, 0)}
               if tally.windowed.get(max_length) else {}),
            "kept_weight": kept,
            "written_weight": w,
            "repeats": round(w / kept, 6) if kept else 0.0,
            "tokens": t.mix.get((max_length, "tokens"), 0),
            "target_tokens": t.mix.get((max_length, "target_tokens"), 0),
        })
    return out


def recorded_choices(mixture: Mixture) -> dict[str, Any]:
    """What a tokenized set's choices record of the mixture (its description); nothing for a plain run."""
    return {"mixture": mixture.describe()} if mixture.recorded else {}


def recorded_templates(mixture: Mixture) -> dict[str, Any]:
    """What a shard set's `template` records of the mixture (each source's); nothing for a plain run."""
    if not mixture.recorded:
        return {}
    return {"sources": {s.name: {"name": s.format, "options": dict(s.options)} for s in mixture.sources}}


def mixture_manifest(mixture: Mixture, tally: Any, max_length: int) -> dict[str, Any] | None:
    """The manifest's top-level `mixture` object at one max length; None for a plain run's."""
    if not mixture.recorded:
        return None
    figures = source_figures(mixture, tally, max_length)
    kept = [f["kept_weight"] for f in figures]
    out = {"sha256": mixture.sha256, "weight_of": mixture.weight_of, "max_repeats": mixture.max_repeats,
           "limiting_source": mixture.sources[limiting_source(kept, mixture.weights)].name if all(kept) else None,
           "sources": figures}
    # Only when missed, so the manifests of mixes that meet their shares stay as they were.
    if shares_off(figures):
        out["shares_met"] = False
        total = sum(f["written_weight"] for f in figures)
        for f in figures:
            f["granularity"] = granularity(f, total)
    return out


def shares_off(figures: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sources whose realized share misses the requested one by more than SHARE_TOLERANCE."""
    return [f for f in figures if abs(f["realized_share"] - f["requested_share"]) > SHARE_TOLERANCE]


def granularity(figures: dict[str, Any], total_written: int) -> float:
    """The share of the mix one of the source's examples weighs, on average (its kept weight
    per kept example, over the mix's written weight): how finely whole examples can tune it."""
    kept_examples = figures["examples_unique"] + figures["examples_dropped"].get("not_sampled", 0)
    if not kept_examples or not total_written:
        return 0.0
    return round(figures["kept_weight"] / kept_examples / total_written, 6)


def check_sources(mixture: Mixture, figures: list[dict[str, Any]], max_length: int, allow_short: bool,
                  max_bad_fraction: float) -> tuple[list[str], list[str]]:
    """(problems that fail the job, notes) for one max length: the per-source identity, the
    per-source bad fraction, a source with no usable examples, and shares off by more than
    SHARE_TOLERANCE (a problem unless allow_short)."""
    problems, notes = [], []
    for f in figures:
        problem = source_accounting_problem(f)
        if problem:
            problems.append(f"L={max_length}: {problem}")
        line = source_bad_records(f, max_bad_fraction)
        if line is not None:
            problems.append(line)
        if not f["kept_weight"]:
            problems.append(f"mixture source {f['name']!r} has no usable examples at max length {max_length} "
                            f"({f['examples_read']} read, dropped {f['examples_dropped']}); check its input and format")
    if problems:
        return problems, notes
    off = shares_off(figures)
    if not off:
        return problems, notes
    said = ", ".join(f"{f['name']!r} reached {f['realized_share']:.2%} of {mixture.weight_of} (asked "
                     f"{f['requested_share']:.2%})" for f in off)
    line = f"L={max_length}: the mix misses its shares by more than {SHARE_TOLERANCE:.1%}: {said}"
    # Scarcity: a source short of its share has given all it may (max_repeats copies of everything
    # kept), or the source that limits the mix is so small that another gets no example at all.
    scarce = [f for f in off if f["realized_share"] < f["requested_share"]
              and f["written_weight"] >= mixture.max_repeats * f["kept_weight"]]
    starved = [f for f in figures if not f["written_weight"]]
    if scarce or starved:
        name = scarce[0]["name"] if scarce else figures[limiting_source([f["kept_weight"] for f in figures], mixture.weights)]["name"]
        line += (f"; source {name!r} limits the mix (used {mixture.max_repeats}x, max_repeats, "
                 + ("and has nothing more to give)" if scarce else f"too few for {starved[0]['name']!r} to get one example)"))
        if allow_short:
            notes.append(line + "; published anyway (--allow-short-mix)")
        else:
            problems.append(line + f"; add examples to {name!r} or raise max_repeats, or pass --allow-short-mix")
        return problems, notes
    total = sum(f["written_weight"] for f in figures)
    grains = ", ".join(f"{f['name']!r} {granularity(f, total):.2%}" for f in figures)
    notes.append(f"{line}; every example left out is heavier than what is left of its source's budget (one example's "
                 f"share of the mix, on average: {grains}); published the closest mix (manifest mixture.shares_met false)")
    return problems, notes


def source_accounting_problem(figures: dict[str, Any]) -> str | None:
    """One source's accounting identity (the job checks it before publishing, `prepack verify` on
    every published mixture set): each example read arrives once, a cut one as its pieces, and is
    written (its first copy: `examples_unique`) or dropped; None when it holds."""
    dropped = sum(figures["examples_dropped"].values())
    arrived = (figures["examples_read"] - figures["examples_split"] + figures["split_pieces"]
               - figures.get("examples_windowed", 0) + figures.get("window_pieces", 0))
    if arrived == figures["examples_unique"] + dropped:
        return None
    return (f"mixture source {figures['name']!r}: examples read {figures['examples_read']} (- split "
            f"{figures['examples_split']} + pieces {figures['split_pieces']}) != unique written "
            f"{figures['examples_unique']} + dropped {dropped}")


def stated_figures_problem(stated: dict[str, Any]) -> str | None:
    """A set's `mixture` object against itself: the shares, repeats, limiting source and (a missed
    mix's) granularity each source states, recomputed by this module's rules from the weights and
    weights kept and written it also states (`prepack verify`; the rows recount the rest). None
    when every one holds, else the first that does not; MixtureError for a weight no file has."""
    _weight_of(stated.get("weight_of"), "mixture")
    max_repeats = _max_repeats(stated.get("max_repeats"), "mixture")
    sources = stated["sources"]
    weights = [_weight(f.get("weight"), f"mixture.sources[{k}] ({f.get('name')})") for k, f in enumerate(sources)]
    kept = [f["kept_weight"] for f in sources]
    written = [f["written_weight"] for f in sources]
    total = sum(weights)
    for k, (f, want, got) in enumerate(zip(sources, weights, realized_shares(written))):
        at = f"mixture.sources[{k}] ({f['name']})"
        for key, expected in (("requested_share", round(float(want / total), 6)), ("realized_share", round(got, 6)),
                              ("repeats", round(f["written_weight"] / f["kept_weight"], 6) if f["kept_weight"] else 0.0)):
            if f.get(key) != expected:
                return f"{at}.{key} is {f.get(key)!r}, but its weights give {expected!r}"
        if f["written_weight"] > max_repeats * f["kept_weight"]:
            return (f"{at}.written_weight {f['written_weight']:,} is more than max_repeats {max_repeats} x its kept_weight "
                    f"{f['kept_weight']:,}")
    limiting = sources[limiting_source(kept, weights)]["name"] if all(kept) else None
    if stated.get("limiting_source") != limiting:
        return f"mixture.limiting_source is {stated.get('limiting_source')!r}, but the kept weights make it {limiting!r}"
    off = shares_off(sources)
    if ("shares_met" in stated) != bool(off) or stated.get("shares_met", False) is not False:
        return (f"mixture.shares_met is {stated.get('shares_met', '(absent)')!r}, but the realized shares "
                f"{'miss' if off else 'meet'} the requested ones (within {SHARE_TOLERANCE:.1%})")
    for k, f in enumerate(sources if off else ()):
        if f.get("granularity") != granularity(f, sum(written)):
            return f"mixture.sources[{k}].granularity ({f['name']}) is {f.get('granularity')!r}, but its figures give {granularity(f, sum(written))!r}"
    return None


def source_problems(mixture: Mixture, tally: Any, max_length: int, allow_short: bool, max_bad_fraction: float
                    ) -> tuple[list[str], list[str]]:
    """`check_sources` on the job's tally at one max length. A plain run's one source is the
    run itself, which the run's own checks judge: nothing is said of it here."""
    if not mixture.recorded:
        return [], []
    return check_sources(mixture, source_figures(mixture, tally, max_length), max_length, allow_short, max_bad_fraction)


def first_bad_source(mixture: Mixture, tally: Any, max_length: int, max_bad_fraction: float) -> str | None:
    """The first recorded source whose own bad-record fraction is over max_bad_fraction, in one
    line (`source_bad_records`); None for a plain run (the run's own fraction is its source's)."""
    if not mixture.recorded:
        return None
    figures = source_figures(mixture, tally, max_length)
    return next((line for f in figures if (line := source_bad_records(f, max_bad_fraction)) is not None), None)


def source_bad_records(figures: dict[str, Any], max_bad_fraction: float) -> str | None:
    """One source's bad-record fraction judged by itself (`--max-bad-fraction` applies to each
    source, so a source in the wrong format is named, not averaged into the mix): the one line
    saying so, or None. A source whose every record is bad is most likely in another format."""
    from prepack.packing.bad_records import too_many_bad_records

    bad = sum(v for k, v in figures["examples_dropped"].items() if not _length_reason(k))
    line = too_many_bad_records(bad, figures["examples_read"], figures["examples_dropped"], max_bad_fraction)
    if line is None:
        return None
    name, fmt = figures["name"], figures["format"]
    advice = (f"every record of {name!r} is bad: check that its input is in format {fmt!r}" if bad == figures["examples_read"]
              else f"fix the records of {name!r}, or raise --max-bad-fraction to skip them")
    return f"mixture source {name!r} (format {fmt}): {line}; {advice}"


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
