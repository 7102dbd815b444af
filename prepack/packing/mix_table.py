"""The per-source table of a mixture set, from its manifest's `mixture` object: what each
source asked for and got, how many distinct examples it gave and how many copies were
written, whether it was repeated or down-sampled, and what it lost and why.

One builder (`mix_rows`) and one rendering (`mix_table_lines`), shared by `prepack pack
--mixture` (after the run, per length) and `prepack inspect` on a mixture set, so the two
never disagree. Figures come only from the manifest (prepack/packing/mixture.py writes them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from prepack.packing.accounting import NOT_BAD_INPUT
from prepack.packing.mixture import SHARE_TOLERANCE


@dataclasses.dataclass(frozen=True)
class MixRow:
    name: str
    format: str
    requested_share: float
    realized_share: float
    unique: int  # distinct examples written
    written: int  # copies written (unique + repeated copies)
    repeats: float  # written weight / kept weight: > 1 repeated, < 1 down-sampled
    examples_read: int
    bad_records: int  # dropped for bad input (not for length or sampling)
    dropped: dict[str, int]  # reason -> count, not_sampled included
    granularity: float | None = None  # recorded only when the shares were not met

    @property
    def bad_fraction(self) -> float:
        return self.bad_records / self.examples_read if self.examples_read else 0.0

    @property
    def use(self) -> str:
        """Repeated, down-sampled or used whole, in words a new user reads."""
        if self.repeats > 1:
            return f"repeated {self.repeats:.2f}x"
        if self.repeats < 1:
            return f"down-sampled {self.repeats:.2f}x"
        return "used whole"


def mix_rows(mixture: Mapping[str, Any]) -> list[MixRow]:
    """One row per source, in the file's order (source i is `source_ids` i)."""
    rows = []
    for f in mixture.get("sources", []):
        dropped = {str(k): int(v) for k, v in dict(f.get("examples_dropped", {})).items() if v}
        rows.append(MixRow(
            name=str(f["name"]), format=str(f.get("format", "")),
            requested_share=float(f["requested_share"]), realized_share=float(f["realized_share"]),
            unique=int(f.get("examples_unique", 0)), written=int(f.get("examples_written", 0)),
            repeats=float(f.get("repeats", 0.0)), examples_read=int(f.get("examples_read", 0)),
            bad_records=sum(v for k, v in dropped.items() if k not in NOT_BAD_INPUT), dropped=dropped,
            granularity=float(f["granularity"]) if f.get("granularity") is not None else None))
    return rows


HEADERS = ("source", "format", "asked", "got", "unique", "written", "repeated", "use", "bad", "dropped")


def _cells(row: MixRow) -> list[str]:
    dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(row.dropped.items())) or "-"
    bad = f"{row.bad_records:,} ({row.bad_fraction:.2%})" if row.bad_records else "0"
    return [row.name, row.format, f"{row.requested_share:.2%}", f"{row.realized_share:.2%}", f"{row.unique:,}",
            f"{row.written:,}", f"{row.written - row.unique:,}", row.use, bad, dropped]


def mix_table_lines(mixture: Mapping[str, Any], max_length: int) -> list[str]:
    """The table at one max length: a heading, one line per source, and a line when the
    shares were not met (the granularity of each source: what one of its examples weighs)."""
    rows = mix_rows(mixture)
    limit = mixture.get("limiting_source")
    heading = (f"L{max_length} mix by {mixture.get('weight_of', '?')} (max_repeats {mixture.get('max_repeats', '?')}"
               f"{f'; {limit!r} limits the mix' if limit else ''}):")
    cells = [_cells(r) for r in rows]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(HEADERS)]
    left = {0, 1, 7, 9}  # text columns; numbers are right-aligned

    def line(values: list[str]) -> str:
        return "  ".join(v.ljust(w) if i in left else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))).rstrip()

    out = [heading, "  " + line(list(HEADERS))]
    out += ["  " + line(c) for c in cells]
    if mixture.get("shares_met") is False:
        grains = ", ".join(f"{r.name!r} {r.granularity:.2%}" for r in rows if r.granularity is not None)
        out.append(f"  shares not met within {100 * SHARE_TOLERANCE:g} pp: every example left out is heavier than what is "
                   f"left of its source's budget (one example's share of the mix, on average: {grains})")
    return out
