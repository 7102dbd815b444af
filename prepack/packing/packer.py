"""Best-fit-decreasing packing of sequence lengths into rows of a fixed length.

Global BFD over a whole dataset lands within a fraction of a percent of the
lower bound ceil(tokens / L) on SFT length distributions; what loses density
in online packers is the small window, not the heuristic
(docs/benchmarks.md: within 0-0.5 % of the bound on Alpaca, OASST1 and 1M synthetic lengths).

Open rows live in capacity buckets: `rows_by_free[c]` holds the rows with
exactly c free slots, and bit c of an integer bitset says that bucket is
non-empty. The best fit for an item of length n is the lowest set bit at or
above n, one shift and one lowest-bit extraction on an L-bit integer, so the
work per item does not grow with the number of open rows. Planning from a
histogram goes further: equal lengths are placed as a run, one step per row
they touch instead of one per item (`_BestFit.place_run`), and one length at a
time (`HistogramBestFit`), so a caller can hand out a length's slots before the
next is placed: memory grows with rows (C arrays, a few bytes each), not items.
"""

from __future__ import annotations

import array
import dataclasses
import enum
import sys
from collections.abc import Iterator, Mapping, Sequence

import numpy as np

from prepack.packing import exact_fill


class OverlongPolicy(str, enum.Enum):
    DROP = "drop"
    TRUNCATE = "truncate"
    SPLIT = "split"  # cut into pieces of at most L tokens, each its own segment (split_pieces)
    WINDOW = "window"  # pieces as split, each after the first led by its reply's prompt as context (window_pieces)


class Planner(str, enum.Enum):
    """How a max length's rows are planned from its length histogram (`--planner`)."""

    BFD = "bfd"  # best-fit-decreasing
    BEST = "best"  # the fewer rows of BFD and exact fills (prepack.packing.exact_fill); BFD's on a tie


class DropReason(str, enum.Enum):
    """Why an example that was read did not reach a row. Values are manifest keys."""

    TOO_LONG = "too_long"
    NO_TARGETS_AFTER_TRUNCATION = "no_targets_after_truncation"
    NO_TARGETS_AFTER_SPLIT = "no_targets_after_split"  # counts pieces, not examples
    WINDOW_CONTEXT_TOO_LONG = "window_context_too_long"  # counts pieces: context left no room for a target
    NOT_SAMPLED = "not_sampled"  # a mixture's share rule left it out at this max length (prepack/packing/mixture.py)


class Fit(enum.IntEnum):
    """What one example becomes at one max length. One rule (fit_at_length) for the job's fit
    stage, its routing (the decision travels with the example) and preflight."""

    WHOLE = 0
    TRUNCATED = 1  # cut to the max length under --overlong truncate; a target survives
    TOO_LONG = 2  # dropped: longer than the max length under --overlong drop
    NO_TARGETS_AFTER_TRUNCATION = 3  # dropped: cut to the max length, no target survives
    SPLIT = 4  # cut into pieces under --overlong split (split_pieces decides which are kept)
    WINDOW = 5  # cut into pieces under --overlong window (window_pieces decides them)

    @property
    def drop_reason(self) -> DropReason | None:
        return {Fit.TOO_LONG: DropReason.TOO_LONG,
                Fit.NO_TARGETS_AFTER_TRUNCATION: DropReason.NO_TARGETS_AFTER_TRUNCATION}.get(self)


def targets_after_first(lens: np.ndarray, mask: np.ndarray, end: int | None = None) -> np.ndarray:
    """Per example of a ragged batch (lengths `lens`, loss masks concatenated in `mask`): its
    target tokens after its first token, within its first `end` tokens when given. The row
    builder zeroes a segment's first target, so an example with none of these trains nothing
    (whole, or cut to `end` under --overlong truncate)."""
    lens = np.asarray(lens, dtype=np.int64)
    starts = np.cumsum(lens) - lens
    sums = np.concatenate([[0], np.cumsum(mask, dtype=np.int64)])
    first = starts + np.minimum(lens, 1)
    stop = starts + (lens if end is None else np.minimum(lens, end))
    return sums[np.maximum(stop, first)] - sums[first]


def split_pieces(length: int, max_length: int) -> list[tuple[int, int]]:
    """The rule of --overlong split: an example of `length` > max_length tokens becomes the
    pieces [0, L), [L, 2L), ..., the last holding the rest; each is its own segment (positions
    from 0, no earlier context: nothing is repeated), its loss mask the example's own there,
    and, as for every segment, no target on its first token. A piece with no target after its
    first token is dropped (DropReason.NO_TARGETS_AFTER_SPLIT)."""
    return [(start, min(start + max_length, length)) for start in range(0, length, max_length)]


def window_context_tokens(max_length: int, given: int | None = None) -> int:
    """N of --overlong window at one max length: --window-context-tokens when given, else L // 4
    (at least 1: a piece must start on a token that is no target)."""
    return given if given is not None else max(1, max_length // 4)


@dataclasses.dataclass(frozen=True)
class WindowPiece:
    """One piece of --overlong window, in the example's token positions: the context
    [context_start, context_end), loss 0 in the piece, then the body [start, end) with the
    example's own loss mask. `kept` False: the context leaves no room for a target at this
    max length; [start, end) is then the rest of the reply, which no piece trains."""

    context_start: int
    context_end: int
    start: int
    end: int
    kept: bool = True

    @property
    def context_tokens(self) -> int:
        return self.context_end - self.context_start

    @property
    def length(self) -> int:
        return self.context_tokens + self.end - self.start

    def positions(self) -> np.ndarray:
        """The example's token positions the piece holds, in order (int64)."""
        return np.concatenate([np.arange(self.context_start, self.context_end, dtype=np.int64),
                               np.arange(self.start, self.end, dtype=np.int64)])

    def loss_mask(self, mask: np.ndarray) -> np.ndarray:
        """The piece's loss mask from the example's: 0 over the context, the example's over the body."""
        return np.concatenate([np.zeros(self.context_tokens, dtype=mask.dtype), mask[self.start:self.end]])


def window_pieces(mask: np.ndarray, max_length: int, context_tokens: int) -> list[WindowPiece]:
    """The rule of --overlong window for one example longer than `max_length` (L), from its loss
    mask (the fit stage knows tokens and mask only, no turns). A reply is a maximal run of
    targets; its prompt is the maximal loss-0 run just before it: for the first reply the
    system and user turns, under --expand-turns the whole conversation before the reply, for a
    later reply of a multi-turn example only the turn it answers (the user turn and the
    template's markers). Its context is the prompt, or the prompt's last `context_tokens` (N)
    tokens when it is longer. Pieces, in order:
    - the first is [0, L), as under split, when a target lies in [1, L);
    - then, from p, the first target no piece trains yet: the context of p's reply, then the
      example's tokens from p on, as many as fill L (fewer at the example's end). When p's
      reply starts the example (no prompt) the context is the one token before p.
    Every target after the example's first token is a target in exactly one kept piece, and no
    piece's first token is one (the row builder zeroes a segment's first target): the context
    comes first, and it is loss 0. A piece whose context leaves no room for a target (only when
    N >= L) is not kept (DropReason.WINDOW_CONTEXT_TOO_LONG); its reply's remaining targets are
    not trained, and the pieces go on at the next reply. Loss-0 tokens after the last target
    need no piece of their own. Positions restart at 0 in each piece, as for any segment."""
    if max_length < 2 or context_tokens < 1:
        raise ValueError(f"window_pieces: max_length must be at least 2 and context_tokens at least 1, "
                         f"got {max_length} and {context_tokens}")
    target = np.asarray(mask) != 0
    n = len(target)
    every = np.flatnonzero(target)
    targets = every[every >= 1]  # a target on the first token is never trained
    zeros = np.flatnonzero(~target)

    def first_target_from(at: int) -> int | None:
        k = int(np.searchsorted(targets, at))
        return int(targets[k]) if k < len(targets) else None

    pieces: list[WindowPiece] = []
    p = first_target_from(1)
    if p is not None and p < max_length:
        pieces.append(WindowPiece(0, 0, 0, min(max_length, n)))
        p = first_target_from(max_length)
    while p is not None:
        k = int(np.searchsorted(zeros, p))  # zeros[k - 1]: the last loss-0 token before p
        reply = int(zeros[k - 1]) + 1 if k else 0
        if reply == 0:
            context = (p - 1, p)
        else:
            before = int(np.searchsorted(every, reply))  # every[before - 1]: the last target before the prompt
            prompt = int(every[before - 1]) + 1 if before else 0
            context = (max(prompt, reply - context_tokens), reply)
        room = max_length - (context[1] - context[0])
        if room < 1:
            reply_end = int(zeros[k]) if k < len(zeros) else n
            pieces.append(WindowPiece(*context, p, reply_end, kept=False))
            p = first_target_from(reply_end)
            continue
        end = min(p + room, n)
        pieces.append(WindowPiece(*context, p, end))
        p = first_target_from(end)
    return pieces


def piece_id(example_id: str, start: int, end: int, context: tuple[int, int] | None = None) -> str:
    """A piece's identity: its example and token ranges, the same at every max length that cuts
    it there (one piece then serves all of them), distinct from every example id (none ends in
    '#<start>:<end>'; --expand-turns ids end in '#<i>'). A window piece's context, when it does not
    run straight into the body, comes first: '#<context_start>:<context_end>+<start>:<end>'; when
    it does, the piece is the range '#<context_start>:<end>' (its tokens and targets are that
    range's: the context is loss 0 there, or is the piece's first token, whose target the row
    builder zeroes)."""
    if context is None or context[0] == context[1]:
        return f"{example_id}#{start}:{end}"
    if context[1] == start:
        return f"{example_id}#{context[0]}:{end}"
    return f"{example_id}#{context[0]}:{context[1]}+{start}:{end}"


def piece_example_id(piece: str) -> str:
    """The id of the example a piece_id was cut from."""
    return piece[:piece.rindex("#")]


def cut_pieces(mask: np.ndarray, max_length: int, policy: OverlongPolicy,
               window_context: int | None = None) -> list[tuple[WindowPiece, DropReason | None]]:
    """The pieces of one example longer than `max_length` under --overlong split or window
    (split_pieces, window_pieces), each with the reason it is dropped, None when it is kept: the
    one cut the job's fit stage writes and preflight forecasts. A split piece has no context;
    window replays window_context_tokens(max_length, window_context) prompt tokens at most."""
    if policy is OverlongPolicy.SPLIT:
        return [(WindowPiece(a, a, a, b), None if mask[a + 1:b].any() else DropReason.NO_TARGETS_AFTER_SPLIT)
                for a, b in split_pieces(len(mask), max_length)]
    if policy is not OverlongPolicy.WINDOW:
        raise ValueError(f"cut_pieces: --overlong {policy.value} cuts no example into pieces")
    n_context = window_context_tokens(max_length, window_context)
    return [(p, None if p.kept else DropReason.WINDOW_CONTEXT_TOO_LONG)
            for p in window_pieces(mask, max_length, n_context)]


def context_replayed(cut: Sequence[tuple[WindowPiece, DropReason | None]]) -> int:
    """stats.context_tokens_replayed of one cut example: the context tokens its kept pieces start with."""
    return sum(p.context_tokens for p, reason in cut if reason is None)


def fit_at_length(lengths: np.ndarray, max_length: int, policy: OverlongPolicy,
                  targets_within: np.ndarray | None = None) -> np.ndarray:
    """The overlong rule: each example's Fit (int8) at `max_length`. An example that fits is
    WHOLE; a longer one is TOO_LONG under --overlong drop, SPLIT or WINDOW under split or window
    (split_pieces, window_pieces cut it), and under truncate TRUNCATED when a
    target survives after its first token within `max_length` tokens, else
    NO_TARGETS_AFTER_TRUNCATION. `targets_within[i]`: targets_after_first(..., max_length) of
    example i; needed only under truncate when some example is longer."""
    lengths = np.asarray(lengths, dtype=np.int64)
    out = np.full(len(lengths), Fit.WHOLE, dtype=np.int8)
    over = lengths > max_length
    if not over.any():
        return out
    if policy is OverlongPolicy.DROP:
        out[over] = Fit.TOO_LONG
        return out
    if policy is OverlongPolicy.SPLIT:
        out[over] = Fit.SPLIT
        return out
    if policy is OverlongPolicy.WINDOW:
        out[over] = Fit.WINDOW
        return out
    if targets_within is None:
        raise ValueError("fit_at_length: truncating needs each example's targets within the max length")
    out[over] = np.where(np.asarray(targets_within)[over] > 0, Fit.TRUNCATED, Fit.NO_TARGETS_AFTER_TRUNCATION)
    return out


# Rows, positions and run sizes are C ints (array typecode "i", numpy intc, 4 bytes), and a
# row's item count (at most its max length) a C unsigned short where it fits: the BFD state
# is 2 bytes per row for the items per row and 4 per open row in its capacity bucket, rather
# than a Python int object (28 bytes plus a list slot) each.
_C_INT = "i"
MAX_ROWS = 2**31 - 1


def check_max_segments(max_segments: int | None) -> None:
    if max_segments is not None and max_segments < 1:
        raise ValueError(f"max_segments must be at least 1, got {max_segments}")


def _c_ints(values: np.ndarray) -> bytes:
    return np.ascontiguousarray(values, dtype=np.intc).tobytes()


class _BestFit:
    """Incremental best-fit state: place items one at a time, or a run of equal items at once."""

    def __init__(self, max_length: int, max_segments: int | None = None):
        if max_length <= 0:
            raise ValueError(f"max_length must be positive, got {max_length}")
        check_max_segments(max_segments)
        self.max_length = max_length
        # A row never holds more than max_length items, so no cap is the cap max_length: one
        # comparison on every path instead of a branch for "no cap". A row at the cap is closed:
        # it leaves the buckets, whatever room it has left.
        self.cap = min(max_segments or max_length, max_length)
        self.segments = array.array("H" if max_length <= 0xFFFF else _C_INT)  # items placed in each row so far
        self._rows_by_free = [array.array(_C_INT) for _ in range(max_length + 1)]
        self._nonempty = 0

    def _check(self, length: int) -> None:
        if not 0 < length <= self.max_length:
            raise ValueError(f"item length {length} is outside 1..{self.max_length}")

    def _push(self, row: int, free: int) -> None:
        if free:
            self._rows_by_free[free].append(row)
            self._nonempty |= 1 << free

    def place(self, length: int) -> int:
        """Puts an item of `length` into the fullest row it fits; returns the row index."""
        self._check(length)
        fits = self._nonempty >> length
        if fits:
            free = length + (fits & -fits).bit_length() - 1
            bucket = self._rows_by_free[free]
            row = bucket.pop()  # the newest of equally full rows; place_run keeps this tie-break
            if not bucket:
                self._nonempty &= ~(1 << free)
            self.segments[row] += 1
        else:
            free = self.max_length
            row = len(self.segments)
            self.segments.append(1)
        left = free - length
        if left and self.segments[row] < self.cap:
            self._rows_by_free[left].append(row)
            self._nonempty |= 1 << left
        return row

    def place_run(self, length: int, count: int) -> np.ndarray:
        """Places `count` items of `length` exactly as `count` calls of place() would;
        returns (row, position of its first item, items) per row touched, in placement
        order, as an (n, 3) intc array.

        Why a row takes many at once: place() puts an item into the open row with the
        least free space r >= length. Afterwards that row has r - length free, less than
        any other row with room (none had free space in [length, r)), and it is alone in
        its bucket (that bucket was empty), so while r - length >= length the next item
        of the run goes into the same row. A run therefore fills its best-fit row with
        min(count, r // length) items, then the next best row, and so on; the buckets it
        would pass through on the way end empty again, so row order, row contents and
        the final bucket state (order within a bucket included) are item-by-item BFD's.
        The work is per row touched, not per item. Under a segment cap a row takes at most
        cap - items of the run and, once at the cap, leaves the buckets: the next item goes to
        the next best row, as place() would send it.
        """
        placed = array.array(_C_INT)  # row, start, items; three C ints per row touched
        if count <= 0:
            return np.zeros((0, 3), dtype=np.intc)
        self._check(length)
        rows_by_free, segments, nonempty, cap = self._rows_by_free, self.segments, self._nonempty, self.cap
        add = placed.append
        # place() inlined: this loop runs once per row touched, the hot path of planning.
        while count:
            fits = nonempty >> length
            if not fits:
                break
            free = length + (fits & -fits).bit_length() - 1
            bucket = rows_by_free[free]
            row = bucket.pop()  # the same tie-break as place()
            if not bucket:
                nonempty &= ~(1 << free)
            k = min(count, free // length, cap - segments[row])
            add(row)
            add(segments[row])
            add(k)
            segments[row] += k
            left = free - k * length
            if left and segments[row] < cap:
                rows_by_free[left].append(row)
                nonempty |= 1 << left
            count -= k
        self._nonempty = nonempty
        if count:
            self._open_rows(length, count, placed)
        return np.frombuffer(placed, dtype=np.intc).reshape(-1, 3)

    def release_spare(self) -> None:
        """Gives back what emptied buckets still hold: an array never reallocates as it pops, so
        without this a bucket keeps the most rows it ever held. Called once the runs since the
        last call have touched an eighth of the rows, it bounds the buckets by ~4 bytes per open
        row plus ~0.5 per row."""
        empty = sys.getsizeof(array.array(_C_INT))
        for free, bucket in enumerate(self._rows_by_free):
            spare = sys.getsizeof(bucket) - empty - bucket.itemsize * len(bucket)
            if spare > max(4096, bucket.itemsize * len(bucket)):
                self._rows_by_free[free] = array.array(_C_INT, bucket)

    def _open_rows(self, length: int, count: int, placed: array.array) -> None:
        """The rest of a run when no open row fits it: new rows of max_length // length items each.

        A new row that is full for this length keeps less than `length` free, so nothing
        open fits the next item either and it opens the next row: new rows come in index
        order, each pushed to its bucket in that order, the last one with what is left."""
        per_row = min(self.max_length // length, self.cap)
        full, rest = divmod(count, per_row)
        first = len(self.segments)
        if first + full + (1 if rest else 0) > MAX_ROWS:
            raise ValueError(f"the plan at max length {self.max_length} needs more than {MAX_ROWS:,} rows: "
                             "split the input and pack each part on its own")
        rows = np.arange(first, first + full, dtype=np.intc)
        placed.frombytes(_c_ints(np.column_stack([rows, np.zeros(full, np.intc), np.full(full, per_row, np.intc)])))
        self.segments.frombytes(np.full(full, per_row, dtype=np.dtype(self.segments.typecode)).tobytes())
        left = self.max_length - per_row * length
        if left and full and per_row < self.cap:
            self._rows_by_free[left].frombytes(_c_ints(rows))
            self._nonempty |= 1 << left
        if rest:
            row = first + full
            placed.extend((row, 0, rest))
            self.segments.append(rest)
            self._push(row, self.max_length - rest * length)


@dataclasses.dataclass(frozen=True, eq=False)
class ClassRuns:
    """The runs of one length (a class), sorted by row: the class's slots in row order (a row
    holds at most one run per length), each run's slots at consecutive positions. `ends[i]`:
    the slots of runs 0..i. O(rows the class touched), however many slots it has."""

    length: int
    row: np.ndarray  # intc, ascending
    start: np.ndarray  # intc: the position of the run's first slot in its row
    ends: np.ndarray  # int64

    @classmethod
    def of(cls, length: int, placed: np.ndarray) -> "ClassRuns":
        """From place_run's (row, start, items) in placement order."""
        order = np.argsort(placed[:, 0], kind="stable")
        return cls(length, placed[order, 0], placed[order, 1], np.cumsum(placed[order, 2], dtype=np.int64))

    @property
    def num_slots(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def slots(self, first: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Rows and positions (int32) of the class's slots first, ..., stop - 1: only the runs
        that hold them are expanded."""
        if not 0 <= first <= stop <= self.num_slots:
            raise ValueError(f"slots {first}..{stop} are outside the {self.num_slots} slots of length {self.length}")
        if first == stop:
            return np.zeros(0, np.int32), np.zeros(0, np.int32)
        a = int(np.searchsorted(self.ends, first, side="right"))
        b = int(np.searchsorted(self.ends, stop - 1, side="right")) + 1
        ends = self.ends[a:b]
        begins = np.concatenate([self.ends[a - 1:a] if a else np.zeros(1, np.int64), ends[:-1]])
        taken = np.minimum(ends, stop) - np.maximum(begins, first)
        rows = np.repeat(self.row[a:b], taken).astype(np.int32)
        positions = (np.repeat(self.start[a:b] - begins, taken) + np.arange(first, stop)).astype(np.int32)
        return rows, positions


class HistogramBestFit:
    """BFD over a length histogram, streamed by length: `classes()` places one length at a
    time, longest first, and yields its ClassRuns before it places the next, so a caller can
    hand out a length's slots and drop them. The state kept across lengths is O(rows):
    about 8 bytes per row (items per row, open rows by free space)."""

    def __init__(self, histogram: Mapping[int, int], max_length: int, release_after: int = 1 << 16,
                 max_segments: int | None = None):
        self.histogram = histogram
        self._packer = _BestFit(max_length, max_segments)
        # Rows the runs touch between two passes that give the buckets' spare room back (at
        # least; an eighth of the rows when that is more): a pass visits every bucket.
        self.release_after = release_after

    def classes(self) -> Iterator[ClassRuns]:
        pushed = 0  # rows touched since the buckets' spare room was last given back
        for length in sorted(self.histogram, reverse=True):
            placed = self._packer.place_run(length, self.histogram[length])
            pushed += len(placed)
            if pushed > max(self.release_after, self.num_rows // 8):
                self._packer.release_spare()
                pushed = 0
            if len(placed):
                runs = ClassRuns.of(length, placed)
                del placed  # while the caller hands the class out, only its runs by row are held
                yield runs

    @property
    def num_rows(self) -> int:
        return len(self._packer.segments)

    def _segments_view(self) -> np.ndarray:
        # Shares the array's buffer: the array cannot grow while the view lives.
        segments = self._packer.segments
        return np.frombuffer(segments, dtype=np.dtype(segments.typecode)) if len(segments) else np.zeros(0, np.intc)

    @property
    def segments(self) -> np.ndarray:
        """Items per row (a copy), final once classes() is exhausted."""
        return self._segments_view().copy()

    def segment_range(self) -> tuple[int, int]:
        """(fewest, most) items in a row, (0, 0) without rows; reads the state in place, no copy."""
        view = self._segments_view()
        return (int(view.min()), int(view.max())) if len(view) else (0, 0)


class HistogramPlan:
    """One max length's plan from its length histogram, streamed by length like
    HistogramBestFit (`classes()`: each length's ClassRuns, longest first, one at a time), under
    either planner and an optional cap on items per row.

    `bfd_rows` is always BFD's own row count. Under Planner.BEST, BFD is run first for its row
    count only (its state, ~8 bytes per row, is freed), then the exact fill within its work
    budget; the fill's rows are used only when fewer than BFD's, and otherwise (a tie, or the
    budget spent) BFD is run again and streamed, so `best` never has more rows than BFD and
    its result does not depend on the machine. The fill's state is its patterns, O(distinct
    lengths), however many rows they cover."""

    def __init__(self, histogram: Mapping[int, int], max_length: int, planner: Planner = Planner.BEST,
                 max_segments: int | None = None, budget: int | None = None):
        check_max_segments(max_segments)
        self.histogram = {int(n): int(c) for n, c in histogram.items() if c > 0}
        self.max_length, self.planner, self.max_segments = max_length, Planner(planner), max_segments
        self.fill: exact_fill.PatternPlan | None = None
        self.fill_rows: int | None = None  # the fill's rows, also when BFD's were kept
        self.bfd_rows: int | None = None
        self.budget_exhausted = False  # the fill ran past its work budget, so BFD made the rows
        self._bfd: HistogramBestFit | None = None
        if self.planner is Planner.BEST:
            self.bfd_rows = _bfd_row_count(self.histogram, max_length, max_segments)
        if self.planner is Planner.BEST and self.histogram:
            try:
                fill = exact_fill.plan_exact_fill(self.histogram, max_length, max_segments,
                                                  exact_fill.DEFAULT_BUDGET_CELLS if budget is None else budget)
            except exact_fill.BudgetExhausted:
                fill = None
                self.budget_exhausted = True
            self.fill_rows = fill.num_rows if fill is not None else None
            if fill is not None and fill.num_rows < self.bfd_rows:
                self.fill = fill
        if self.fill is None:
            self._bfd = HistogramBestFit(self.histogram, max_length, max_segments=max_segments)

    @property
    def method(self) -> str:
        """What made the rows: "exact_fill" or "bfd"."""
        return "exact_fill" if self.fill is not None else "bfd"

    def classes(self) -> Iterator[ClassRuns]:
        if self.fill is None:
            yield from self._bfd.classes()
            self.bfd_rows = self._bfd.num_rows
            return
        for length, row, start, items in self.fill.class_runs():
            yield ClassRuns(length, row.astype(np.intc), start.astype(np.intc), np.cumsum(items, dtype=np.int64))

    @property
    def num_rows(self) -> int:
        """Final once classes() is exhausted (under BFD, rows so far)."""
        return self.fill.num_rows if self.fill is not None else self._bfd.num_rows

    def segment_range(self) -> tuple[int, int]:
        return self.fill.segment_range() if self.fill is not None else self._bfd.segment_range()

    def rows(self) -> list[list[int]]:
        """Rows as lists of lengths (small plans: tests and benchmarks); exhausts classes()."""
        slots: dict[int, list[tuple[int, int, int]]] = {}
        for runs in self.classes():
            rows, positions = runs.slots(0, runs.num_slots)
            for r, p in zip(rows.tolist(), positions.tolist()):
                slots.setdefault(r, []).append((p, runs.length))
        return [[n for _, n in sorted(slots[r])] for r in range(self.num_rows)]


def _bfd_row_count(histogram: Mapping[int, int], max_length: int, max_segments: int | None) -> int:
    bfd = HistogramBestFit(histogram, max_length, max_segments=max_segments)
    for _ in bfd.classes():  # each length's runs are dropped as they come: only the BFD state is held
        pass
    return bfd.num_rows
