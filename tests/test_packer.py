"""Packer properties: every item in exactly one row, capacity respected, BFD row counts."""

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prepack import packer
from prepack.packer import DropReason, OverlongPolicy

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
    rows = packer.pack_best_fit_decreasing(lengths, max_length)
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
    rows = packer.pack_best_fit_decreasing(lengths, max_length)
    assert len(rows) == reference_bfd_rows(lengths, max_length)
    histogram = {}
    for n in lengths:
        histogram[n] = histogram.get(n, 0) + 1
    plan = packer.plan_from_histogram(histogram, max_length)
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
    plan = packer.plan_from_histogram(histogram, max_length)
    slots = packer.slots_by_length(plan)
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
        assert len(packer.pack_best_fit_decreasing(lengths, max_length)) == reference_bfd_rows(lengths, max_length)


def test_packing_is_deterministic_and_order_insensitive_in_row_count():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 512, 5000).tolist()
    a = packer.pack_best_fit_decreasing(lengths, 512)
    b = packer.pack_best_fit_decreasing(lengths, 512)
    assert a == b
    shuffled = list(rng.permutation(lengths))
    assert len(packer.pack_best_fit_decreasing(shuffled, 512)) == len(a)


def test_near_lower_bound_on_sft_like_lengths():
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(4.4, 0.9, 20000).astype(int), 4, 2048).tolist()
    for max_length in (512, 1024, 2048):
        fitting = [n for n in lengths if n <= max_length]
        rows = packer.pack_best_fit_decreasing(fitting, max_length)
        bound = math.ceil(sum(fitting) / max_length)
        assert len(rows) <= bound * 1.01, (max_length, len(rows), bound)
        assert packer.first_fit_in_pools(fitting, max_length, pool_rows=16) >= len(rows)


def test_unpacked_is_one_item_per_row_and_rejects_overlong():
    assert packer.pack_unpacked([3, 1, 2], 4) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="item 1 has length 5, outside 1..4"):
        packer.pack_unpacked([3, 5], 4)


def test_bad_lengths_are_rejected():
    with pytest.raises(ValueError, match="item length 9 is outside 1..8"):
        packer.pack_best_fit_decreasing([3, 9], 8)
    with pytest.raises(ValueError, match="item length 0 is outside"):
        packer.plan_from_histogram({0: 2}, 8)
    with pytest.raises(ValueError, match="max_length must be positive"):
        packer.pack_best_fit_decreasing([1], 0)


def test_overlong_policy():
    ids, mask = np.arange(10), np.array([0] * 6 + [1] * 4)
    assert packer.fit_to_length(ids, mask, 10, OverlongPolicy.DROP)[0] is ids
    assert packer.fit_to_length(ids, mask, 8, OverlongPolicy.DROP) is DropReason.TOO_LONG
    kept_ids, kept_mask = packer.fit_to_length(ids, mask, 8, OverlongPolicy.TRUNCATE)
    np.testing.assert_array_equal(kept_ids, np.arange(8))
    assert kept_mask.sum() == 2
    # Truncation that leaves no target (past the first token) is a drop, not an empty example.
    assert packer.fit_to_length(ids, mask, 6, OverlongPolicy.TRUNCATE) is DropReason.NO_TARGETS_AFTER_TRUNCATION
