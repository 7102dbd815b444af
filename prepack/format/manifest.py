"""manifest.json: the file that makes a shard set exist.

The job writes it last, after every shard is in place, so a reader that finds
a manifest finds complete shards. Keys listed in STABLE_KEYS are a public
contract for users' tooling (docs/manifest.md); others may grow.
I/O is left to callers (through prepack/storage, the one storage interface),
so this module only turns manifests to and from text.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from prepack.format import rowformat
from prepack.format.layout import DEAD_LETTER_NAME, MANIFEST_NAME  # noqa: F401  (named once, in the layout; also imported from here)
from prepack.hostile_input import untrusted

STABLE_KEYS = (
    "format_version",
    "max_length",
    "num_rows",
    "shards",
    "tokenizer",
    "stats.examples_read",
    "stats.examples_written",
    "stats.examples_dropped",
    "stats.examples_truncated",
    "stats.tokens",
    "stats.target_tokens",
    "stats.lower_bound_rows",
    "stats.packed_density",
    "stats.unpacked_density",
)

# Keys that legitimately differ between two runs over the same inputs.
VOLATILE_KEYS = ("created_at",)


class ManifestError(ValueError):
    """A manifest that is missing, malformed, or does not match what the reader expects."""


# The most pieces a tokenizer may have: a larger `vocab_size` is no tokenizer's (the largest in
# use hold about 10^6; ids are stored as int32), and a tiny model sized by it would ask for its
# embedding (10^9 rows of 64: 238 GiB).
MAX_VOCAB_SIZE = 1 << 24
EDITED = "the manifest was edited or does not describe these shards"
# The stats a reader takes as counts (docs/manifest.md: counts are integers), when present.
STATS_COUNTS = ("records_read", "examples_read", "examples_written", "examples_truncated", "tokens", "target_tokens",
                "lower_bound_rows", "bad_records")


def tokenizer_facts_problem(tok: dict[str, Any], where: str, vocab_required: bool = False) -> str | None:
    """The tokenizer identity's numbers, one line if one is wrong: `vocab_size` an integer from 2 to
    MAX_VOCAB_SIZE ("262144", 262144.0 and 10^9 are none), the bos, eos and pad ids and every
    special id integers inside it. Readers refuse a manifest that breaks this (Manifest.from_json);
    `prepack verify` also requires the vocabulary size (recount.tokenizer_problem)."""
    vocab = tok.get("vocab_size")
    if (vocab is not None or vocab_required) and (not _is_int(vocab) or not 2 <= vocab <= MAX_VOCAB_SIZE):
        return (f"{where}: tokenizer.vocab_size is {_shown(vocab)}, not a vocabulary size (an integer from 2 to "
                f"{MAX_VOCAB_SIZE:,}); {EDITED}")
    top = vocab if vocab is not None else MAX_VOCAB_SIZE
    ids = {key: tok.get(key) for key in ("bos_id", "eos_id", "pad_id")}
    specials = tok.get("special_ids")
    if specials is not None and not isinstance(specials, dict):
        return f"{where}: tokenizer.special_ids is {untrusted.shown_with_type(specials)}, not an object of name -> id; {EDITED}"
    ids.update({f"special_ids[{name!r}]": value for name, value in (specials or {}).items()})
    for key, value in ids.items():
        if value is not None and (not _is_int(value) or not 0 <= value < top):
            return f"{where}: tokenizer.{key} is {_shown(value)}, outside the vocabulary (0 to {top - 1:,}); {EDITED}"
    return None


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return repr(value) if value == value and abs(value) != float("inf") else str(value)
    return str(value) if _is_int(value) and value.bit_length() <= 200 else untrusted.shown(value)


@dataclasses.dataclass(frozen=True)
class ShardInfo:
    path: str  # relative to the manifest's folder
    num_rows: int
    num_bytes: int
    sha256: str


@dataclasses.dataclass
class Manifest:
    max_length: int
    num_rows: int
    shards: list[ShardInfo]
    tokenizer: dict[str, Any]
    stats: dict[str, Any]
    packing: str = "bfd"
    template: dict[str, Any] = dataclasses.field(default_factory=dict)
    inputs: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    tool: dict[str, Any] = dataclasses.field(default_factory=dict)
    dead_letter: str | None = None
    created_at: str | None = None
    # Where the examples came from when not from the inputs: {"from_tokens": the tokenized set, ...}.
    lineage: dict[str, Any] | None = None
    # A mixture's sources and shares (prepack/packing/mixture.py: mixture_manifest); absent without one.
    mixture: dict[str, Any] | None = None
    format_version: int = rowformat.FORMAT_VERSION
    fields: dict[str, str] = dataclasses.field(default_factory=rowformat.field_spec)
    # The record's field names in order: what readers decode by (`fields` is key-sorted JSON).
    field_order: list[str] = dataclasses.field(default_factory=lambda: list(rowformat.FIELD_NAMES))
    array_record_options: str = "group_size:1,zstd:3"

    def use_row_format(self, sources: bool, example_targets: bool, preference: bool = False) -> None:
        """The row format of rows with `source_ids` (a mixture's: 2) and/or `example_targets`
        (--overlong split or window: 3, or 4 with both); format 1 has neither; a preference set's
        rows have `pair_side` (5, or 6 with `source_ids`)."""
        self.format_version = rowformat.row_format_version(sources, example_targets, preference)
        self.fields = rowformat.field_spec(self.format_version)
        self.field_order = list(rowformat.field_names(self.format_version))

    def to_json(self) -> str:
        data = dataclasses.asdict(self)
        if data["mixture"] is None:  # sets without a mixture keep their bytes
            del data["mixture"]
        return json.dumps(data, indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "manifest.json") -> "Manifest":
        """The manifest, every field checked (prepack.hostile_input.untrusted): anything a stranger could
        have written is refused with one ManifestError line naming `source` and the field."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise ManifestError(f"{source}: not valid JSON ({e})") from None
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expected a JSON object")
        version = data.get("format_version")
        if type(version) is not int or version not in rowformat.SUPPORTED_VERSIONS:
            raise ManifestError(
                f"{source}: format_version {version!r} is not supported by this reader "
                f"(supports {', '.join(map(str, rowformat.SUPPORTED_VERSIONS))}); regenerate the shards or upgrade tunix-prepack"
            )
        missing = [k for k in ("max_length", "num_rows", "shards", "tokenizer", "stats") if k not in data]
        if missing:
            raise ManifestError(f"{source}: missing keys {missing}")
        kwargs = _checked_fields(data, source)
        shards = [ShardInfo(**s) for s in untrusted.shard_entries(data["shards"], source, ManifestError)]
        manifest = cls(shards=shards, **kwargs)
        if sum(s.num_rows for s in shards) != manifest.num_rows:
            raise ManifestError(f"{source}: shard row counts add up to {sum(s.num_rows for s in shards)}, not num_rows {manifest.num_rows}")
        if manifest.fields != rowformat.field_spec(version):
            raise ManifestError(f"{source}: fields {manifest.fields} differ from this reader's {rowformat.field_spec(version)} "
                                f"for format_version {version}")
        if rowformat.has_sources(version) != (data.get("mixture") is not None):
            raise ManifestError(f"{source}: format_version {version} {'needs' if rowformat.has_sources(version) else 'excludes'} "
                                "a `mixture` object (row formats 2, 4 and 6 are for mixture sets only)")
        try:  # a manifest written before field_order existed gets format 1's order, the default
            rowformat.check_field_order(manifest.field_order, version)
        except rowformat.RowFormatError as e:
            raise ManifestError(f"{source}: {e}") from None
        return manifest

    def check_compatible(
        self, expected_max_length: int | None = None, tokenizer: dict[str, Any] | None = None, source: str = "manifest.json"
    ) -> None:
        """Raises ManifestError if the shards were made for another max length or tokenizer."""
        if expected_max_length is not None and self.max_length != expected_max_length:
            raise ManifestError(
                f"{source}: shards were packed for max_length {self.max_length}, but {expected_max_length} was expected; "
                f"regenerate them with `prepack pack --max-length {expected_max_length}`"
            )
        if tokenizer is not None:
            for key in ("vocab_size", "vocab_hash", "bos_id", "eos_id", "pad_id"):
                if key in tokenizer and tokenizer[key] != self.tokenizer.get(key):
                    raise ManifestError(
                        f"{source}: tokenizer {key} is {self.tokenizer.get(key)!r} in the shards "
                        f"({self.tokenizer.get('name')!r}) but {tokenizer[key]!r} in the trainer's tokenizer "
                        f"({tokenizer.get('name')!r})"
                    )


def _checked_fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The manifest's fields other than `shards`, each of the type the reader relies on."""
    E = ManifestError
    checks = {
        "max_length": lambda v, f: untrusted.count(v, source, f, E, low=2, high=rowformat.MAX_MAX_LENGTH),
        "num_rows": lambda v, f: untrusted.count(v, source, f, E),
        "tokenizer": lambda v, f: _checked_tokenizer(v, source),
        "stats": lambda v, f: _checked_stats(v, source),
        "packing": lambda v, f: untrusted.text(v, source, f, E),
        "template": lambda v, f: untrusted.mapping(v, source, f, E),
        "inputs": lambda v, f: untrusted.sequence(v, source, f, E),
        "options": lambda v, f: untrusted.mapping(v, source, f, E),
        "tool": lambda v, f: untrusted.mapping(v, source, f, E),
        "dead_letter": lambda v, f: None if v is None else untrusted.file_name(v, source, f, E),
        "created_at": lambda v, f: untrusted.text(v, source, f, E, optional=True),
        "lineage": lambda v, f: untrusted.mapping(v, source, f, E, optional=True),
        "format_version": lambda v, f: v,
        "fields": lambda v, f: untrusted.mapping(v, source, f, E),
        "field_order": lambda v, f: untrusted.sequence(v, source, f, E),
        "array_record_options": lambda v, f: untrusted.text(v, source, f, E),
        "mixture": lambda v, f: _checked_mixture(v, source),
    }
    return {k: checks[k](v, k) for k, v in data.items() if k in checks}


def _checked_tokenizer(value: Any, source: str) -> dict[str, Any]:
    tok = untrusted.mapping(value, source, "tokenizer", ManifestError)
    problem = tokenizer_facts_problem(tok, source)
    if problem:
        raise ManifestError(problem)
    return tok


def _checked_stats(value: Any, source: str) -> dict[str, Any]:
    """The stats a reader counts with are integers (a "262144" or 262144.0 is refused, not converted)."""
    E = ManifestError
    stats = untrusted.mapping(value, source, "stats", E)
    for key in STATS_COUNTS:
        if key in stats:
            untrusted.count(stats[key], source, f"stats.{key}", E)
    if "examples_dropped" in stats:
        for reason, n in untrusted.mapping(stats["examples_dropped"], source, "stats.examples_dropped", E).items():
            untrusted.count(n, source, f"stats.examples_dropped[{untrusted.shown(reason)}]", E)
    return stats


def _checked_mixture(value: Any, source: str) -> dict[str, Any] | None:
    """The `mixture` object, as far as readers use it: `sources` a list of objects, each named."""
    E = ManifestError
    checked = untrusted.mapping(value, source, "mixture", E, optional=True)
    for k, entry in enumerate(untrusted.sequence(checked.get("sources"), source, "mixture.sources", E) if checked else ()):
        untrusted.mapping(entry, source, f"mixture.sources[{k}]", E)
        untrusted.text(entry.get("name"), source, f"mixture.sources[{k}].name", E)
    return checked


def without_volatile(text: str) -> dict[str, Any]:
    """The manifest with run-specific keys removed, for determinism checks."""
    data = json.loads(text)
    for key in VOLATILE_KEYS:
        data.pop(key, None)
    return data


UNPACKED_MODES = ("none", "unpacked", "no-pack", "nopack", "one-per-row", "one_per_row")


def packing_kind(manifest: Any) -> str:
    """'packed' or 'unpacked' (one example per row): the metrics', the trainer's and the report's one reading."""
    mode = str(getattr(manifest, "packing", "") or "").lower()
    if mode in UNPACKED_MODES:
        return "unpacked"
    # Older sets recorded no packing mode for --no-pack; one example per row tells them apart.
    stats = getattr(manifest, "stats", {}) or {}
    if stats.get("examples_written") is not None and stats.get("examples_written") == manifest.num_rows:
        return "unpacked"
    return "packed"
