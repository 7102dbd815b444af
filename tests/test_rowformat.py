"""Row invariants: built rows satisfy them, broken rows are caught, encoding round-trips."""

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prepack.format import rowformat
from prepack.format.rowformat import RowFormatError, Segment
from testkit.reference import split_segments


@st.composite
def segments_and_length(draw):
    max_length = draw(st.integers(4, 96))
    segments, used = [], 0
    for _ in range(draw(st.integers(1, 8))):
        n = draw(st.integers(1, max_length))
        if used + n > max_length:
            break
        ids = np.array(draw(st.lists(st.integers(0, 262_143), min_size=n, max_size=n)), dtype=np.int32)
        mask = np.array(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)), dtype=np.int32)
        segments.append(Segment(ids, mask))
        used += n
    if not segments:
        segments = [Segment(np.array([7], np.int32), np.array([1], np.int32))]
    return segments, max_length


def no_target_crosses_boundary(row) -> bool:
    """A target at t is predicted from t-1: both must be in the same segment."""
    seg, loss = np.asarray(row["segment_ids"]), np.asarray(row["loss_mask"])
    targets = np.flatnonzero(loss[1:]) + 1
    return bool(loss[0] == 0 and np.all(seg[targets - 1] == seg[targets]) and np.all(seg[targets] != 0))


@settings(max_examples=200, deadline=None)
@given(segments_and_length())
def test_built_rows_hold_every_invariant(case):
    segments, max_length = case
    row = rowformat.build_row(segments, max_length)
    rowformat.check_row(row, max_length)
    assert no_target_crosses_boundary(row)
    # Every token lands in its segment, in order; only the first token's loss changes.
    back = split_segments(row)
    assert len(back) == len(segments)
    for original, restored in zip(segments, back):
        np.testing.assert_array_equal(original.input_ids, restored.input_ids)
        np.testing.assert_array_equal(original.loss_mask[1:], restored.loss_mask[1:])
        assert restored.loss_mask[0] == 0


@settings(max_examples=100, deadline=None)
@given(segments_and_length())
def test_encode_decode_round_trip(case):
    segments, max_length = case
    row = rowformat.build_row(segments, max_length)
    record = rowformat.encode_row(row, max_length)
    assert len(record) == rowformat.record_size(max_length)
    decoded = rowformat.decode_row(record, max_length)
    batch = rowformat.decode_rows([record, record], max_length)
    for name in rowformat.FIELD_NAMES:
        np.testing.assert_array_equal(decoded[name], row[name])
        assert decoded[name].dtype == np.int32
        assert batch[name].shape == (2, max_length)
        np.testing.assert_array_equal(batch[name][1], row[name])


def test_boundary_property_can_fail():
    """The boundary check is not vacuous: a row whose second segment starts with a target fails it."""
    segments = [Segment(np.array([2, 5, 6]), np.array([0, 1, 1])), Segment(np.array([2, 9]), np.array([1, 1]))]
    row = rowformat.build_row(segments, 8)
    assert no_target_crosses_boundary(row)
    row["loss_mask"][3] = 1  # what a builder that forgot the first-token rule would write
    assert not no_target_crosses_boundary(row)
    with pytest.raises(RowFormatError, match="first token of every segment"):
        rowformat.check_row(row, 8)


def _row():
    return rowformat.build_row(
        [Segment(np.array([2, 5, 6, 7]), np.array([0, 0, 1, 1])), Segment(np.array([2, 9, 9]), np.array([0, 1, 1]))], 10
    )


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda r: r["positions"].__setitem__(5, 3), "positions must count from 0"),
        (lambda r: r["segment_ids"].__setitem__(4, 3), "segment_ids must run 1..k"),
        (lambda r: r["valid_mask"].__setitem__(8, 1), "valid_mask must be 1 exactly where"),
        (lambda r: r["loss_mask"].__setitem__(8, 1), "loss_mask must be 0 on padding"),
        (lambda r: r["loss_mask"].__setitem__(2, 2), "must be 0/1"),
        (lambda r: r["positions"].__setitem__(9, 4), "positions must be 0 on padding"),
        (lambda r: r.pop("segment_ids"), "lacks field 'segment_ids'"),
    ],
)
def test_check_row_names_the_broken_invariant(breakage, message):
    row = _row()
    rowformat.check_row(row, 10)
    breakage(row)
    with pytest.raises(RowFormatError, match=message):
        rowformat.check_row(row, 10)


def test_padding_in_the_middle_is_rejected():
    row = _row()
    for name in rowformat.FIELD_NAMES:
        row[name] = np.concatenate([row[name][:4], [0], row[name][4:9]])
    with pytest.raises(RowFormatError, match="padding must come after every real token"):
        rowformat.check_row(row, 10)


def test_bad_sizes_and_overfull_rows_have_clear_errors():
    with pytest.raises(RowFormatError, match="record has 12 bytes, expected 200 for max_length 10"):
        rowformat.decode_row(b"\0" * 12, 10)
    with pytest.raises(RowFormatError, match="more than max_length 4"):
        rowformat.build_row([Segment(np.arange(5), np.ones(5))], 4)
    with pytest.raises(RowFormatError, match="field 'input_ids' has shape"):
        rowformat.encode_row({name: np.zeros(3) for name in rowformat.FIELD_NAMES}, 10)
    with pytest.raises(RowFormatError, match="segment 2 is empty"):
        rowformat.build_row([Segment(np.arange(2), np.ones(2)), Segment(np.arange(0), np.ones(0))], 4)


def test_readers_decode_by_the_manifests_field_order(tmp_path):
    """The manifest's `fields` object is key-sorted JSON, not the record's order; `field_order` is,
    and the loader decodes by it (a reader going by `fields` would read loss_mask as positions)."""
    import json

    import loaders
    from prepack.format.manifest import Manifest, ManifestError
    from testkit.shard_sets import build_shard_set

    build_shard_set(tmp_path / "set", num_rows=4, num_shards=1, max_length=16)
    path = tmp_path / "set" / "manifest.json"
    data = json.loads(path.read_text())
    assert data["field_order"] == list(rowformat.FIELD_NAMES) == ["input_ids", "loss_mask", "valid_mask", "positions", "segment_ids"]
    assert list(data["fields"]) != data["field_order"]  # sorted keys: why field_order exists
    with loaders.open_shards(str(tmp_path / "set")) as view:
        row = {k: v.copy() for k, v in view[1].items()}
    rowformat.check_row(row, 16)

    # The same records under a manifest that names another order decode by that order; the rows
    # that gives break the row rules, so the checked read refuses them (a trainer fed mask values
    # as token ids: issue 46), and only the raw read returns them.
    data["field_order"] = list(reversed(rowformat.FIELD_NAMES))
    path.write_text(json.dumps(data))
    with loaders.open_shards(str(tmp_path / "set")) as view:
        batch = view.read([1], check=False)
        with pytest.raises(loaders.ShardSetError, match="record 1 .*: .* must be"):
            view.read([1])
    for i, name in enumerate(rowformat.FIELD_NAMES):
        np.testing.assert_array_equal(batch[data["field_order"][i]][0], row[name])

    data["field_order"] = ["input_ids", "loss_mask"]
    with pytest.raises(ManifestError) as err:
        Manifest.from_json(json.dumps(data), source="m.json")
    assert str(err.value) == ("m.json: field_order ['input_ids', 'loss_mask'] must list the fields ['input_ids', "
                              "'loss_mask', 'valid_mask', 'positions', 'segment_ids'] once each, in record order")
    del data["field_order"]  # written before field_order existed: format 1's order
    assert Manifest.from_json(json.dumps(data)).field_order == list(rowformat.FIELD_NAMES)


# ----------------------------------------------------------------------------- formats 3 and 4: example_targets


def test_formats_3_and_4_add_example_targets_last():
    assert rowformat.field_names(3) == rowformat.FIELD_NAMES + ("example_targets",)
    assert rowformat.field_names(4) == rowformat.FIELD_NAMES + ("source_ids", "example_targets")
    assert [rowformat.row_format_version(s, e) for s in (False, True) for e in (False, True)] == [1, 3, 2, 4]
    assert rowformat.record_size(10, 3) == 24 * 10 and rowformat.record_size(10, 4) == 28 * 10


def _flat(segments):
    return (np.array([len(s) for s in segments]), np.concatenate([s.input_ids for s in segments]),
            np.concatenate([s.loss_mask for s in segments]))


@settings(max_examples=100, deadline=None)
@given(segments_and_length(), st.booleans())
def test_the_encoder_writes_each_segments_example_targets(case, with_sources):
    """Format 3 (4 with sources) is format 1's (2's) bytes plus the field: a given count on a
    piece's tokens, the segment's own target count where 0 is given (a whole example)."""
    segments, max_length = case
    lens, ids, mask = _flat(segments)
    rng = np.random.default_rng(len(segments))
    sources = rng.integers(1, 4, len(segments)) if with_sources else None
    own = np.array([int(s.loss_mask[1:].sum()) for s in segments])
    given_totals = np.where(rng.random(len(segments)) < 0.5, 0, own + rng.integers(0, 5, len(segments)))
    [(record, _, targets)] = rowformat.encode_rows_flat([len(segments)], lens, ids, mask, max_length, 0, sources, given_totals)
    [(plain, _, _)] = rowformat.encode_rows_flat([len(segments)], lens, ids, mask, max_length, 0, sources)
    version = rowformat.row_format_version(with_sources, True)
    row = rowformat.decode_row(record, max_length, rowformat.field_names(version))
    before = rowformat.decode_row(plain, max_length, rowformat.field_names(rowformat.row_format_version(with_sources, False)))
    for name, values in before.items():
        np.testing.assert_array_equal(row[name], values)
    want = np.zeros(max_length, np.int64)
    want[: lens.sum()] = np.repeat(np.where(given_totals > 0, given_totals, own), lens)
    np.testing.assert_array_equal(row["example_targets"], want)
    assert targets == int(own.sum())
    if own.min() > 0:  # a segment with no target is no example (the job drops it)
        rowformat.check_row(row, max_length)


def _split_row():
    lens, ids, mask = _flat([Segment(np.array([2, 5, 6, 7]), np.array([0, 0, 1, 1])),
                             Segment(np.array([2, 9, 9]), np.array([0, 1, 1]))])
    [(record, _, _)] = rowformat.encode_rows_flat([2], lens, ids, mask, 10, 0, None, np.array([5, 0]))
    return {k: v.copy() for k, v in rowformat.decode_row(record, 10, rowformat.field_names(3)).items()}


@pytest.mark.parametrize("breakage, message", [
    (lambda r: r["example_targets"].__setitem__(3, 6), "example_targets must be the same on every token of a segment"),
    (lambda r: r["example_targets"].__setitem__(slice(4, 7), 1), "example_targets must be at least the segment's own target tokens"),
    (lambda r: r["example_targets"].__setitem__(slice(0, 4), 0), "example_targets must be at least the segment's own target tokens"),
    (lambda r: r["example_targets"].__setitem__(8, 2), "example_targets must be at least .* 0 on padding"),
])
def test_check_row_names_a_broken_example_targets(breakage, message):
    row = _split_row()
    assert row["example_targets"].tolist() == [5, 5, 5, 5, 2, 2, 2, 0, 0, 0]
    rowformat.check_row(row, 10)
    breakage(row)
    with pytest.raises(RowFormatError, match=message):
        rowformat.check_row(row, 10)


def test_manifests_of_format_3_and_4():
    from prepack.format.manifest import Manifest, ManifestError

    manifest = Manifest(max_length=8, num_rows=0, shards=[], tokenizer={}, stats={})
    manifest.use_row_format(sources=False, example_targets=True)
    assert (manifest.format_version, manifest.field_order) == (3, list(rowformat.field_names(3)))
    assert Manifest.from_json(manifest.to_json()).field_order[-1] == "example_targets"
    manifest.use_row_format(sources=True, example_targets=True)  # format 4 without its mixture
    with pytest.raises(ManifestError, match="format_version 4 needs a `mixture` object"):
        Manifest.from_json(manifest.to_json())


def test_row_format_doc_names_files_as_the_job_names_them():
    """docs/row_format.md's example file names are the names the writers give (layout.SHARD_FILE with its
    hash suffix; tokenset.shard_name), so a reader that follows the doc finds the files."""
    import os
    import re

    from prepack.format import layout, tokenset

    doc = open(os.path.join(os.path.dirname(__file__), "..", "docs", "row_format.md"), encoding="utf-8").read()
    rows = re.findall(r"`(rows-\d{5}-of-\d{5}-[0-9a-f]+\.array_record)`", doc)
    tokens = re.findall(r"`(tokens-[0-9a-f]+\.array_record)`", doc)
    assert rows and tokens
    assert all(layout.SHARD_FILE.match(name) and layout.SHARD_FILE.match(name).group(1) for name in rows)  # hash suffix
    assert tokens == [tokenset.shard_name(name[len("tokens-"):-len(".array_record")] + "0" * 48) for name in tokens]
    assert "Take the file list from the manifest's `shards`" in doc


def _batch():
    """Two rows of format 1, as [B, L] arrays (row 1 the valid _row(), row 0 a copy)."""
    row = _row()
    return {name: np.stack([row[name], row[name]]) for name in rowformat.FIELD_NAMES}


def test_the_rules_take_the_manifests_facts_and_judge_a_batch():
    """row_fault is a function of a [B, L] batch and the manifest's facts (version, vocab_size,
    pad_id, sources), as verify and the trainer call it; a fact not given is not judged."""
    batch = _batch()
    facts = rowformat.RowFacts(rowformat.FORMAT_VERSION, vocab_size=10, pad_id=0)
    assert rowformat.row_fault(batch, facts) is None
    batch["input_ids"][1, 5] = 10
    assert rowformat.row_fault(batch, facts) == rowformat.RowFault(1, 5, 2, rowformat.RULE_VOCAB)
    assert rowformat.row_fault(batch, rowformat.RowFacts(rowformat.FORMAT_VERSION)) is None  # vocab not given
    batch["input_ids"][1, 5] = -5
    assert rowformat.row_fault(batch, facts).rule == rowformat.RULE_VOCAB
    batch["input_ids"][1, 5] = 9
    batch["input_ids"][0, 8] = 3  # padding of row 0
    assert rowformat.row_fault(batch, facts) == rowformat.RowFault(0, 8, 0, rowformat.RULE_PAD_ID)
    assert rowformat.row_fault(batch, dataclasses.replace(facts, pad_id=None)) is None
    with pytest.raises(RowFormatError, match="rows of format 2 lack the field 'source_ids'"):
        rowformat.row_fault(batch, rowformat.RowFacts(rowformat.MIXTURE_FORMAT_VERSION))


def test_a_segment_shifted_by_one_breaks_only_the_start_rule():
    """Positions 1..n in a segment count up by one; only "from 0 at every segment start" sees it.
    (A test that breaks a token after the start passes with that half of the rule removed.)"""
    batch = _batch()
    second = int(np.flatnonzero(batch["segment_ids"][0] == 2)[0])
    batch["positions"][0][batch["segment_ids"][0] == 2] += 1
    facts = rowformat.RowFacts(rowformat.FORMAT_VERSION)
    assert rowformat.row_fault(batch, facts) == rowformat.RowFault(0, second, 2, rowformat.RULE_POSITIONS)
    one = {name: batch[name][0] for name in rowformat.FIELD_NAMES}
    with pytest.raises(RowFormatError, match=r"positions must count from 0 at every segment start, up by one \(token 4, segment 2\)"):
        rowformat.check_row(one, 10)
