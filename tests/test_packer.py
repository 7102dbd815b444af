"""Packer properties: every item in exactly one row, capacity respected, BFD row counts."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prepack.packing import packer
from prepack.packing.packer import DropReason, Fit, OverlongPolicy
from testkit import plans
from testkit.reference import pack_unpacked, slots_by_length

lengths_and_limit = st.integers(1, 200).flatmap(
    lambda L: st.tuples(st.lists(st.integers(1, L), min_size=0, max_size=300), st.just(L))
)


def reference_bfd_rows(lengths, max_length):
    """Textbook BFD: scan every open row for the tightest fit. Quadratic, obviously right."""
    free = []
    for n in sorted(lengths, reverse=True):
        fitting = [i for i, f in enumerate(free) if f >= n]
        if fitting:
            best = min(fitting, key=lambda i: free[i])
            free[best] -= n
        else:
            free.append(max_length - n)
    return len(free)


@settings(max_examples=300, deadline=None)
@given(lengths_and_limit)
def test_every_item_lands_in_exactly_one_row_within_capacity(case):
    lengths, max_length = case
    rows = plans.pack_best_fit_decreasing(lengths, max_length)
    placed = sorted(i for row in rows for i in row)
    assert placed == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= max_length for row in rows)
    assert all(row for row in rows)
    assert len(rows) >= math.ceil(sum(lengths) / max_length)


@settings(max_examples=300, deadline=None)
@given(lengths_and_limit)
# Worst-fit decreasing needs one row more here than best fit: keeps the test able to fail.
@example(([16, 45, 39, 26, 45, 3, 24, 10, 33, 11, 36, 2, 28, 31, 2, 12, 10, 29, 13, 31, 34, 10, 4, 24, 45, 14, 37,
           13, 1, 37, 2, 10, 11], 45))
def test_row_count_equals_textbook_bfd_and_histogram_plan(case):
    lengths, max_length = case
    rows = plans.pack_best_fit_decreasing(lengths, max_length)
    assert len(rows) == reference_bfd_rows(lengths, max_length)
    histogram = {}
    for n in lengths:
        histogram[n] = histogram.get(n, 0) + 1
    plan = plans.plan_from_histogram(histogram, max_length)
    assert len(plan) == len(rows)
    assert sorted(n for row in plan for n in row) == sorted(lengths)
    # The plan and the index packing are the same packing, seen through lengths.
    assert [sorted(lengths[i] for i in row) for row in rows] == [sorted(row) for row in plan]


@settings(max_examples=100, deadline=None)
@given(lengths_and_limit)
def test_slots_cover_the_plan_once(case):
    lengths, max_length = case
    histogram = {}
    for n in lengths:
        histogram[n] = histogram.get(n, 0) + 1
    plan = plans.plan_from_histogram(histogram, max_length)
    slots = slots_by_length(plan)
    assert {n: len(s) for n, s in slots.items()} == histogram
    seen = {(s.row, s.position) for ss in slots.values() for s in ss}
    assert len(seen) == len(lengths)
    for n, ss in slots.items():
        assert all(plan[s.row][s.position] == n for s in ss)


def test_row_count_equals_textbook_bfd_on_a_seeded_sweep():
    rng = np.random.default_rng(0)
    for _ in range(1000):
        max_length = int(rng.integers(2, 50))
        lengths = rng.integers(1, max_length + 1, int(rng.integers(1, 40))).tolist()
        assert len(plans.pack_best_fit_decreasing(lengths, max_length)) == reference_bfd_rows(lengths, max_length)


def test_packing_is_deterministic_and_order_insensitive_in_row_count():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 512, 5000).tolist()
    a = plans.pack_best_fit_decreasing(lengths, 512)
    b = plans.pack_best_fit_decreasing(lengths, 512)
    assert a == b
    shuffled = list(rng.permutation(lengths))
    assert len(plans.pack_best_fit_decreasing(shuffled, 512)) == len(a)


def test_near_lower_bound_on_sft_like_lengths():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(4.4, 0.9, 20000).astype(int), 4, 2048).tolist()
    for max_length in (512, 1024, 2048):
        fitting = [n for n in lengths if n <= max_length]
        rows = plans.pack_best_fit_decreasing(fitting, max_length)
        bound = math.ceil(sum(fitting) / max_length)
        assert len(rows) <= bound * 1.01, (max_length, len(rows), bound)
        assert plans.first_fit_in_pools(fitting, max_length, pool_rows=16) >= len(rows)


def test_unpacked_is_one_item_per_row_and_rejects_overlong():
    assert pack_unpacked([3, 1, 2], 4) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="item 1 has length 5, outside 1..4"):
        pack_unpacked([3, 5], 4)


def test_bad_lengths_are_rejected():
    with pytest.raises(ValueError, match="item length 9 is outside 1..8"):
        plans.pack_best_fit_decreasing([3, 9], 8)
    with pytest.raises(ValueError, match="item length 0 is outside"):
        plans.plan_from_histogram({0: 2}, 8)
    with pytest.raises(ValueError, match="max_length must be positive"):
        plans.pack_best_fit_decreasing([1], 0)


def test_overlong_rule_by_hand():
    # Four examples (lengths 10, 10, 6, 3); the masks' targets after the first token within
    # L=8: 2, 0 (its targets start at token 9), 1, 1.
    masks = [[0] * 6 + [1] * 4, [0] * 8 + [1] * 2, [0, 0, 0, 0, 0, 1], [1, 0, 1]]
    lens, flat = np.array([len(m) for m in masks]), np.concatenate(masks)
    within = packer.targets_after_first(lens, flat, 8)
    assert within.tolist() == [2, 0, 1, 1]
    assert packer.targets_after_first(lens, flat).tolist() == [4, 2, 1, 1]
    assert packer.fit_at_length(lens, 10, OverlongPolicy.DROP).tolist() == [Fit.WHOLE] * 4
    assert packer.fit_at_length(lens, 8, OverlongPolicy.DROP).tolist() == [Fit.TOO_LONG, Fit.TOO_LONG, Fit.WHOLE, Fit.WHOLE]
    # Truncation that leaves no target (past the first token) is a drop, not an empty example.
    assert packer.fit_at_length(lens, 8, OverlongPolicy.TRUNCATE, within).tolist() == [
        Fit.TRUNCATED, Fit.NO_TARGETS_AFTER_TRUNCATION, Fit.WHOLE, Fit.WHOLE]
    assert [Fit(f).drop_reason for f in (Fit.WHOLE, Fit.TRUNCATED, Fit.TOO_LONG, Fit.NO_TARGETS_AFTER_TRUNCATION)] == [
        None, None, DropReason.TOO_LONG, DropReason.NO_TARGETS_AFTER_TRUNCATION]
    with pytest.raises(ValueError, match="truncating needs each example's targets"):
        packer.fit_at_length(lens, 8, OverlongPolicy.TRUNCATE)


# ----------------------------------------------------------------------------- runs of equal lengths


@st.composite
def histograms_and_limit(draw):
    """Histograms that stress place_run: many equal lengths, lengths == L, divisors of L, tiny and large L."""
    max_length = draw(st.one_of(st.integers(1, 64), st.sampled_from([100, 512, 1024, 2048])))
    divisors = [d for d in range(1, max_length + 1) if max_length % d == 0]
    length = st.one_of(st.integers(1, max_length), st.sampled_from(divisors), st.just(max_length),
                       st.integers(max(1, max_length // 3), max_length))
    histogram = draw(st.dictionaries(length, st.one_of(st.integers(0, 8), st.integers(1, 400)), max_size=25))
    return histogram, max_length


def item_by_item_plan(histogram, max_length):
    """The plan as item-by-item BFD (one place() per item) makes it, rows as lists of lengths."""
    lengths = [n for n in sorted(histogram, reverse=True) for _ in range(histogram[n])]
    return [[lengths[i] for i in row] for row in plans.pack_best_fit_decreasing(lengths, max_length)]


@settings(max_examples=300, deadline=None)
@given(histograms_and_limit())
@example(({3: 5, 2: 7, 1: 30}, 8))
@example(({4: 1, 3: 3, 2: 9, 1: 4}, 12))
def test_histogram_plan_is_item_by_item_bfd(case):
    histogram, max_length = case
    assert plans.plan_from_histogram(histogram, max_length) == item_by_item_plan(histogram, max_length)


@settings(max_examples=300, deadline=None)
@given(histograms_and_limit())
@example(({3: 5, 2: 7, 1: 30}, 8))
def test_place_run_leaves_the_state_count_place_calls_leave(case):
    histogram, max_length = case
    runs, items = packer._BestFit(max_length), packer._BestFit(max_length)
    for length in sorted(histogram, reverse=True):
        count = histogram[length]
        placed = runs.place_run(length, count)
        before = list(items.segments)
        rows = [items.place(length) for _ in range(count)]
        grouped = [(row, sum(1 for _ in group)) for row, group in itertools.groupby(rows)]
        assert [(row, k) for row, _, k in placed] == grouped
        assert [start for row, start, _ in placed] == [before[row] if row < len(before) else 0 for row, _ in grouped]
        # The whole state, bucket order included: later runs must see what later items would.
        assert runs._rows_by_free == items._rows_by_free
        assert runs._nonempty == items._nonempty
        assert runs.segments == items.segments


def test_run_plan_rows_match_and_placements_are_runs():
    histogram = {2048: 3, 1500: 4, 700: 10, 512: 9, 100: 500, 37: 1000, 1: 5000}
    runs = plans.plan_runs_from_histogram(histogram, 2048)
    rows = item_by_item_plan(histogram, 2048)
    assert runs.rows() == rows and runs.num_rows == len(rows)
    assert runs.segments.tolist() == [len(r) for r in rows]
    assert len(runs.row) < sum(histogram.values()) // 10  # one placement per row touched, not per item
    assert len(set(zip(runs.row.tolist(), runs.length.tolist()))) == len(runs.row)  # one run per (row, length)
    assert plans.plan_runs_from_histogram({}, 8).rows() == []
    assert plans.plan_from_histogram({5: 0, 3: 2}, 4) == [[3], [3]]  # an empty count places nothing


def test_a_plan_past_the_row_limit_names_the_way_out(monkeypatch):
    """Rows are C ints in the BFD state; a plan that would need more is refused in one line."""
    monkeypatch.setattr(packer, "MAX_ROWS", 3)
    assert len(plans.plan_from_histogram({4: 3}, 4)) == 3
    with pytest.raises(ValueError, match=r"^the plan at max length 4 needs more than 3 rows: split the input and pack "
                                         r"each part on its own$"):
        plans.plan_from_histogram({4: 4}, 4)


# ----------------------------------------------------------------------------- streamed by length


@settings(max_examples=200, deadline=None)
@given(histograms_and_limit(), st.booleans(), st.randoms(use_true_random=False))
def test_streamed_classes_are_the_run_plan_one_length_at_a_time(case, release_often, rnd):
    """HistogramBestFit.classes: each length's slots in row order, then position order, as the
    whole run plan has them, whether or not the buckets' spare room is given back after every
    length; any range of a class's slots is that range of the whole expansion."""
    histogram, max_length = case
    rows = plans.plan_runs_from_histogram(histogram, max_length).rows()
    bfd = packer.HistogramBestFit(histogram, max_length, release_after=0 if release_often else 1 << 16)
    streamed = list(bfd.classes())
    assert [c.length for c in streamed] == sorted((n for n, c in histogram.items() if c > 0), reverse=True)
    slots = slots_by_length(rows)
    for runs in streamed:
        want = [(s.row, s.position) for s in slots[runs.length]]
        got_rows, got_positions = runs.slots(0, runs.num_slots)
        assert got_rows.dtype == got_positions.dtype == np.int32
        assert list(zip(got_rows.tolist(), got_positions.tolist())) == want
        first = rnd.randint(0, len(want))
        stop = rnd.randint(first, len(want))
        part_rows, part_positions = runs.slots(first, stop)
        assert list(zip(part_rows.tolist(), part_positions.tolist())) == want[first:stop]
    assert bfd.num_rows == len(rows) and bfd.segments.tolist() == [len(r) for r in rows]
    if streamed:
        with pytest.raises(ValueError, match=rf"^slots 0..{streamed[0].num_slots + 1} are outside the "
                                             rf"{streamed[0].num_slots} slots of length {streamed[0].length}$"):
            streamed[0].slots(0, streamed[0].num_slots + 1)


def test_release_spare_gives_back_what_emptied_buckets_hold_and_keeps_their_rows():
    """array.pop never reallocates: without release_spare a bucket keeps its largest size."""
    import sys

    fit = packer._BestFit(8)
    fit.place_run(5, 100_000)  # 100,000 rows with 3 free, all in bucket 3
    fit.place_run(3, 99_990)  # fills all but 10 of them
    before = [b.tolist() for b in fit._rows_by_free]
    assert len(fit._rows_by_free[3]) == 10 and sys.getsizeof(fit._rows_by_free[3]) > 400_000
    fit.release_spare()
    assert [b.tolist() for b in fit._rows_by_free] == before
    assert sys.getsizeof(fit._rows_by_free[3]) < 1_000
