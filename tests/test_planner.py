"""The planners over a length histogram: BFD and `best` (the fewer rows of BFD and exact fills),
the segment cap, the work budget, and small instances against a brute-force optimum."""

import math
import random
from collections import Counter

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from prepack.packing import exact_fill, packer
from prepack.packing.packer import HistogramPlan, Planner
from testkit import plans


def check_rows(rows, histogram, max_length, cap):
    """A valid plan: every item exactly once, no row over L tokens or over the cap, no empty row."""
    assert Counter(n for row in rows for n in row) == Counter({n: c for n, c in histogram.items() if c > 0})
    assert all(row and sum(row) <= max_length for row in rows)
    if cap is not None:
        assert max(map(len, rows), default=0) <= cap


def textbook_bfd_rows(lengths, max_length, cap):
    """BFD with a cap, scanning every open row: the tightest row that fits and is under the cap."""
    free, items = [], []
    for n in sorted(lengths, reverse=True):
        fitting = [i for i, f in enumerate(free) if f >= n and (cap is None or items[i] < cap)]
        if fitting:
            best = min(fitting, key=lambda i: free[i])
            free[best] -= n
            items[best] += 1
        else:
            free.append(max_length - n)
            items.append(1)
    return len(free)


def brute_force_rows(lengths, max_length, cap):
    """The fewest rows, by trying every placement (few items only)."""
    items = sorted(lengths, reverse=True)
    cap = cap or max_length
    best = [len(items)]

    def place(i, loads, counts):
        if len(loads) >= best[0]:
            return
        if i == len(items):
            best[0] = len(loads)
            return
        tried = set()
        for j in range(len(loads)):
            if loads[j] + items[i] <= max_length and counts[j] < cap and (loads[j], counts[j]) not in tried:
                tried.add((loads[j], counts[j]))
                loads[j] += items[i]
                counts[j] += 1
                place(i + 1, loads, counts)
                loads[j] -= items[i]
                counts[j] -= 1
        loads.append(items[i])
        counts.append(1)
        place(i + 1, loads, counts)
        loads.pop()
        counts.pop()

    place(0, [], [])
    return best[0]


@st.composite
def histograms(draw, max_items=None):
    max_length = draw(st.one_of(st.integers(1, 64), st.sampled_from([128, 512, 2048])))
    length = st.one_of(st.integers(1, max_length), st.integers(max(1, max_length // 3), max_length))
    counts = st.one_of(st.integers(0, 6), st.integers(1, 300)) if max_items is None else st.integers(0, 3)
    histogram = draw(st.dictionaries(length, counts, max_size=25 if max_items is None else max_items))
    cap = draw(st.one_of(st.none(), st.integers(1, 20)))
    return histogram, max_length, cap


@settings(max_examples=300, deadline=None)
@given(histograms(), st.sampled_from(list(Planner)))
@example(({5: 3, 3: 4, 2: 9, 1: 2}, 8, 2), Planner.BFD)
@example(({300: 5, 212: 5, 100: 7, 6: 3}, 512, 2), Planner.BEST)
@example(({1: 300}, 512, 4), Planner.BEST)
@example(({10: 1, 7: 2, 4: 3, 1: 10}, 20, 3), Planner.BEST)  # uncapped, the fill after 10 is 7+1+1+1
def test_the_cap_holds_in_every_row_of_every_planner(case, planner):
    """The plan's rows, and the exact fill's own (whether or not `best` keeps them), hold at most
    `cap` segments. Fails when BFD's run placement ignores the cap (place_run's
    `cap - segments[row]`), when a new row of a run takes max_length // length items, when the
    fill's subset-sum forgets its item count, or when its longest-items shortcut takes more."""
    histogram, max_length, cap = case
    plan = HistogramPlan(histogram, max_length, planner, cap)
    rows = plan.rows()
    check_rows(rows, histogram, max_length, cap)
    check_rows(exact_fill.plan_exact_fill(histogram, max_length, cap).rows(), histogram, max_length, cap)
    assert plan.num_rows == len(rows)
    lows, highs = plan.segment_range()
    assert (lows, highs) == ((min(map(len, rows)), max(map(len, rows))) if rows else (0, 0))


@settings(max_examples=300, deadline=None)
@given(histograms())
@example(({5: 3, 3: 4, 2: 9, 1: 2}, 8, None))
@example(({16: 1, 45: 3, 39: 1, 26: 1, 3: 1, 24: 2, 10: 4, 33: 1, 11: 2, 36: 1, 2: 3}, 45, 3))
def test_best_never_has_more_rows_than_bfd_and_bfd_rows_is_bfd(case):
    """`bfd_rows` is the BFD row count (textbook BFD with the cap, item by item), under either
    planner; `best` never has more rows. Fails when the fill's rows are taken on a tie or when
    worse (`fill.num_rows < self.bfd_rows`), or when BFD with a cap differs from textbook BFD."""
    histogram, max_length, cap = case
    lengths = [n for n, c in histogram.items() for _ in range(c)]
    bfd = HistogramPlan(histogram, max_length, Planner.BFD, cap)
    bfd_rows = len(bfd.rows())
    assert bfd_rows == bfd.bfd_rows == textbook_bfd_rows(lengths, max_length, cap)
    assert bfd_rows == len(plans.pack_best_fit_decreasing(lengths, max_length, cap))
    best = HistogramPlan(histogram, max_length, Planner.BEST, cap)
    assert best.bfd_rows == bfd_rows
    rows = best.rows()
    check_rows(rows, histogram, max_length, cap)
    assert len(rows) <= bfd_rows
    assert best.method == ("exact_fill" if len(rows) < bfd_rows else "bfd")


@settings(max_examples=400, deadline=None)
@given(st.integers(2, 40), st.lists(st.integers(1, 40), min_size=1, max_size=9), st.sampled_from([None, 1, 2, 3, 5]))
@example(10, [6, 4, 5, 5, 3, 3, 2, 2], None)  # BFD: 4 rows ([6, 4], [5, 5], [3, 3, 2, 2]... ); the optimum 3
@example(12, [5, 5, 4, 4, 3, 3, 3, 3, 6], 3)
def test_best_is_within_one_row_of_the_brute_force_optimum(max_length, lengths, cap):
    """Small instances: the exact fill alone, and so `best`, uses at most one row more than the
    fewest possible (measured: the fill finds the optimum on 3,000 of 3,000 random instances,
    BFD on 2,998). Fails when the fill is switched off (best_fill returning an empty fill: one
    row per item)."""
    lengths = [min(n, max_length) for n in lengths]
    optimum = brute_force_rows(lengths, max_length, cap)
    plan = HistogramPlan(Counter(lengths), max_length, Planner.BEST, cap)
    rows = plan.rows()
    check_rows(rows, Counter(lengths), max_length, cap)
    assert optimum <= len(rows) <= optimum + 1
    assert plan.fill_rows <= optimum + 1


@settings(max_examples=300, deadline=None)
@given(st.integers(2, 600), st.integers(1, 40), st.randoms(use_true_random=False))
def test_rows_cut_into_pieces_are_packed_back_within_one_row_of_the_bound(max_length, num_rows, rnd):
    """Lengths that fill `num_rows` rows exactly (each row cut at random points): the optimum
    is the lower bound, and the fill (so `best`) reaches it or one row more, as the issue asks
    wherever the lengths allow (measured: the fill reaches the bound on 1,995 of 2,000 such
    inputs, BFD on 729). Fails with the fill off."""
    lengths = []
    for _ in range(num_rows):
        cuts = sorted(rnd.sample(range(1, max_length), min(max_length - 1, rnd.randint(0, 8))))
        bounds = [0, *cuts, max_length]
        lengths += [b - a for a, b in zip(bounds, bounds[1:])]
    plan = HistogramPlan(Counter(lengths), max_length, Planner.BEST)
    rows = plan.rows()
    check_rows(rows, Counter(lengths), max_length, None)
    assert len(rows) <= math.ceil(sum(lengths) / max_length) + 1 == num_rows + 1
    assert plan.fill_rows <= num_rows + 1


def test_decomposable_rows_that_bfd_misses():
    """A case where BFD is two rows over the bound and the fill reaches it."""
    histogram = {6: 4, 5: 4, 4: 4, 3: 4, 2: 4}  # 80 tokens: five rows of 16
    bfd = HistogramPlan(histogram, 16, Planner.BFD)
    best = HistogramPlan(histogram, 16, Planner.BEST)
    assert len(best.rows()) == 5 < len(bfd.rows()) == best.bfd_rows


def test_the_budget_is_work_and_past_it_the_result_is_bfds():
    """The work is counted in subset-sum cells: the same count on every call; a budget the first
    fill runs past raises BudgetExhausted, and the plan is BFD's (method `bfd`, BFD's rows); a
    budget that cuts only a later fill keeps the fills that finished."""
    rnd = random.Random(5)
    histogram = Counter(rnd.randint(1, 300) for _ in range(5000))
    first = exact_fill.plan_exact_fill(histogram, 512)
    again = exact_fill.plan_exact_fill(dict(reversed(list(histogram.items()))), 512)
    assert first.work == again.work > 0 and first.patterns == again.patterns  # deterministic
    with pytest.raises(exact_fill.BudgetExhausted):
        exact_fill.plan_exact_fill(histogram, 512, budget=10)
    assert exact_fill.plan_exact_fill(histogram, 512, budget=first.work).patterns == first.patterns
    cut = exact_fill.plan_exact_fill(histogram, 512, budget=first.work - 1)  # the last fill left out
    assert cut.work == first.work and cut.num_rows >= first.num_rows
    starved = HistogramPlan(histogram, 512, Planner.BEST, budget=10)
    bfd = plans.plan_from_histogram(dict(histogram), 512)
    assert starved.method == "bfd" and starved.fill_rows is None and starved.rows() == bfd
    assert starved.budget_exhausted
    fed = HistogramPlan(histogram, 512, Planner.BEST, budget=first.work)
    assert fed.fill_rows == first.num_rows and not fed.budget_exhausted


def test_the_budget_charges_each_fills_fixed_costs():
    """Cells alone undercount many distinct lengths: tiny tables, but a fill and a pass over the
    lengths left per pattern, which took most of the CPU when the budget counted only cells
    (20,000 lengths at L 32768: 29-32 CPU-s within a budget meant as ~9 s). By hand: four 100s at
    L 512 are one row whose fill needs no table (the longest three fit the room), once per fill
    order: FILL_CELLS plus LENGTH_CELLS for the one length, twice."""
    assert exact_fill.plan_exact_fill({100: 4}, 512).work == 2 * (exact_fill.FILL_CELLS + exact_fill.LENGTH_CELLS)
    rnd = random.Random(7)
    histogram = {n: rnd.randint(1, 3) for n in rnd.sample(range(1, 4097), 2000)}
    plan = exact_fill.plan_exact_fill(histogram, 4096)
    assert plan.work >= (exact_fill.FILL_CELLS + exact_fill.CHUNK_CELLS) * len(plan.patterns)
    with pytest.raises(exact_fill.BudgetExhausted):
        exact_fill.plan_exact_fill(histogram, 4096, budget=plan.work // 2)


def test_patterns_stay_few_when_counts_grow():
    """Rows repeat patterns: 1000 times the counts give (about) the same patterns, not 1000
    times as many, so planning costs the same at any scale."""
    rnd = random.Random(2)
    histogram = Counter(rnd.randint(1, 200) for _ in range(3000))
    small = exact_fill.plan_exact_fill(histogram, 512)
    big = exact_fill.plan_exact_fill({n: 1000 * c for n, c in histogram.items()}, 512)
    assert len(big.patterns) <= 2 * len(small.patterns)
    assert big.num_rows <= math.ceil(1000 * sum(n * c for n, c in histogram.items()) / 512) + 1


def test_bad_caps_and_lengths_are_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^max_segments must be at least 1, got 0$"):
        HistogramPlan({3: 1}, 8, Planner.BEST, 0)
    with pytest.raises(ValueError, match=r"^item lengths must be within 1..8$"):
        exact_fill.plan_exact_fill({9: 1}, 8)
    with pytest.raises(ValueError, match=r"^'worst' is not a valid Planner$"):
        HistogramPlan({3: 1}, 8, "worst")


# ----------------------------------------------------------------------------- --overlong split


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3000), st.integers(2, 600))
def test_split_pieces_reassemble_and_have_distinct_stable_ids(length, max_length):
    """The pieces cover the example once, in order, none longer than L, all but the last exactly
    L; their ids are distinct (equal-length pieces of one example too, which share a routing
    group and are ranked by hash then id) and differ from every plain example id."""
    pieces = packer.split_pieces(length, max_length)
    assert [t for a, b in pieces for t in range(a, b)] == list(range(length))
    assert all(b - a == max_length for a, b in pieces[:-1]) and 0 < pieces[-1][1] - pieces[-1][0] <= max_length
    ids = [packer.piece_id("0/data.jsonl/7", a, b) for a, b in pieces]
    assert len(set(ids)) == len(ids) and all("#" in i for i in ids)
    assert ids == [packer.piece_id("0/data.jsonl/7", a, b) for a, b in packer.split_pieces(length, max_length)]


def test_split_fit_and_its_counts_in_preflight():
    """Preflight's fit under split, by hand: L 4, masks of 10 tokens cut at 4 and 8; the piece
    [4, 8) has no target after its first token and is dropped as no_targets_after_split."""
    from apps.preflight import ExampleSet, fit_examples

    mask = [0, 1, 1, 1, 1, 0, 0, 0, 0, 1]  # pieces [0,4): 3 targets, [4,8): 0 after its first, [8,10): 1
    examples = ExampleSet.from_masks("hand", [mask, [0, 1]], keep_over=2)
    fitted = fit_examples(examples, 4, packer.OverlongPolicy.SPLIT)
    assert sorted(zip(fitted.kept_lengths.tolist(), fitted.kept_targets.tolist())) == [(2, 1), (2, 1), (4, 3)]
    assert fitted.dropped == {"no_targets_after_split": 1} and (fitted.truncated, fitted.split, fitted.pieces) == (0, 1, 3)
    assert (fitted.windowed, fitted.window_pieces, fitted.context_replayed) == (0, 0, 0)
