"""The mixture file's validation (one line per bad input) and the share rule (property tests)."""

from __future__ import annotations

import json
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from prepack.mixture_file import load_mixture
from prepack.packing.mixture import MixtureError, budgets, limiting_source, partial_pick

GOOD = """\
weight_of: target_tokens
max_repeats: 4
sources:
  - name: alpaca
    input: data/alpaca.jsonl
    format: alpaca
    weight: 3
  - name: fr
    input: [data/en_fr.jsonl]
    format: translation
    source_lang: en
    target_lang: fr
    weight: 1.5
"""


def write(tmp_path, text, name="mix.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_good_file_resolves_inputs_relative_to_its_folder(tmp_path):
    mix = load_mixture(write(tmp_path, GOOD))
    assert [s.name for s in mix.sources] == ["alpaca", "fr"]
    assert [s.index for s in mix.sources] == [1, 2]
    assert mix.sources[0].inputs == (str(tmp_path / "data" / "alpaca.jsonl"),)
    assert mix.sources[1].options == (("source_lang", "en"), ("target_lang", "fr"))
    assert mix.weights == [Fraction(3), Fraction(3, 2)]
    assert mix.source_of_input() == (1, 2)
    assert len(mix.sha256) == 64


def test_json_is_accepted(tmp_path):
    doc = {"weight_of": "examples", "sources": [{"name": "a", "input": "/x.jsonl", "format": "alpaca", "weight": 1}]}
    mix = load_mixture(write(tmp_path, json.dumps(doc), "mix.json"))
    assert mix.max_repeats == 1 and mix.weight_of == "examples" and mix.sources[0].inputs == ("/x.jsonl",)


def source(**over):
    base = {"name": "a", "input": "/x.jsonl", "format": "alpaca", "weight": 1}
    base.update(over)
    return {k: v for k, v in base.items() if v is not None}


@pytest.mark.parametrize("doc, message", [
    ({"sources": [source()], "weights": 1}, "unknown key 'weights'"),
    ({"sources": [source(lang="x")]}, "source 1: unknown key 'lang'"),
    ({"sources": [source(), source()]}, "source 2: duplicate name 'a'"),
    ({"sources": [source(name="Alpaca!")]}, "source 1: name a string 'Alpaca!' is malformed"),
    ({"sources": [source(weight=0)]}, "source 'a': weight must be a positive number from 1e-09 to 1e+12 (an int, a float or a decimal string), got a number 0"),
    ({"sources": [source(weight=-2)]}, "source 'a': weight must be a positive number from 1e-09 to 1e+12 (an int, a float or a decimal string), got a number -2"),
    ({"sources": [source(weight="lots")]}, "source 'a': weight must be a positive number from 1e-09 to 1e+12 (an int, a float or a decimal string), got a string 'lots'"),
    ({"sources": [source(input=None)]}, "source 'a': missing key 'input'"),
    ({"sources": [source(input=[])]}, "source 'a': input must be a spec or a list of 1 to 10,000 specs of at most 4,096 characters, got an array []"),
    ({"sources": [source(format="oasst1")]}, "format 'oasst1' templates whole tables"),
    ({"sources": [source(format="nope")]}, "unknown source format 'nope'"),
    ({"sources": []}, "sources must be a non-empty list"),
    ({"weight_of": "tokens", "sources": [source()]}, "weight_of must be target_tokens or examples"),
    ({"max_repeats": 0, "sources": [source()]}, "max_repeats must be a whole number from 1 to 1,000, got a number 0"),
])
def test_bad_file_is_one_line(tmp_path, doc, message):
    path = write(tmp_path, json.dumps(doc))
    with pytest.raises(MixtureError) as e:
        load_mixture(path)
    assert message in str(e.value) and str(e.value).startswith(f"mixture file {path}") and "\n" not in str(e.value)


def test_not_yaml_is_one_line(tmp_path):
    with pytest.raises(MixtureError, match=r"mix.yaml: line 2: not valid YAML or JSON \(expected ',' or ']'"):
        load_mixture(write(tmp_path, "sources: [a, b\n"))


def test_worked_example_of_the_issue():
    # 3:1 by target tokens, alpaca 200k and chat 400k kept.
    once = budgets([200_000, 400_000], [Fraction(3), Fraction(1)], 1)
    assert [b.budget for b in once] == [200_000, Fraction(200_000, 3)]
    assert [b.copies for b in once] == [1, 0]
    four = budgets([200_000, 400_000], [Fraction(3), Fraction(1)], 4)
    assert [b.budget for b in four] == [800_000, Fraction(800_000, 3)]
    assert [b.copies for b in four] == [4, 0]
    assert limiting_source([200_000, 400_000], [Fraction(3), Fraction(1)]) == 0


weights_st = st.lists(st.tuples(st.lists(st.integers(1, 50), min_size=1, max_size=60), st.integers(1, 9)),
                      min_size=1, max_size=4)


@settings(max_examples=200, deadline=None)
@given(weights_st, st.integers(1, 4))
def test_share_rule(sources, max_repeats):
    kept = [sum(ws) for ws, _ in sources]
    weights = [Fraction(w) for _, w in sources]
    out = budgets(kept, weights, max_repeats)
    written = []
    for (ws, _), b in zip(sources, out):
        assert 0 <= b.copies <= max_repeats and 0 <= b.rest < b.kept or (b.copies == max_repeats and b.rest == 0)
        taken, weight = partial_pick(ws, b.rest)
        assert weight == sum(ws[i] for i in taken) <= b.rest
        left_out = [w for i, w in enumerate(ws) if i not in taken]
        assert all(weight + w > b.rest for w in left_out)  # nothing left out still fits
        total = b.written(weight)
        assert b.budget - min(left_out, default=max(ws)) < total <= b.budget
        assert total <= max_repeats * b.kept  # never more than max_repeats copies
        written.append(total)
    # the scarcest source, relative to its weight, is used max_repeats times: the largest output
    limit = limiting_source(kept, weights)
    assert written[limit] == max_repeats * kept[limit]
    # budgets are proportional to the weights
    for b, w in zip(out, weights):
        assert b.budget / w == out[0].budget / weights[0]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3), st.one_of(st.integers(0, 2**64 - 1), st.integers(0, 2**40), st.just(7)),
                          st.integers(1, 40)), min_size=3, max_size=300),
       st.lists(st.integers(1, 5), min_size=3, max_size=3), st.integers(1, 3), st.sampled_from(["target_tokens", "examples"]))
def test_job_boundary_search_is_the_share_rule(examples, weights, max_repeats, weight_of):
    """The mix stage's bucket histogram (pipelines/mix_weights.py), candidates (combined in random bundles) and
    threshold pick exactly the examples the rule picks when every example of a source is ranked
    in one list: the rank cut and the partial pick after it."""
    import random

    from pipelines.stages.mix import BOUNDARY, LATER, FillCandidates, ThresholdFn, decide
    from prepack.packing.mixture import fill_bound, rank_bucket

    L = 64
    examples = [(s, h, f"{s}/x/{i}", w if weight_of == "target_tokens" else 1) for i, (s, h, w) in enumerate(examples)]
    if {s for s, *_ in examples} != {1, 2, 3}:
        return
    hist: dict = {}
    for s, h, _, w in examples:
        hist[(L, s, rank_bucket(h))] = hist.get((L, s, rank_bucket(h)), 0) + w
    fractions = [Fraction(w) for w in weights]
    decisions = decide(hist, (L,), fractions, max_repeats)
    thresholds = {}
    combine, rng = FillCandidates(), random.Random(len(examples))
    for s in (1, 2, 3):
        boundary, left = decisions[(L, s)][1:]
        bound = fill_bound(left, weight_of, L)
        elements = [(BOUNDARY if rank_bucket(h) == boundary else LATER, bound, h, i, w) for t, h, i, w in examples
                    if t == s and boundary != -1 and (rank_bucket(h) == boundary or (rank_bucket(h) > boundary and w <= bound))]
        rng.shuffle(elements)
        cuts = sorted(rng.sample(range(len(elements) + 1), min(2, len(elements) + 1)))
        accs = []
        for part in (elements[:cuts[0]], elements[cuts[0]:cuts[-1]], elements[cuts[-1]:]):
            acc = combine.create_accumulator()
            for e in part:
                acc = combine.add_input(acc, e)
            accs.append(acc)
        for key, found in ThresholdFn().process(((L, s), combine.extract_output(combine.merge_accumulators(accs))),
                                                decisions):
            thresholds[key] = found
    kept = [sum(w for t, *_, w in examples if t == s) for s in (1, 2, 3)]
    for s, budget in zip((1, 2, 3), budgets(kept, fractions, max_repeats)):
        ranked = sorted((h, i, w) for t, h, i, w in examples if t == s)
        taken, _ = partial_pick((w for *_, w in ranked), budget.rest)
        want = {ranked[at][1] for at in taken}
        copies, boundary, _ = decisions[(L, s)]
        assert copies == budget.copies
        cut, picks = thresholds.get((L, s), (None, frozenset()))
        got = {i for h, i, _ in ranked
               if rank_bucket(h) < boundary or (rank_bucket(h) == boundary and (cut is None or (h, i) < tuple(cut)))
               or (boundary != -1 and (h, i) in picks)}
        assert got == want


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(0, 2**64 - 1), st.integers(1, 12)), max_size=200),
       st.integers(0, 30), st.lists(st.integers(0, 200), max_size=4))
def test_fill_candidates_keep_what_the_partial_pick_could_take(elements, bound, cuts):
    """However the candidates are bundled, FillCandidates keeps every boundary-bucket example and,
    of the later ones, the first bound // w of each weight w by rank (the pick takes no more)."""
    from pipelines.stages.mix import BOUNDARY, FillCandidates

    items = [(kind, bound, h, f"0/x/{i}", w) for i, (kind, h, w) in enumerate(elements)]
    combine = FillCandidates()
    accs = []
    for part in np.split(np.arange(len(items)), sorted(min(c, len(items)) for c in cuts)):
        acc = combine.create_accumulator()
        for at in part.tolist():
            acc = combine.add_input(acc, items[at])
        accs.append(acc)
    got = combine.extract_output(combine.merge_accumulators(accs))
    want = [(h, i, w) for kind, _, h, i, w in items if kind == BOUNDARY]
    for weight in {w for *_, w in items}:
        later = sorted((h, i, w) for kind, _, h, i, w in items if kind != BOUNDARY and w == weight)
        want += later[:bound // weight]
    assert got == sorted(want)
