"""The workers' report to the launcher: the run, length and shard summaries (summary.json).

Written once per run by write.WriteSummaryFn into the run's staging folder, read by the
launcher (job.verify, job_stats.length_stats, the manifests). Frozen dataclasses with
to_json/from_json, as Manifest has, so a key misspelled on one side fails at once.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any


@dataclasses.dataclass(frozen=True)
class ShardSummary:
    """One shard file as AssembleShardFn wrote it (figures read back from its parts)."""

    max_length: int
    index: int
    path: str  # the file name in the length's folder
    num_rows: int
    num_bytes: int
    sha256: str
    rows: int
    segments: int
    tokens: int
    target_tokens: int
    min_segments: int
    max_segments: int
    # A preference set's rejected sides (a pair is one segment above; its chosen side is the rest).
    rejected_tokens: int = 0
    rejected_target_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "ShardSummary":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class PlanSummary:
    """One length's plan, as PlanFn made it."""

    num_rows: int
    num_shards: int
    num_examples: int
    tokens: int
    min_segments: int
    max_segments: int
    bfd_rows: int | None  # BFD's own rows (packed), beside num_rows; None unpacked
    method: str  # what made the rows: "bfd", "exact_fill" or "unpacked" (the manifest's `packing`)
    planner_fallback: str | None = None  # "budget": the exact fill ran past its work budget, BFD made the rows

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "PlanSummary":
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls)})


@dataclasses.dataclass(frozen=True)
class LengthSummary:
    plan: PlanSummary
    shards: tuple[ShardSummary, ...]  # by index
    dead_letter_entries: int

    def to_json(self) -> dict[str, Any]:
        return {"plan": self.plan.to_json(), "shards": [s.to_json() for s in self.shards],
                "dead_letter_entries": self.dead_letter_entries}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "LengthSummary":
        return cls(PlanSummary.from_json(d["plan"]), tuple(ShardSummary.from_json(s) for s in d["shards"]),
                   int(d["dead_letter_entries"]))


@dataclasses.dataclass(frozen=True)
class RunSummary:
    tally: dict[str, Any]  # prepack.packing.accounting.Tally.to_json()
    fingerprints: tuple[tuple, ...]  # (task index, sha256, size, records), by task index
    lengths: dict[int, LengthSummary]

    def to_json(self) -> str:
        return json.dumps({"tally": self.tally, "fingerprints": [list(f) for f in self.fingerprints],
                           "lengths": {str(L): s.to_json() for L, s in sorted(self.lengths.items())}}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "RunSummary":
        d = json.loads(text)
        return cls(d["tally"], tuple(tuple(f) for f in d["fingerprints"]),
                   {int(L): LengthSummary.from_json(s) for L, s in d["lengths"].items()})


@dataclasses.dataclass(frozen=True)
class LengthStats:
    """One length's figures, from the run summary (job_stats.length_stats): what the launcher
    checks and what the manifest records as `stats` (to_json)."""

    records_read: int
    records_filtered: dict[str, int]
    examples_read: int
    examples_written: int
    examples_dropped: dict[str, int]
    examples_truncated: int
    examples_split: int  # examples cut into pieces (--overlong split)
    split_pieces: int  # the pieces they were cut into, each counted as an example from then on
    bad_records: int
    bad_fraction: float
    bfd_rows: int | None  # the rows BFD makes from the same plan input (packed); None: unpacked
    planned_examples: int
    dead_letter_entries: int
    packing: dict[str, Any]  # prepack.packing.stats.PackingStats.as_dict() less max_length and examples
    # A mixture's copies written beyond each example's first (stats.examples_written counts
    # copies); None, and not in the manifest, without a mixture.
    examples_repeated: int | None = None
    # The stop-token check (prepack/text/stop_check.py); None, and not in the manifest, when nothing was found.
    turns_without_trained_eot: int | None = None
    trained_empty_think: int | None = None
    # --overlong window: examples cut into pieces, the pieces (kept or dropped), and the context
    # tokens the written pieces start with; None, and not in the manifest, under the other policies.
    examples_windowed: int | None = None
    window_pieces: int | None = None
    context_tokens_replayed: int | None = None
    # "budget" when --planner best's exact fill ran past its work budget and BFD made the rows;
    # None, and not in the manifest, otherwise.
    planner_fallback: str | None = None
    # A preference set's figures (pairs_read, pairs_written, pairs_dropped by reason, tokens and
    # target tokens per side); None, and not in the manifest, for every other set.
    preference_figures: dict[str, Any] | None = None

    @property
    def rows(self) -> int:
        return int(self.packing["rows"])

    def to_json(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("packing", "preference_figures")}
        for optional in ("examples_repeated", "turns_without_trained_eot", "trained_empty_think", "examples_windowed",
                         "window_pieces", "context_tokens_replayed", "planner_fallback"):
            if d[optional] is None:
                del d[optional]
        return {**d, **(self.preference_figures or {}), **self.packing}


@dataclasses.dataclass(frozen=True)
class TokenFile:
    """One file of the tokenized set, as WriteTokensFn wrote it."""

    path: str
    num_rows: int
    num_bytes: int
    sha256: str
    tokens: int
    target_tokens: int


@dataclasses.dataclass(frozen=True)
class TokenIndex:
    """The tokenized set's index.json (WriteTokenIndexFn): its files and the dropped examples' file."""

    files: tuple[TokenFile, ...]  # by path
    dropped_entries: int
    dropped_name: str

    def to_json(self) -> str:
        return json.dumps({"files": [dataclasses.asdict(f) for f in self.files], "dropped_entries": self.dropped_entries,
                           "dropped_name": self.dropped_name}, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "TokenIndex":
        d = json.loads(text)
        files = tuple(TokenFile(**{f.name: x[f.name] for f in dataclasses.fields(TokenFile)}) for x in d["files"])
        return cls(files, int(d["dropped_entries"]), str(d["dropped_name"]))
