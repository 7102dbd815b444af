"""One max length's overlong rule over a batch of examples: the one composition of fit_at_length
(what each example becomes) and cut_pieces (the pieces of those cut under --overlong split or
window) that the job's fit stage runs on every batch and `prepack preflight` runs on a dataset,
with the counts both report (a manifest's stats, preflight's columns)."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import numpy as np

from prepack.packing.packer import (DropReason, Fit, OverlongPolicy, WindowPiece, context_replayed, cut_pieces,
                                    fit_at_length, targets_after_first)

Cut = list[tuple[WindowPiece, DropReason | None]]


@dataclasses.dataclass
class LengthFit:
    """The examples given, at one max length: each one's Fit and, for those cut into pieces,
    their pieces with the reason each is dropped (None: kept)."""

    max_length: int
    policy: OverlongPolicy
    fit: np.ndarray  # Fit (int8) per example, in the order given
    cuts: dict[int, Cut]  # position of a SPLIT or WINDOW example -> its pieces
    targets_within: np.ndarray | None  # under truncate: a TRUNCATED example's targets as it lands in a row

    @property
    def kept(self) -> np.ndarray:
        """The examples that reach a row whole or truncated."""
        return self.fit <= Fit.TRUNCATED

    @property
    def truncated(self) -> int:
        return int(np.count_nonzero(self.fit == Fit.TRUNCATED))

    def dropped_whole(self) -> list[tuple[int, DropReason]]:
        """(position, reason) of each example dropped whole (too long, or no target left)."""
        gone = np.flatnonzero((self.fit > Fit.TRUNCATED) & (self.fit < Fit.SPLIT))
        return [(int(j), Fit(int(self.fit[j])).drop_reason) for j in gone]

    def counts(self) -> "FitCounts":
        dropped = Counter(reason.value for _, reason in self.dropped_whole())
        pieces = replayed = 0
        for cut in self.cuts.values():
            pieces += len(cut)
            replayed += context_replayed(cut)
            dropped.update(reason.value for _, reason in cut if reason is not None)
        cut_examples = len(self.cuts)
        window = self.policy is OverlongPolicy.WINDOW
        return FitCounts(self.truncated, dict(dropped),
                         split=0 if window else cut_examples, split_pieces=0 if window else pieces,
                         windowed=cut_examples if window else 0, window_pieces=pieces if window else 0,
                         context_replayed=replayed)


@dataclasses.dataclass(frozen=True)
class FitCounts:
    """What one max length's rule did, as a manifest's stats name it (stats.examples_truncated,
    examples_dropped by reason (pieces for the piece reasons), examples_split, split_pieces,
    examples_windowed, window_pieces, context_tokens_replayed)."""

    truncated: int
    dropped: dict[str, int]
    split: int = 0
    split_pieces: int = 0
    windowed: int = 0
    window_pieces: int = 0
    context_replayed: int = 0


def fit_length(lengths: np.ndarray, mask_of: Callable[[int], np.ndarray], max_length: int, policy: OverlongPolicy,
               window_context: int | None = None, targets_within: np.ndarray | None = None) -> LengthFit:
    """The rule at `max_length` for examples of these lengths. `mask_of(j)`: example j's loss mask,
    asked only of the examples longer than max_length. `targets_within`: each example's
    targets_after_first within max_length, when the caller has it for the whole batch; under
    truncate it is otherwise counted from mask_of for the longer examples."""
    lengths = np.asarray(lengths, dtype=np.int64)
    over = np.flatnonzero(lengths > max_length)
    if policy is OverlongPolicy.TRUNCATE and targets_within is None and len(over):
        targets_within = np.zeros(len(lengths), np.int64)
        masks = [np.asarray(mask_of(int(j))) for j in over]
        targets_within[over] = targets_after_first(lengths[over], np.concatenate(masks), max_length)
    fit = fit_at_length(lengths, max_length, policy, targets_within)
    cuts = {int(j): cut_pieces(np.asarray(mask_of(int(j))), max_length, policy, window_context)
            for j in np.flatnonzero(fit >= Fit.SPLIT)}
    return LengthFit(max_length, policy, fit, cuts, targets_within)
