"""The job's accounting: what happened to every record read, in one typed structure.

The pipeline's stages count into a `Tally` (bundles merge theirs), the launcher checks
and publishes from it, and the manifest's `stats.examples_dropped` (reason -> count) is
derived from it; the report classifies those reasons with the sets below. An example read
is written at a max length L, or dropped there for exactly one reason:
- bad input (`bad_records`: the reader's or template's reason, such as malformed_json or
  missing_field; `bad_examples`: the chat format refused the conversation), at every L;
- `no_targets`: no target token after its first, at every L;
- a DropReason at L (too_long, no_targets_after_truncation): the overlong rule.
Under --overlong split an example longer than L is cut into pieces at L (`split` counts the
examples, `split_pieces` the pieces); each piece is written or dropped as
no_targets_after_split, so per L: examples_read - split + split_pieces == written + dropped.
Under --overlong window likewise (`windowed` the examples, `window_pieces` the pieces, each
written or dropped as window_context_too_long; `context_replayed` the context tokens the
written pieces start with): examples_read - windowed + window_pieces == written + dropped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import numpy as np

from prepack.packing.packer import DropReason

NO_TARGETS = "no_targets"
# Drop reasons that depend on the max length, and those that are not bad input.
LENGTH_REASONS = frozenset(reason.value for reason in DropReason)
NOT_BAD_INPUT = LENGTH_REASONS | {NO_TARGETS}


def arrival_problem(read: int, written: int, dropped: int, split: int = 0, pieces: int = 0, windowed: int = 0,
                    window_pieces: int = 0, repeated: int = 0) -> str | None:
    """The accounting identity of one max length, the one statement of it (the job checks it before
    publishing, `prepack verify` on every published set): every example read arrives at L once,
    a cut one as its pieces, a mixture's repeated copy once more, and each arrival is written or
    dropped. None when `read - split + pieces - windowed + window_pieces + repeated == written +
    dropped`; else the sum that does not add up."""
    if read - split + pieces - windowed + window_pieces + repeated == written + dropped:
        return None
    return (f"examples read {read} (- split {split} + pieces {pieces}"
            f"{f' - windowed {windowed} + window pieces {window_pieces}' if windowed or window_pieces else ''}"
            f"{f' + repeats {repeated}' if repeated else ''}) != written {written} + dropped {dropped}")


@dataclasses.dataclass
class Tally:
    records_read: int = 0  # raw records (lines, rows, messages)
    examples: int = 0  # examples the templates produced
    bad_records: Counter = dataclasses.field(default_factory=Counter)  # reason -> records
    bad_examples: Counter = dataclasses.field(default_factory=Counter)  # reason -> examples the chat format refused
    filtered: Counter = dataclasses.field(default_factory=Counter)  # reason -> oasst1 messages left out by design
    no_targets: int = 0  # examples with no target after their first token
    truncated: Counter = dataclasses.field(default_factory=Counter)  # max length -> examples cut to it
    dropped: Counter = dataclasses.field(default_factory=Counter)  # (max length, DropReason) -> examples
    split: Counter = dataclasses.field(default_factory=Counter)  # max length -> examples cut into pieces
    split_pieces: Counter = dataclasses.field(default_factory=Counter)  # max length -> pieces they were cut into
    windowed: Counter = dataclasses.field(default_factory=Counter)  # max length -> examples cut under --overlong window
    window_pieces: Counter = dataclasses.field(default_factory=Counter)  # max length -> their pieces, kept or dropped
    context_replayed: Counter = dataclasses.field(default_factory=Counter)  # max length -> context tokens of kept pieces
    # Mixtures (prepack/packing/mixture.py): max length -> copies written beyond each example's first
    # (so per L: examples_read - split + split_pieces + repeated == written + dropped), and the
    # sampling's figures per L: kept weight before sampling, written weight, unique examples
    # written, tokens and target tokens written.
    repeated: Counter = dataclasses.field(default_factory=Counter)
    mix: Counter = dataclasses.field(default_factory=Counter)  # (max length, figure) -> value
    sources: dict = dataclasses.field(default_factory=dict)  # source index (1..N) -> its own Tally
    # The stop-token check (prepack/text/stop_check.py): target turns whose end-of-turn token is
    # not trained, trained empty think blocks, and the smallest example id of each (for the message).
    turns_without_trained_eot: int = 0
    untrained_eot_example: str = ""
    trained_empty_think: int = 0
    empty_think_example: str = ""

    def merge(self, other: "Tally") -> "Tally":
        self.records_read += other.records_read
        self.examples += other.examples
        self.no_targets += other.no_targets
        for mine, theirs in ((self.bad_records, other.bad_records), (self.bad_examples, other.bad_examples),
                             (self.filtered, other.filtered), (self.truncated, other.truncated),
                             (self.dropped, other.dropped), (self.split, other.split),
                             (self.split_pieces, other.split_pieces), (self.windowed, other.windowed),
                             (self.window_pieces, other.window_pieces), (self.context_replayed, other.context_replayed),
                             (self.repeated, other.repeated), (self.mix, other.mix)):
            mine.update(theirs)
        for index, theirs in other.sources.items():
            self.sources.setdefault(index, Tally()).merge(theirs)
        self.turns_without_trained_eot += other.turns_without_trained_eot
        self.trained_empty_think += other.trained_empty_think
        self.untrained_eot_example = _first_id(self.untrained_eot_example, other.untrained_eot_example)
        self.empty_think_example = _first_id(self.empty_think_example, other.empty_think_example)
        return self

    def clear_per_length(self) -> "Tally":
        """Only the counts that do not depend on the max length are left (here and in each
        source's): what a tokenized set stores, and what packing it again starts from; the fit
        and mix stages count the rest again at each max length (--overlong split's and window's
        pieces included)."""
        for t in (self, *self.sources.values()):
            for per_length in (t.truncated, t.dropped, t.split, t.split_pieces, t.windowed, t.window_pieces,
                               t.context_replayed, t.repeated, t.mix):
                per_length.clear()
        return self

    def add_stop_findings(self, untrained_eot: Any, empty_think: Any, example_ids: list[str]) -> None:
        """Counts one batch's stop-token findings (per-example counts, aligned with example_ids)."""
        for i in np.flatnonzero(untrained_eot).tolist():
            self.turns_without_trained_eot += int(untrained_eot[i])
            self.untrained_eot_example = _first_id(self.untrained_eot_example, example_ids[i])
        for i in np.flatnonzero(empty_think).tolist():
            self.trained_empty_think += int(empty_think[i])
            self.empty_think_example = _first_id(self.empty_think_example, example_ids[i])

    def for_source(self, index: int) -> "Tally":
        """This tally counted under one mixture source too: the set's figures are the sum of the sources'."""
        inner = Tally().merge(self)
        inner.sources = {}
        self.sources = {index: inner}
        return self

    @property
    def bad(self) -> int:
        """Bad input: records and examples dropped for what they hold, at every max length."""
        return sum(self.bad_records.values()) + sum(self.bad_examples.values())

    @property
    def examples_read(self) -> int:
        """Examples the templates produced, plus records that could not become one."""
        return self.examples + sum(self.bad_records.values())

    def examples_dropped(self, max_length: int) -> dict[str, int]:
        """The manifest's stats.examples_dropped at one max length: reason -> count."""
        out: Counter = Counter(self.bad_records)
        out.update(self.bad_examples)
        if self.no_targets:
            out[NO_TARGETS] += self.no_targets
        for (L, reason), n in self.dropped.items():
            if L == max_length:
                out[DropReason(reason).value] += n
        return dict(sorted(out.items()))

    def to_json(self) -> dict[str, Any]:
        lengths = sorted({L for L in self.truncated} | {L for L, _ in self.dropped} | set(self.split)
                         | set(self.windowed) | set(self.repeated) | {L for L, _ in self.mix})
        out = {
            "records_read": self.records_read,
            "examples": self.examples,
            "bad_records": dict(sorted(self.bad_records.items())),
            "bad_examples": dict(sorted(self.bad_examples.items())),
            "filtered": dict(sorted(self.filtered.items())),
            "no_targets": self.no_targets,
            "per_length": {str(L): {"truncated": self.truncated.get(L, 0),
                                    "split": self.split.get(L, 0), "split_pieces": self.split_pieces.get(L, 0),
                                    "dropped": {DropReason(r).value: n for (m, r), n in sorted(self.dropped.items()) if m == L},
                                    # Only under --overlong window, so other runs' records stay as they were.
                                    **({"windowed": self.windowed[L], "window_pieces": self.window_pieces.get(L, 0),
                                        "context_replayed": self.context_replayed.get(L, 0)}
                                       if self.windowed.get(L) else {}),
                                    **({"repeated": self.repeated.get(L, 0),
                                        "mix": {k: v for (m, k), v in sorted(self.mix.items()) if m == L}}
                                       if self.repeated.get(L) or any(m == L for m, _ in self.mix) else {})}
                           for L in lengths},
        }
        if self.sources:
            out["sources"] = {str(i): t.to_json() for i, t in sorted(self.sources.items())}
        # Only when found, so the record of a clean run stays as it was before the check existed.
        if self.turns_without_trained_eot:
            out["turns_without_trained_eot"] = self.turns_without_trained_eot
            out["untrained_eot_example"] = self.untrained_eot_example
        if self.trained_empty_think:
            out["trained_empty_think"] = self.trained_empty_think
            out["empty_think_example"] = self.empty_think_example
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Tally":
        tally = cls(records_read=data["records_read"], examples=data["examples"], no_targets=data["no_targets"],
                    bad_records=Counter(data["bad_records"]), bad_examples=Counter(data["bad_examples"]),
                    filtered=Counter(data["filtered"]))
        for L, per in data["per_length"].items():
            if per["truncated"]:
                tally.truncated[int(L)] = per["truncated"]
            if per.get("split"):
                tally.split[int(L)] = per["split"]
                tally.split_pieces[int(L)] = per["split_pieces"]
            if per.get("windowed"):
                tally.windowed[int(L)] = per["windowed"]
                tally.window_pieces[int(L)] = per["window_pieces"]
                tally.context_replayed[int(L)] = per["context_replayed"]
            for reason, n in per["dropped"].items():
                tally.dropped[(int(L), DropReason(reason))] = n
            if per.get("repeated"):
                tally.repeated[int(L)] = per["repeated"]
            for key, n in per.get("mix", {}).items():
                tally.mix[(int(L), key)] = n
        tally.sources = {int(i): cls.from_json(t) for i, t in data.get("sources", {}).items()}
        tally.turns_without_trained_eot = int(data.get("turns_without_trained_eot", 0))
        tally.untrained_eot_example = str(data.get("untrained_eot_example", ""))
        tally.trained_empty_think = int(data.get("trained_empty_think", 0))
        tally.empty_think_example = str(data.get("empty_think_example", ""))
        return tally


def _first_id(mine: str, theirs: str) -> str:
    """The smaller of two example ids, '' meaning none: the same one whatever the bundle order."""
    return min(i for i in (mine, theirs) if i) if (mine or theirs) else ""
