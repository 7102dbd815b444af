"""`prepack verify`: passes on the sets the README makes, and names the place of each corruption."""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil

import numpy as np
import pytest
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)

from apps import cli, verify
from prepack import storage
from prepack.format import rowformat, shardfile
from prepack.format.manifest import Manifest
from testkit.pipeline import IN_PROCESS

SAMPLE_MIX = os.path.join(os.path.dirname(rowformat.__file__), "..", "sample_data", "sample_mix.yaml")


def pack(*args: str) -> None:
    # In-process Beam: the sets are the same on any runner, and the default's worker processes (each
    # importing Beam and the tokenizer) cost more than packing the sample; tests/test_pipeline.py and
    # others run the default runner.
    assert cli.main(["pack", *args, "--no-progress", *IN_PROCESS]) == 0


def run(path: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    rc = verify.main([str(path)], out=out, err=err)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
    """The README's sets, made once: a plain output with two lengths, --no-pack, a mixture, --overlong split."""
    root = tmp_path_factory.mktemp("verify")
    made = {name: str(root / name) for name in ("plain", "unpacked", "mix", "split")}
    pack("--sample", "--max-length", "128", "512", "--output", made["plain"])
    pack("--sample", "--max-length", "128", "--no-pack", "--output", made["unpacked"])
    pack("--mixture", SAMPLE_MIX, "--max-length", "256", "--output", made["mix"])
    pack("--sample", "--max-length", "64", "--overlong", "split", "--output", made["split"])
    return made


@pytest.fixture
def copy_of(outputs, tmp_path):
    def copy(name: str) -> str:
        return shutil.copytree(outputs[name], str(tmp_path / name))
    return copy


@pytest.mark.parametrize("name, lengths", [("plain", (128, 512)), ("unpacked", (128,)), ("mix", (256,)), ("split", (64,))])
def test_passes_on_the_readme_sets(outputs, name, lengths):
    rc, out, err = run(outputs[name])
    assert (rc, err) == (0, ""), out
    for L in lengths:
        manifest = Manifest.from_json(open(f"{outputs[name]}/L{L}/manifest.json").read())
        assert (f"L{L}  ok      {manifest.num_rows:,} rows, {manifest.stats['examples_written']:,} segments, "
                f"{manifest.stats['tokens']:,} tokens, {manifest.stats['target_tokens']:,} targets") in out
    assert out.splitlines()[-1].startswith("verify: ok")
    rc, out, _ = run(f"{outputs[name]}/L{lengths[0]}")  # one length's folder alone
    assert rc == 0 and len(out.splitlines()) == 2


def test_split_set_holds_pieces(outputs):
    """The split set exercises what it should: some examples were cut into pieces."""
    stats = json.load(open(f"{outputs['split']}/L64/manifest.json"))["stats"]
    assert stats["examples_split"] > 0


def _rewrite_shard(folder: str, change) -> tuple[str, int]:
    """Applies change(rows) to the set's first shard and republishes its manifest entry (name,
    size, sha256 and the run record's digest), so that only the rows themselves are wrong."""
    manifest_path = os.path.join(folder, "manifest.json")
    manifest = Manifest.from_json(open(manifest_path).read())
    info = manifest.shards[0]
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(os.path.join(folder, info.path))
    rows = rowformat.decode_rows(reader.read_all(), manifest.max_length, manifest.field_order)
    reader.close()
    rows = {k: v.copy() for k, v in rows.items()}
    index = change(rows)
    matrix = np.stack([rows[name] for name in manifest.field_order], axis=1)
    os.remove(os.path.join(folder, info.path))
    new = shardfile.write_shard(os.path.join(folder, info.path), [m.tobytes() for m in matrix])
    manifest.shards[0] = new
    _republish(folder, manifest.to_json())
    return os.path.join(folder, info.path), index


def _republish(folder: str, text: str) -> None:
    """Writes the manifest, and its digest into the output's published.json as a run would."""
    with open(os.path.join(folder, "manifest.json"), "w") as f:
        f.write(text)
    record_path = os.path.join(os.path.dirname(folder), "published.json")
    record = json.load(open(record_path))
    record["lengths"][os.path.basename(folder)[1:]]["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    with open(record_path, "w") as f:
        json.dump(record, f)


def _row_with_segments(rows, k: int) -> int:
    return int(np.flatnonzero(rows["segment_ids"].max(axis=1) >= k)[0])


def _second_segment_start(rows, r: int) -> int:
    return int(np.flatnonzero(rows["segment_ids"][r] == 2)[0])


def flip_first_token_target(rows):
    r = _row_with_segments(rows, 2)
    rows["loss_mask"][r, _second_segment_start(rows, r)] = 1
    return r


def jump_position(rows):
    r = _row_with_segments(rows, 2)
    rows["positions"][r, _second_segment_start(rows, r) + 1] += 1
    return r


def segment_gap(rows):
    r = _row_with_segments(rows, 2)
    seg = rows["segment_ids"][r]
    seg[seg >= 2] += 1  # 1, 3, 4, ...: segment 2 missing
    return r


@pytest.mark.parametrize("change, segment, rule", [
    (flip_first_token_target, "segment 2", "loss_mask must be 0 on the first token of every segment"),
    (jump_position, "segment 2", "positions must count from 0 at every segment start, up by one"),
    (segment_gap, "segment 2", "segment_ids must run 1..k in row order"),
])
def test_names_the_row_and_segment_of_a_broken_row(copy_of, change, segment, rule):
    out_dir = copy_of("plain")
    shard, row = _rewrite_shard(f"{out_dir}/L128", change)
    rc, out, err = run(out_dir)
    assert (rc, err) == (1, "")
    assert "L128  FAILED" in out and "L512  ok" in out
    assert f"  first failure: {shard}: row {row} (record {row} of the shard), {segment}, token " in out
    assert f": {rule}\n" in out
    assert out.splitlines()[-1] == "verify: FAILED"


def test_source_id_outside_the_mixture(copy_of):
    out_dir = copy_of("mix")

    def beyond(rows):
        rows["source_ids"][0][rows["segment_ids"][0] == 1] = 3  # the sample mixture has 2 sources
        return 0

    shard, _ = _rewrite_shard(f"{out_dir}/L256", beyond)
    rc, out, _ = run(f"{out_dir}/L256")
    assert rc == 1
    assert (f"  first failure: {shard}: row 0 (record 0 of the shard), segment 1, token 0: "
            "source_ids must be 1..N on every real token and 0 on padding") in out


def test_split_set_carries_example_targets_and_a_broken_one_is_named(outputs, copy_of):
    """The split set is row format 3: every piece carries its example's target tokens over all its
    pieces. Lowered below a piece's own count on one segment, the row fails with its place."""
    manifest = Manifest.from_json(open(f"{outputs['split']}/L64/manifest.json").read())
    assert manifest.format_version == 3 and manifest.field_order[-1] == "example_targets"
    out_dir = copy_of("split")

    def below_own(rows):
        r = _row_with_segments(rows, 2)
        seg = rows["segment_ids"][r]
        rows["example_targets"][r][seg == 2] = int(rows["loss_mask"][r][seg == 2].sum()) - 1
        return r

    shard, row = _rewrite_shard(f"{out_dir}/L64", below_own)
    rc, out, _ = run(out_dir)
    assert rc == 1
    assert (f"  first failure: {shard}: row {row} (record {row} of the shard), segment 2, token ") in out
    assert "example_targets must be at least the segment's own target tokens (and 1) on every real token, 0 on padding" in out


@pytest.mark.parametrize("key, path", [
    ("stats.examples_written", ("stats", "examples_written")),
    ("stats.tokens", ("stats", "tokens")),
    ("stats.target_tokens", ("stats", "target_tokens")),
])
def test_an_edited_count_is_found_by_the_recount(copy_of, key, path):
    """Whether or not the run record's digest is updated too: the digest catches a plain edit,
    and the recount still catches one made to agree with it."""
    out_dir = copy_of("plain")
    manifest_path = f"{out_dir}/L128/manifest.json"
    data = json.load(open(manifest_path))
    stated = data[path[0]][path[1]]
    data[path[0]][path[1]] = stated + 1
    with open(manifest_path, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True) + "\n")
    rc, out, _ = run(out_dir)
    assert rc == 1
    assert f"run record FAILED: {manifest_path} is not the manifest {out_dir}/published.json names" in out
    assert f"  first failure: {manifest_path}: {key} is {stated + 1}, but the rows hold {stated:,}" in out

    _republish(f"{out_dir}/L128", open(manifest_path).read())
    rc, out, _ = run(out_dir)
    assert rc == 1 and "run record FAILED" not in out
    assert f"  first failure: {manifest_path}: {key} is {stated + 1}, but the rows hold {stated:,}" in out


def test_an_edited_source_count(copy_of):
    # 5 tokens moved from one source to the other: the sources still add up to the set's tokens
    # (what open_shards checks), so only the recount from the rows can see it.
    out_dir = copy_of("mix")
    manifest_path = f"{out_dir}/L256/manifest.json"
    data = json.load(open(manifest_path))
    data["mixture"]["sources"][1]["tokens"] -= 5
    data["mixture"]["sources"][0]["tokens"] += 5
    _republish(f"{out_dir}/L256", json.dumps(data, indent=2, sort_keys=True) + "\n")
    rc, out, _ = run(out_dir)
    name = data["mixture"]["sources"][0]["name"]
    assert rc == 1
    assert f"{manifest_path}: mixture.sources[0].tokens ({name}) is {data['mixture']['sources'][0]['tokens']}, but the rows hold" in out


def test_sources_that_do_not_add_up_are_refused_before_the_rows(copy_of):
    out_dir = copy_of("mix")
    manifest_path = f"{out_dir}/L256/manifest.json"
    data = json.load(open(manifest_path))
    data["mixture"]["sources"][1]["tokens"] -= 5
    _republish(f"{out_dir}/L256", json.dumps(data, indent=2, sort_keys=True) + "\n")
    rc, out, _ = run(out_dir)
    assert rc == 1
    assert (f"{manifest_path}: mixture.sources lists 2 sources whose tokens add up to {data['stats']['tokens'] - 5}, "
            f"but the set holds {data['stats']['tokens']} (stats.tokens)") in out


def test_a_length_the_run_record_does_not_name_is_checked_and_named(copy_of, outputs):
    """An older run's set beside this run's (its L64 copied in): checked like the published ones,
    and one line says it is not published; a fault in it fails the output."""
    out_dir = copy_of("plain")
    shutil.copytree(f"{outputs['split']}/L64", f"{out_dir}/L64")
    os.makedirs(f"{out_dir}/L256/.staging-run")  # a folder without a manifest is no set
    rc, out, err = run(out_dir)
    assert (rc, err) == (0, ""), out
    manifest = Manifest.from_json(open(f"{out_dir}/L64/manifest.json").read())
    assert f"L64  ok      {manifest.num_rows:,} rows" in out
    assert "L128  ok" in out and "L512  ok" in out and "L256" not in out
    unpublished = [line for line in out.splitlines() if line.startswith("not published")]
    assert unpublished == [f"not published: L64 (is a set in {out_dir} that its published.json does not name: an older "
                           "run's, checked above; a trainer reading through published.json does not see it)"]
    broken = copy_of("split")
    rc, out, _ = run(broken)
    assert rc == 0 and "not published" not in out

    _rewrite_shard(f"{broken}/L64", jump_position)
    shutil.rmtree(f"{out_dir}/L64")
    shutil.copytree(f"{broken}/L64", f"{out_dir}/L64")
    rc, out, _ = run(out_dir)
    assert rc == 1 and "L64  FAILED" in out and "position" in out


def test_a_changed_shard_byte_fails_its_sha256(copy_of):
    out_dir = copy_of("plain")
    manifest = Manifest.from_json(open(f"{out_dir}/L512/manifest.json").read())
    shard = f"{out_dir}/L512/{manifest.shards[0].path}"
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2] ^= 0x01
    open(shard, "wb").write(bytes(data))
    rc, out, _ = run(out_dir)
    assert rc == 1 and "L128  ok" in out
    assert f"  first failure: {shard}: sha256 {hashlib.sha256(data).hexdigest()} differs from the manifest's {manifest.shards[0].sha256}" in out


def test_unreadable_input_is_refused_with_one_line(tmp_path, copy_of):
    rc, out, err = run(tmp_path / "nothing")
    assert (rc, out) == (2, "")
    assert err == (f"prepack verify: {tmp_path}/nothing: neither a shard set (no manifest.json) nor an output (no "
                   "published.json); name a length's folder (OUT/L2048) or the --output of `prepack pack`\n")
    out_dir = copy_of("plain")
    open(f"{out_dir}/L128/manifest.json", "w").write("{not json")
    rc, out, err = run(f"{out_dir}/L128")
    assert (rc, out) == (2, "")
    assert err.startswith(f"prepack verify: {out_dir}/L128/manifest.json: not valid JSON")
    assert len(err.splitlines()) == 1


def test_gs_output_through_the_emulator(gcs_emulator, gcs_prefix, outputs):  # noqa: F811
    url = f"{gcs_prefix}/plain"
    for folder, _, files in os.walk(outputs["plain"]):
        for name in files:
            local = os.path.join(folder, name)
            gcs_emulator.upload_file(local, f"{url}/{os.path.relpath(local, outputs['plain'])}")
    rc, out, err = run(url)
    assert (rc, err) == (0, ""), out
    assert f"L128  ok" in out and f"{url}/L512" in out
    assert storage.is_gcs(url)


# ----------------------------------------------------------------------------- what verify used to pass (issue 47)


def _edit_manifest(out_dir: str, L: int, change) -> str:
    """Applies change(manifest dict) and republishes it (the run record's digest updated too), so
    that only the recount can tell."""
    path = f"{out_dir}/L{L}/manifest.json"
    data = json.load(open(path))
    change(data)
    _republish(f"{out_dir}/L{L}", json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def _first_failure(out_dir: str) -> str:
    rc, out, err = run(out_dir)
    assert (rc, err) == (1, ""), out
    [line] = [line for line in out.splitlines() if line.startswith("  first failure: ")]
    return line[len("  first failure: "):]


def _last_token(rows, r: int) -> int:
    return int(np.flatnonzero(rows["valid_mask"][r])[-1])


@pytest.mark.parametrize("value", [999_999_999, -5, 262_144])
def test_a_token_id_outside_the_vocabulary_fails(copy_of, value):
    out_dir = copy_of("plain")

    def outside(rows):
        rows["input_ids"][3, 5] = value
        return 3

    shard, row = _rewrite_shard(f"{out_dir}/L128", outside)
    assert _first_failure(out_dir).startswith(f"{shard}: row 3 (record 3 of the shard), segment ")
    assert _first_failure(out_dir).endswith(", token 5: input_ids must lie in the vocabulary (0 to vocab_size - 1) on every real token")


def test_padding_that_is_not_the_pad_id_fails(copy_of):
    out_dir = copy_of("plain")

    def not_pad(rows):
        r = int(np.flatnonzero(rows["valid_mask"].sum(axis=1) < rows["valid_mask"].shape[1])[0])
        rows["input_ids"][r, _last_token(rows, r) + 1] = 7
        return r

    shard, row = _rewrite_shard(f"{out_dir}/L128", not_pad)
    assert _first_failure(out_dir).startswith(f"{shard}: row {row} (record {row} of the shard), padding, token ")
    assert _first_failure(out_dir).endswith(": input_ids must be the pad id on padding")


def shift_segment_positions(rows):
    """A whole segment's positions shifted by one (1..n): each still its predecessor + 1, so only
    the rule that a segment starts at position 0 sees it."""
    r = _row_with_segments(rows, 2)
    rows["positions"][r][rows["segment_ids"][r] == 2] += 1
    return r


def test_a_segment_whose_positions_are_all_shifted_by_one_fails(copy_of):
    out_dir = copy_of("plain")
    shard, row = _rewrite_shard(f"{out_dir}/L128", shift_segment_positions)
    assert _first_failure(out_dir) == (f"{shard}: row {row} (record {row} of the shard), segment 2, token "
                                       f"{_second_segment_start(_rows_of(shard, 128), row)}: "
                                       "positions must count from 0 at every segment start, up by one")


def _rows_of(shard: str, L: int):
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(shard)
    rows = rowformat.decode_rows(reader.read_all(), L, rowformat.FIELD_NAMES)
    reader.close()
    return rows


GEMMA = "the embedded tokenizer 'gemma3' has"
EDITED = "the manifest was edited or does not describe these shards"


@pytest.mark.parametrize("change, words", [
    (lambda d: d["tokenizer"].update(vocab_size=151_936),
     f"tokenizer.special_ids['<end_of_image>'] is 256000, outside the vocabulary (0 to 151,935); {EDITED}"),
    (lambda d: d["tokenizer"].update(vocab_size=257_000),
     f"tokenizer.vocab_size is 257000, but {GEMMA} 262144; the manifest was edited, or the set was made by another "
     "gemma3 vocabulary"),
    (lambda d: d["tokenizer"].update(vocab_size=10**9),
     f"tokenizer.vocab_size is 1000000000, not a vocabulary size (an integer from 2 to 16,777,216); {EDITED}"),
    (lambda d: d["tokenizer"].update(vocab_size=300_000),
     f"tokenizer.vocab_size is 300000, but {GEMMA} 262144"),
    (lambda d: d["tokenizer"].update(pad_id=5), "tokenizer.pad_id is 5, but the embedded tokenizer 'gemma3' has 0"),
    (lambda d: d["tokenizer"].update(eos_id=262_144), f"tokenizer.eos_id is 262144, outside the vocabulary (0 to 262,143); {EDITED}"),
])
def test_an_edited_tokenizer_identity_fails(copy_of, change, words):
    out_dir = copy_of("plain")
    path = _edit_manifest(out_dir, 128, change)
    assert _first_failure(out_dir).startswith(f"{path}: {words}")


def _bump(key: str, by: int = 1):
    def change(d):
        d["stats"][key] += by
    return change


def _move_drop(d):
    """One too_long drop relabelled as a bad record: every sum still adds up; the dead letter does not."""
    d["stats"]["examples_dropped"]["too_long"] -= 1
    d["stats"]["examples_dropped"]["malformed_json"] = 1


@pytest.mark.parametrize("change, words", [
    (_bump("examples_read"), "the accounting does not add up: examples read {examples_read_plus} (- split 0 + pieces 0) "
                             "!= written {examples_written} + dropped {dropped}"),
    (lambda d: d["stats"]["examples_dropped"].update(too_long=d["stats"]["examples_dropped"]["too_long"] + 1),
     "the accounting does not add up: examples read {examples_read} (- split 0 + pieces 0) != written {examples_written} "
     "+ dropped {dropped_plus}"),
    (lambda d: [_bump("examples_read")(d), d["stats"]["examples_dropped"].update(too_long=d["stats"]["examples_dropped"]["too_long"] + 1)],
     "stats.examples_dropped is {{'too_long': {too_long_plus}}} (not_sampled aside), but the dead letter dead_letter.jsonl "
     "holds {{'too_long': {too_long}}}"),
    (_move_drop, "stats.bad_records is 0, but the rows give 1"),
    (lambda d: d["stats"].update(packed_density=0.99), "stats.packed_density is 0.99, but the rows give {packed_density!r}"),
    (lambda d: d["stats"].update(unpacked_density=0.5), "stats.unpacked_density is 0.5, but the rows give"),
    (lambda d: d["stats"].update(target_density=0.5), "stats.target_density is 0.5, but the rows give"),
    (lambda d: d["stats"].update(row_reduction=9.0), "stats.row_reduction is 9.0, but the rows give"),
    (_bump("lower_bound_rows", -1), "stats.lower_bound_rows is {lower_minus}, but the rows give {lower_bound_rows}"),
    (lambda d: d["stats"]["segments_per_row"].update(mean=3.0), "stats.segments_per_row.mean is 3.0, but the rows give"),
    (lambda d: d["stats"].update(rows_over_lower_bound=1.0), "stats.rows_over_lower_bound is 1.0, but the rows give"),
    (lambda d: d["stats"].update(bad_fraction=0.5), "stats.bad_fraction is 0.5, but the rows give 0.0"),
    (_bump("dead_letter_entries"), "stats.dead_letter_entries is {dead_plus}, but the dead letter dead_letter.jsonl holds {dead}"),
    (lambda d: d["stats"].update(bfd_rows=d["stats"]["rows"] - 1), "stats.bfd_rows is {rows_minus}, but it must be at least "
                                                                    "the rows written"),
    (lambda d: d["stats"].update(examples_truncated=10**6), "stats.examples_truncated is 1000000, but it must be at most the examples read"),
])
def test_an_edited_figure_is_found(copy_of, change, words):
    """Every stored figure verify can recount or bound: an edit that agrees with the run record's
    digest (republished) still fails, naming the key, the stated value and what the rows give."""
    out_dir = copy_of("plain")
    stats = json.load(open(f"{out_dir}/L128/manifest.json"))["stats"]
    assert stats["examples_dropped"]["too_long"] > 0 and stats["bad_records"] == 0
    path = _edit_manifest(out_dir, 128, change)
    dropped = sum(stats["examples_dropped"].values())
    expected = words.format(examples_read=stats["examples_read"], examples_read_plus=stats["examples_read"] + 1,
                            examples_written=stats["examples_written"], dropped=dropped, dropped_plus=dropped + 1,
                            dead=stats["dead_letter_entries"], dead_plus=stats["dead_letter_entries"] + 1,
                            packed_density=stats["packed_density"], lower_bound_rows=stats["lower_bound_rows"],
                            lower_minus=stats["lower_bound_rows"] - 1, rows_minus=stats["rows"] - 1,
                            too_long=stats["examples_dropped"]["too_long"], too_long_plus=stats["examples_dropped"]["too_long"] + 1)
    failure = _first_failure(out_dir)
    assert failure.startswith(f"{path}: {expected}"), failure
    assert failure.endswith(EDITED)


def _swap_names(d):
    a, b = d["mixture"]["sources"]
    a["name"], b["name"] = b["name"], a["name"]


def _swap_names_and_templates(d):
    """Names and the template's formats for them swapped to agree: only the tokenized set these rows
    came from still tells which source is which."""
    _swap_names(d)
    for source in d["mixture"]["sources"]:
        source["format"], d["template"]["sources"][source["name"]]["name"] = "alpaca", "alpaca"


def _source(k: int, **changes):
    def change(d):
        d["mixture"]["sources"][k].update({key: value(d["mixture"]["sources"][k]) for key, value in changes.items()})
    return change


@pytest.mark.parametrize("change, words", [
    (_swap_names, "mixture.sources[0] is named 'chat' with format 'alpaca', but template.sources['chat'] records format "
                  "'chat' for that name"),
    (_swap_names_and_templates, "mixture.sources are [('chat', 'alpaca'), ('alpaca', 'alpaca')] (name, format) in "
                                "source-id order, but the tokenized set these rows were packed from records [('alpaca', "
                                "'alpaca'), ('chat', 'chat')]"),
    (_source(0, examples_unique=lambda s: s["examples_unique"] - 1),
     "the accounting does not add up: mixture source 'alpaca': examples read"),
    (_source(1, examples_unique=lambda s: s["examples_written"] + 1), "mixture.sources[1].examples_unique (chat) is"),
    (lambda d: [_source(0, examples_read=lambda s: s["examples_read"] + 3)(d), _source(1, examples_read=lambda s: s["examples_read"] - 3)(d)],
     "the accounting does not add up: mixture source 'alpaca'"),
    (_source(0, requested_share=lambda s: 0.7), "mixture.sources[0] (alpaca).requested_share is 0.7, but its weights give 0.75"),
    (_source(1, realized_share=lambda s: 0.3), "mixture.sources[1] (chat).realized_share is 0.3, but its weights give"),
    (_source(0, repeats=lambda s: 1.5), "mixture.sources[0] (alpaca).repeats is 1.5, but its weights give"),
    (_source(0, written_weight=lambda s: s["written_weight"] + 7), "mixture.sources[0].written_weight (alpaca) is"),
    (_source(1, kept_weight=lambda s: s["kept_weight"] * 10), "mixture.sources[1] (chat).repeats is"),
    (lambda d: d["mixture"].update(limiting_source="chat"), "mixture.limiting_source is 'chat', but the kept weights make it"),
    (lambda d: d["stats"].update(examples_repeated=d["stats"]["examples_repeated"] + 1),
     "the accounting does not add up: examples read"),
])
def test_an_edited_mixture_figure_is_found(copy_of, change, words):
    out_dir = copy_of("mix")
    path = _edit_manifest(out_dir, 256, change)
    failure = _first_failure(out_dir)
    assert failure.startswith(f"{path}: {words}"), failure


def test_a_set_made_before_gemmas_reserved_pieces_became_special_still_passes(copy_of):
    """Sets published before the image markers were control pieces name fewer special ids: not an
    edit. A special id the manifest names wrongly is one."""
    out_dir = copy_of("plain")
    for name in ("[multimodal]", "<start_of_image>", "<end_of_image>"):
        _edit_manifest(out_dir, 128, lambda d: d["tokenizer"]["special_ids"].pop(name))
    rc, out, _ = run(out_dir)
    assert rc == 0, out
    path = _edit_manifest(out_dir, 128, lambda d: d["tokenizer"]["special_ids"].update({"<end_of_turn>": 107}))
    assert _first_failure(out_dir).startswith(f"{path}: tokenizer.special_ids['<end_of_turn>'] is 107, but the embedded "
                                              "tokenizer 'gemma3' has 106")
