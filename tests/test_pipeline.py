"""End-to-end tests of `prepack pack` on Beam's local runner, with small fixtures.

Pipeline runs are shared through module-scoped fixtures: most tests read the
published output of one run. The in-process runner is used everywhere except
the determinism check, which runs the same job on two worker processes.
"""

from __future__ import annotations

import gzip
import json
import logging
import os
import shutil
from collections import Counter

import numpy as np
import pytest

from testkit.pipeline import (
    IN_PROCESS,
    TWO_PROCESSES,
    alpaca_records,
    build_tfds_dataset,
    chat_records,
    oasst1_messages,
    prompt_response_records,
    read_shard_set,
    save_chat_dataset,
    segment_key,
    segments_in,
    shard_bytes,
    tokenized,
    translation_records,
    write_json,
    write_jsonl,
    write_parquet,
)
from pipelines.launch.job import run
from pipelines.options import parse_args
from pipelines.planning import stable_hash
from pipelines.launch.errors import JobError
from prepack.format import rowformat
from prepack.format.manifest import STABLE_KEYS, without_volatile
from prepack.text.formats import get_template
from testkit.plans import pack_best_fit_decreasing
from testkit.reference import split_segments

LENGTHS = (64, 256)


def pack(args: list[str], runner: list[str] = IN_PROCESS):
    config, beam_args = parse_args(args + ["--no-progress"] + runner)
    return run(config, beam_args)


def expected_examples(template_name: str, records: list, **options) -> list:
    template = get_template(template_name, **options)
    convs = [c for r in records for c in template.to_conversations(r)]
    return tokenized(convs)


def check_shard_set(folder: str, expected: list, max_length: int, truncate: bool = False) -> tuple:
    """Rows decode and pass check_row; every kept example is in exactly one row; rows == global BFD."""
    manifest, rows = read_shard_set(folder)
    assert manifest.max_length == max_length
    assert len(rows) == manifest.num_rows == manifest.stats["rows"]
    for row in rows:
        rowformat.check_row(row, max_length)
    kept = Counter()
    lengths = []
    for ex in expected:
        ids, mask = np.asarray(ex.input_ids), np.asarray(ex.loss_mask)
        if len(ids) > max_length:
            if not truncate or not mask[1:max_length].any():
                continue
            ids, mask = ids[:max_length], mask[:max_length]
        kept[segment_key(ids, mask)] += 1
        lengths.append(len(ids))
    assert segments_in(rows) == kept
    if manifest.packing != "unpacked":
        bfd_rows = len(pack_best_fit_decreasing(lengths, max_length, manifest.options["max_segments_per_row"]))
        assert manifest.stats["bfd_rows"] == bfd_rows
        assert manifest.num_rows <= bfd_rows
        assert manifest.num_rows == bfd_rows or manifest.packing == "exact_fill"
    assert manifest.stats["examples_written"] == sum(kept.values())
    assert manifest.stats["tokens"] == sum(lengths)
    stats = manifest.stats
    assert stats["examples_read"] == stats["examples_written"] + sum(stats["examples_dropped"].values())
    return manifest, rows


# ----------------------------------------------------------------------------- mixed JSONL + JSON + Parquet


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("inputs")
    write_jsonl(str(d / "alpaca_a.jsonl"), alpaca_records(40, seed=0))
    write_json(str(d / "alpaca_b.json"), alpaca_records(20, seed=1))
    write_parquet(str(d / "alpaca_c.parquet"), alpaca_records(20, seed=2))
    gz = write_jsonl(str(d / "alpaca_d.jsonl"), alpaca_records(10, seed=3))
    with open(gz, "rb") as src, gzip.open(gz + ".gz", "wb") as dst:
        dst.write(src.read())
    os.remove(gz)
    return d


def mixed_args(data_dir, out) -> list[str]:
    return ["--input", str(data_dir / "alpaca_a.jsonl"), "--input", str(data_dir / "alpaca_b.json"),
            "--input", str(data_dir / "*.parquet"), "--input", str(data_dir / "alpaca_d.jsonl.gz"),
            "--format", "alpaca", "--output", str(out),
            "--max-length", *map(str, LENGTHS)]


@pytest.fixture(scope="module")
def mixed_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed") / "out"
    return pack(mixed_args(data_dir, out)), out


@pytest.fixture(scope="module")
def mixed_expected():
    return expected_examples("alpaca", alpaca_records(40, 0) + alpaca_records(20, 1) + alpaca_records(20, 2)
                             + alpaca_records(10, 3))


def test_mixed_inputs_end_to_end(mixed_run, mixed_expected):
    result, out = mixed_run
    assert sorted(result.manifests) == list(LENGTHS)
    for L in LENGTHS:
        manifest, _ = check_shard_set(str(out / f"L{L}"), mixed_expected, L)
        data = json.loads((out / f"L{L}" / "manifest.json").read_text())
        for key in STABLE_KEYS:
            node = data
            for part in key.split("."):
                assert part in node, key
                node = node[part]
        stats = manifest.stats
        assert stats["examples_read"] == 90 and stats["records_read"] == 90
        assert set(stats["examples_dropped"]) <= {"too_long"}
        assert stats["lower_bound_rows"] <= stats["rows"]
        assert 0 < stats["unpacked_density"] < stats["packed_density"] <= 1
        assert manifest.tokenizer["name"] == "gemma3" and manifest.tokenizer["vocab_hash"]
        assert manifest.template["name"] == "alpaca" and manifest.template["chat_format_resolved"] == "gemma"
        assert [i["records"] for i in manifest.inputs] == [40, 20, 20, 10]
        assert all(i["fingerprint"].startswith("sha256:") for i in manifest.inputs)
        assert manifest.options["max_lengths"] == list(LENGTHS) and "output" not in manifest.options
        assert manifest.tool["name"] == "tunix-prepack"
    # The short length really packs and really drops.
    small = result.stats[64]
    assert small["examples_dropped"]["too_long"] > 0 and result.stats[256]["row_reduction"] > 3


def test_too_long_examples_are_dead_letters(mixed_run):
    result, out = mixed_run
    lines = (out / "L64" / "dead_letter.jsonl").read_text().splitlines()
    entries = [json.loads(line) for line in lines]
    assert len(entries) == result.stats[64]["examples_dropped"]["too_long"] == result.stats[64]["dead_letter_entries"]
    assert {e["reason"] for e in entries} == {"too_long"}
    assert all(e["tokens"] > 64 and e["source"]["file"] for e in entries)
    specs = [i["spec"] for i in json.loads((out / "L64" / "manifest.json").read_text())["inputs"]]
    keys = [(specs.index(e["source"]["input"]), e["source"]["record"]) for e in entries]
    assert keys == sorted(keys)


def test_determinism_one_vs_several_workers(mixed_run, data_dir, tmp_path, monkeypatch, caplog):
    """The default local runner starts one SDK worker per share of the input (here 30 examples;
    the inputs are estimated at 73, so 3 workers on a 2-core machine); the sets equal the in-process run's."""
    from pipelines.launch import local_memory

    _, out1 = mixed_run
    out2 = tmp_path / "out2"
    monkeypatch.setenv(local_memory.EXAMPLES_PER_LOCAL_WORKER_ENV, "30")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    with caplog.at_level(logging.INFO, logger="prepack.pack"):
        pack(mixed_args(data_dir, out2), runner=[])
    assert "local runner: 3 SDK worker processes for about 73 examples" in caplog.text
    for L in LENGTHS:
        a, b = out1 / f"L{L}", out2 / f"L{L}"
        assert shard_bytes(str(a)) == shard_bytes(str(b))
        assert without_volatile((a / "manifest.json").read_text()) == without_volatile((b / "manifest.json").read_text())
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))


def test_segment_cap_and_planner_one_vs_two_workers(data_dir, tmp_path, mixed_expected):
    """--max-segments-per-row 3: no row holds more than 3 segments, the rows are the capped
    plan's (stats.bfd_rows is capped BFD's), both options are in the manifest, and 1 vs 2
    workers write the same bytes; --planner bfd gives BFD's rows."""
    outs = {}
    for name, extra, runner in (("one", [], IN_PROCESS), ("two", [], TWO_PROCESSES), ("bfd", ["--planner", "bfd"], IN_PROCESS)):
        outs[name] = tmp_path / name
        pack(mixed_args(data_dir, outs[name]) + ["--max-segments-per-row", "3", *extra], runner=runner)
    for L in LENGTHS:
        manifest, rows = check_shard_set(str(outs["one"] / f"L{L}"), mixed_expected, L)
        assert manifest.options["max_segments_per_row"] == 3 and manifest.options["planner"] == "best"
        assert max(len(split_segments(row)) for row in rows) == manifest.stats["segments_per_row"]["max"] <= 3
        assert shard_bytes(str(outs["one"] / f"L{L}")) == shard_bytes(str(outs["two"] / f"L{L}"))
        a, b = (outs[k] / f"L{L}" / "manifest.json" for k in ("one", "two"))
        assert without_volatile(a.read_text()) == without_volatile(b.read_text())
        bfd, _ = check_shard_set(str(outs["bfd"] / f"L{L}"), mixed_expected, L)
        assert bfd.packing == "bfd" and bfd.options["planner"] == "bfd"
        assert bfd.num_rows == bfd.stats["bfd_rows"] == manifest.stats["bfd_rows"] >= manifest.num_rows
    assert manifest.stats["segments_per_row"]["max"] == 3  # at L 256 the cap binds (uncapped rows hold more)


def test_a_plan_past_the_fill_budget_is_bfds_and_says_so(mixed_run, data_dir, tmp_path, mixed_expected, monkeypatch):
    """When --planner best's exact fill runs past its work budget, BFD makes the rows and the
    manifest says why (stats.planner_fallback "budget"); a run within the budget has no such key."""
    from prepack.packing import exact_fill

    _, fed_out = mixed_run  # the same job within the budget
    monkeypatch.setattr(exact_fill, "DEFAULT_BUDGET_CELLS", 1)
    pack(mixed_args(data_dir, tmp_path / "starved"))
    for L in LENGTHS:
        fed, _ = check_shard_set(str(fed_out / f"L{L}"), mixed_expected, L)
        starved, _ = check_shard_set(str(tmp_path / "starved" / f"L{L}"), mixed_expected, L)
        assert "planner_fallback" not in fed.stats
        assert starved.stats["planner_fallback"] == "budget" and starved.packing == "bfd"
        assert starved.num_rows == starved.stats["bfd_rows"] == fed.stats["bfd_rows"]


def expected_split_segments(expected: list, max_length: int) -> tuple[Counter, dict]:
    """--overlong split as the issue states it, written out independently of split_pieces: an
    example longer than L is cut at L, 2L, ...; a piece keeps its own ids and loss mask; a piece
    with no target after its first token is dropped. (segments, counts) at one L."""
    kept, counts = Counter(), Counter()
    for ex in expected:
        ids, mask = list(ex.input_ids), list(ex.loss_mask)
        if len(ids) <= max_length:
            kept[segment_key(ids, mask)] += 1
            continue
        counts["examples_split"] += 1
        pieces = [(ids[a:a + max_length], mask[a:a + max_length]) for a in range(0, len(ids), max_length)]
        assert [t for p, _ in pieces for t in p] == ids and [m for _, p in pieces for m in p] == mask  # reassembles
        counts["split_pieces"] += len(pieces)
        for p_ids, p_mask in pieces:
            if any(p_mask[1:]):
                kept[segment_key(p_ids, p_mask)] += 1
            else:
                counts["no_targets_after_split"] += 1
    return kept, counts


def test_overlong_split_pieces_one_vs_two_workers_and_unpacked(data_dir, tmp_path, mixed_expected):
    """--overlong split: the rows hold exactly the pieces (each piece's ids and loss mask are its
    example's, no target on its first token, positions from 0), every token of a kept piece is
    written once, the counts and the accounting identity hold, 1 vs 2 workers write the same
    bytes, and with --no-pack each piece is a row of its own."""
    outs = {}
    for name, extra, runner in (("one", [], IN_PROCESS), ("two", [], TWO_PROCESSES), ("unpacked", ["--no-pack"], IN_PROCESS)):
        outs[name] = tmp_path / name
        pack(mixed_args(data_dir, outs[name]) + ["--overlong", "split", *extra], runner=runner)
    for L in LENGTHS:
        want, counts = expected_split_segments(mixed_expected, L)
        for name in ("one", "unpacked"):
            manifest, rows = read_shard_set(str(outs[name] / f"L{L}"))
            for row in rows:
                rowformat.check_row(row, L)
                for k in range(1, int(row["segment_ids"].max()) + 1):
                    at = np.flatnonzero(row["segment_ids"] == k)
                    assert row["positions"][at].tolist() == list(range(len(at)))  # each piece starts at 0
            assert segments_in(rows) == want
            stats = manifest.stats
            assert stats["examples_split"] == counts["examples_split"] and (counts["examples_split"] > 0 or L > 64)
            assert stats["split_pieces"] == counts["split_pieces"]
            assert stats["examples_dropped"].get("no_targets_after_split", 0) == counts["no_targets_after_split"]
            assert stats["examples_written"] == sum(want.values())
            assert stats["tokens"] == sum(len(k[0]) * c for k, c in want.items())
            assert (stats["examples_read"] - stats["examples_split"] + stats["split_pieces"]
                    == stats["examples_written"] + sum(stats["examples_dropped"].values()))
            assert manifest.options["overlong"] == "split"
            dead = outs[name] / f"L{L}" / "dead_letter.jsonl"
            reasons = Counter(json.loads(line)["reason"] for line in dead.read_text().splitlines()) if dead.exists() else {}
            assert reasons.get("no_targets_after_split", 0) == counts["no_targets_after_split"]
            if name == "unpacked":
                assert manifest.num_rows == stats["examples_written"] and all(int(r["segment_ids"].max()) == 1 for r in rows)
        assert shard_bytes(str(outs["one"] / f"L{L}")) == shard_bytes(str(outs["two"] / f"L{L}"))
        a, b = (outs[k] / f"L{L}" / "manifest.json" for k in ("one", "two"))
        assert without_volatile(a.read_text()) == without_volatile(b.read_text())


def test_refuses_to_overwrite(mixed_run, data_dir):
    _, out = mixed_run
    with pytest.raises(JobError, match=r"already exist.*--overwrite"):
        pack(mixed_args(data_dir, out))


def test_interrupted_run_publishes_nothing(mixed_run, data_dir, tmp_path, monkeypatch):
    from prepack.text.formats import alpaca as templates

    # The job takes single-turn templates through to_pair (the fast path); fail both ways in.
    originals = {name: getattr(templates.AlpacaTemplate, name) for name in ("to_pair", "to_conversations")}

    def failing(name):
        def method(self, record):
            if str(record.get("instruction", "")).startswith("Task 7:"):
                raise RuntimeError("injected failure inside a DoFn")
            return originals[name](self, record)
        return method

    for name in originals:
        monkeypatch.setattr(templates.AlpacaTemplate, name, failing(name))
    # A fresh output: no manifest, no shards, no staging left behind.
    fresh = tmp_path / "fresh"
    with pytest.raises(Exception, match="injected failure"):
        pack(mixed_args(data_dir, fresh))
    leftovers = [os.path.join(r, f) for r, _, files in os.walk(fresh) for f in files] if fresh.exists() else []
    assert leftovers == []
    # An existing shard set with --overwrite: the old set stays intact.
    _, published = mixed_run
    old = tmp_path / "old"
    shutil.copytree(published, old)
    before = {L: (shard_bytes(str(old / f"L{L}")), (old / f"L{L}" / "manifest.json").read_text()) for L in LENGTHS}
    with pytest.raises(Exception, match="injected failure"):
        pack(mixed_args(data_dir, old) + ["--overwrite"])
    for L in LENGTHS:
        assert (shard_bytes(str(old / f"L{L}")), (old / f"L{L}" / "manifest.json").read_text()) == before[L]
        assert not [n for n in os.listdir(old / f"L{L}") if n.startswith(".staging")]


# ----------------------------------------------------------------------------- bad input


BAD_LINES = [
    b'{"instruction": "broken", "output": ',                                   # line 7: malformed_json
    b'\xff\xfe{"instruction": "x"}',                                           # line 8: undecodable_bytes
    json.dumps({"instruction": "Say nothing", "output": "  "}).encode(),       # line 9: empty_response
    json.dumps({"instruction": 5, "output": "five"}).encode(),                 # line 10: wrong_type
    json.dumps({"output": "no instruction"}).encode(),                         # line 11: missing_field
    b"[1, 2, 3]",                                                              # line 12: not_an_object
]
EXPECTED_BAD = [(7, "malformed_json", ""), (8, "undecodable_bytes", ""), (9, "empty_response", "output"),
                (10, "wrong_type", "instruction"), (11, "missing_field", "instruction"), (12, "not_an_object", "")]


@pytest.fixture(scope="module")
def dirty_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("dirty")
    good = alpaca_records(6, seed=5)
    # Line 13: a prompt longer than L, so truncation leaves no target.
    long_prompt = {"instruction": "Explain " + " ".join(["everything"] * 120), "input": "", "output": "No."}
    return write_jsonl(str(d / "dirty.jsonl"), good, BAD_LINES + [json.dumps(long_prompt).encode()]), good, long_prompt


def test_dead_letter_contents_and_truncation(dirty_file, tmp_path):
    path, good, long_prompt = dirty_file
    out = tmp_path / "out"
    result = pack(["--input", path, "--format", "alpaca", "--output", str(out), "--max-length", "64",
                   "--overlong", "truncate", "--max-bad-fraction", "0.5"])
    stats = result.stats[64]
    assert stats["examples_read"] == 13 and stats["bad_records"] == 6
    assert stats["examples_dropped"] == {
        "empty_response": 1, "malformed_json": 1, "missing_field": 1, "no_targets_after_truncation": 1,
        "not_an_object": 1, "undecodable_bytes": 1, "wrong_type": 1}
    assert stats["examples_truncated"] > 0
    check_shard_set(str(out / "L64"), expected_examples("alpaca", good + [long_prompt]), 64, truncate=True)
    entries = [json.loads(line) for line in (out / "L64" / "dead_letter.jsonl").read_text().splitlines()]
    got = [(e["source"]["line"], e["reason"], e["field"]) for e in entries]
    assert got == EXPECTED_BAD + [(13, "no_targets_after_truncation", "")]
    for e in entries:
        assert set(e) >= {"reason", "field", "message", "source", "raw"}
        assert e["source"]["file"] == path and e["source"]["input"] == path
        assert e["message"]
    assert entries[0]["raw"].startswith('{"instruction": "broken"')
    assert "\\xff" in entries[1]["raw"]


def test_bad_fraction_fails_with_a_clear_message(dirty_file, tmp_path):
    path, _, _ = dirty_file
    out = tmp_path / "out"
    with pytest.raises(JobError) as err:
        pack(["--input", path, "--format", "alpaca", "--output", str(out), "--max-length", "64"])
    message = str(err.value)
    assert "6 of 13 examples read are bad records" in message and "--max-bad-fraction 0" in message
    assert "malformed_json 1" in message and "Nothing was published" in message
    assert not (out / "L64" / "manifest.json").exists()
    assert not [n for n in os.listdir(out / "L64") if n.endswith(".array_record")]
    failed = out / "L64" / "dead_letter.failed.jsonl"
    reasons = Counter(json.loads(line)["reason"] for line in failed.read_text().splitlines())
    assert str(failed) in message and sum(v for k, v in reasons.items() if k != "too_long") == 6


# ----------------------------------------------------------------------------- other formats and containers


def test_translation_both_shapes_via_cli(tmp_path, capsys):
    from pipelines.launch.cli import main

    path = write_jsonl(str(tmp_path / "pairs.jsonl"), translation_records())
    out = tmp_path / "out"
    code = main(["--input", path, "--format", "translation", "--source-lang", "en", "--target-lang", "de",
                 "--output", str(out), "--max-length", "128", "--no-progress", *IN_PROCESS])
    assert code == 0
    printed = capsys.readouterr().out
    assert "packed dens." in printed and "row reduction" in printed and str(out / "L128" / "manifest.json") in printed
    expected = expected_examples("translation", translation_records(), source_lang="en", target_lang="de")
    manifest, rows = check_shard_set(str(out / "L128"), expected, 128)
    assert manifest.stats["examples_written"] == 14
    assert manifest.template["options"] == {"source_lang": "en", "target_lang": "de"}
    from prepack.text.tokenizer import load_tokenizer

    text = load_tokenizer("gemma3").decode(rows[0]["input_ids"][rows[0]["valid_mask"] == 1])
    assert "from English to German" in text


def test_oasst1_message_table(tmp_path):
    path = write_jsonl(str(tmp_path / "oasst1.jsonl"), oasst1_messages())
    out = tmp_path / "out"
    result = pack(["--input", path, "--format", "oasst1", "--output", str(out), "--max-length", "256",
                   "--max-bad-fraction", "0.5"])
    stats = result.stats[256]
    assert stats["records_read"] == 10
    assert stats["records_filtered"] == {"not_english": 2}
    assert stats["examples_read"] == 5 and stats["examples_written"] == 4
    assert stats["examples_dropped"] == {"bad_role": 1}
    entries = [json.loads(line) for line in (out / "L256" / "dead_letter.jsonl").read_text().splitlines()]
    assert [(e["reason"], e["source"]["line"], e["message_id"]) for e in entries] == [("bad_role", 9, "c2")]
    assert '"role": "robot"' in entries[0]["raw"]
    from prepack.text.formats.oasst1 import oasst1_conversations

    convs = [c for c, _ in oasst1_conversations(oasst1_messages())]
    check_shard_set(str(out / "L256"), tokenized(convs), 256)


def test_chat_from_save_to_disk_folder_and_its_arrow_file(tmp_path):
    folder = save_chat_dataset(str(tmp_path / "chat_ds"), chat_records())
    out = tmp_path / "out"
    result = pack(["--input", folder, "--input", os.path.join(folder, "*.arrow"), "--format", "chat",
                   "--output", str(out), "--max-length", "128"])
    assert result.stats[128]["examples_read"] == 24
    manifest, _ = check_shard_set(str(out / "L128"), expected_examples("chat", chat_records() * 2), 128)
    assert [i["kind"] for i in manifest.inputs] == ["hf_disk", "files"]
    assert manifest.inputs[0]["fingerprint"].startswith("datasets:") and manifest.inputs[1]["fingerprint"].startswith("sha256:")


def test_prompt_response_from_tfds_unpacked(tmp_path):
    records = prompt_response_records()
    data_dir = str(tmp_path / "tfds")
    name = build_tfds_dataset(data_dir, records)
    out = tmp_path / "out"
    result = pack(["--input", f"tfds:{name}:train", "--tfds-data-dir", data_dir, "--format", "prompt_response",
                   "--output", str(out), "--max-length", "128", "--no-pack", "--num-shards", "2"])
    stats = result.stats[128]
    assert stats["examples_read"] == 15 and stats["rows"] == stats["examples_written"]
    manifest, _ = check_shard_set(str(out / "L128"), expected_examples("prompt_response", records), 128)
    assert manifest.packing == "unpacked" and len(manifest.shards) == 2
    # One example per row, rows in stable-hash order of the example ids (shards hold contiguous runs of rows).
    import tensorflow_datasets as tfds

    source = tfds.data_source(name, split="train", data_dir=data_dir)
    stored = [{k: v.decode() for k, v in source[i].items()} for i in range(len(source))]
    ids = [f"0/train/{i}" for i in range(len(stored))]
    order = sorted(range(len(stored)), key=lambda i: (stable_hash(ids[i]), ids[i]))
    want = [segment_key(ex.input_ids, ex.loss_mask) for ex in expected_examples("prompt_response", [stored[i] for i in order])]
    by_shard = [read_shard_set_rows(out / "L128", s) for s in range(2)]
    assert [len(rows) for rows in by_shard] == [7, 8]  # 15 rows: shard s holds rows [s * 15 // 2, (s + 1) * 15 // 2)
    rows = by_shard[0] + by_shard[1]
    assert [segment_key(*_only_segment(row)) for row in rows] == want


def read_shard_set_rows(folder, shard: int) -> list:
    from array_record.python.array_record_module import ArrayRecordReader

    manifest = json.loads((folder / "manifest.json").read_text())
    reader = ArrayRecordReader(str(folder / manifest["shards"][shard]["path"]))
    try:
        return [rowformat.decode_row(r, 128) for r in reader.read_all()]
    finally:
        reader.close()


def _only_segment(row) -> tuple:
    (seg,) = split_segments(row)
    return seg.input_ids, seg.loss_mask


# ----------------------------------------------------------------------------- fail fast


def test_fail_fast_before_any_work(tmp_path, data_dir):
    good = str(data_dir / "alpaca_a.jsonl")
    out = str(tmp_path / "out")
    cases = [
        (["--input", str(tmp_path / "missing.jsonl"), "--format", "alpaca"], r"missing\.jsonl.*no such file"),
        (["--input", str(tmp_path / "*.jsonl"), "--format", "alpaca"], r"matches no file"),
        (["--input", good, "--format", "alpaca", "--tokenizer", "sp:/nonexistent/tok.model"], r"tokenizer.*nonexistent"),
        (["--input", "tfds:no_such_dataset_xyz", "--tfds-data-dir", str(tmp_path / "tfds"), "--format", "alpaca"], r"no_such_dataset_xyz"),
    ]
    for args, pattern in cases:
        with pytest.raises(JobError, match=pattern):
            pack(args + ["--output", out])
    from pipelines.options import OptionsError

    with pytest.raises(OptionsError, match=r"^--format: unknown source format 'alpacca'; expected one of alpaca, .*, or auto$"):
        pack(["--input", good, "--format", "alpacca", "--output", out])
    assert not os.path.exists(out) or not [f for _, _, fs in os.walk(out) for f in fs]


def test_hub_input_fails_fast_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    try:
        import socket

        socket.create_connection(("huggingface.co", 443), timeout=3).close()
        pytest.skip("the Hugging Face Hub is reachable here")
    except OSError:
        pass
    with pytest.raises(JobError, match="cannot reach the Hugging Face Hub"):
        pack(["--input", "hf:OpenAssistant/oasst1:train", "--format", "oasst1", "--output", str(tmp_path / "o")])


def test_unpacked_with_overlong_examples(data_dir, tmp_path):
    """--no-pack applies the overlong policy per L like packing does (truncate here)."""
    out = tmp_path / "out"
    path = str(data_dir / "alpaca_a.jsonl")
    result = pack(["--input", path, "--format", "alpaca", "--output", str(out), "--max-length", "64",
                   "--no-pack", "--overlong", "truncate"])
    stats = result.stats[64]
    assert stats["examples_truncated"] > 0 and stats["rows"] == stats["examples_written"]
    check_shard_set(str(out / "L64"), expected_examples("alpaca", alpaca_records(40, seed=0)), 64, truncate=True)


# ----------------------------------------------------------------------------- JSONL byte ranges


@pytest.fixture
def tiny_ranges(monkeypatch):
    """Splits every plain JSONL file into ranges of a few hundred bytes (lines cross them)."""
    from pipelines.inputs import sources

    monkeypatch.setattr(sources, "JSONL_RANGE_MIN_BYTES", 300)
    monkeypatch.setattr(sources, "JSONL_RANGES_PER_FILE", 10_000)


def test_byte_ranges_keep_records_dead_letters_and_counts(dirty_file, tmp_path, tiny_ranges):
    path, good, long_prompt = dirty_file
    from pipelines.inputs.sources import resolve_inputs

    assert len(resolve_inputs([path])[1]) > 5  # really split
    args = ["--input", path, "--format", "alpaca", "--max-length", "64", "--overlong", "truncate", "--max-bad-fraction", "0.5"]
    result = pack(args + ["--output", str(tmp_path / "ranged")])
    stats = result.stats[64]
    assert stats["examples_read"] == 13 and stats["bad_records"] == 6 and stats["examples_truncated"] > 0
    check_shard_set(str(tmp_path / "ranged" / "L64"), expected_examples("alpaca", good + [long_prompt]), 64, truncate=True)
    entries = [json.loads(line) for line in (tmp_path / "ranged" / "L64" / "dead_letter.jsonl").read_text().splitlines()]
    # Lines and records are the file's, as when the file is read whole.
    assert [(e["source"]["line"], e["reason"], e["field"]) for e in entries] == EXPECTED_BAD + [(13, "no_targets_after_truncation", "")]
    assert [e["source"]["record"] for e in entries] == list(range(6, 13))
    manifest = json.loads((tmp_path / "ranged" / "L64" / "manifest.json").read_text())
    assert manifest["inputs"][0]["records"] == 13


def test_byte_ranges_one_vs_two_workers(tmp_path, tiny_ranges):
    path = write_jsonl(str(tmp_path / "a.jsonl"), alpaca_records(60, seed=7), [b"", b"  ", b"{bad"])
    args = ["--input", path, "--format", "alpaca", "--max-length", "128", "--max-bad-fraction", "0.1"]
    one = pack(args + ["--output", str(tmp_path / "one")])
    pack(args + ["--output", str(tmp_path / "two")], runner=TWO_PROCESSES)
    a, b = tmp_path / "one" / "L128", tmp_path / "two" / "L128"
    assert one.stats[128]["examples_read"] == 61
    assert shard_bytes(str(a)) == shard_bytes(str(b))
    assert without_volatile((a / "manifest.json").read_text()) == without_volatile((b / "manifest.json").read_text())
    assert (a / "dead_letter.jsonl").read_text() == (b / "dead_letter.jsonl").read_text()
    check_shard_set(str(a), expected_examples("alpaca", alpaca_records(60, seed=7)), 128)


# 50 records at three max lengths, cut to L, in small shards: one in-process run, which the
# two-worker runs below (default and tiny write windows) must equal byte for byte.
SMALL_SHARDS_RECORDS = alpaca_records(50, seed=11)


def small_shards_args(path) -> list[str]:
    return ["--input", path, "--format", "alpaca", "--max-length", "64", "128", "512", "--overlong", "truncate",
            "--target-shard-mb", "0.004"]


@pytest.fixture(scope="module")
def small_shards_run(tmp_path_factory):
    d = tmp_path_factory.mktemp("small-shards")
    path = write_jsonl(str(d / "a.jsonl"), SMALL_SHARDS_RECORDS)
    return pack(small_shards_args(path) + ["--output", str(d / "one")]), path, d / "one"


def test_shard_counts_differ_per_length_truncate_one_vs_two_workers(small_shards_run, tmp_path):
    """Writers are keyed by shard index across max lengths: with a different number of shards
    per L (and examples cut to L), every L still gets exactly its rows, whatever the workers."""
    records = SMALL_SHARDS_RECORDS
    one, path, one_out = small_shards_run
    pack(small_shards_args(path) + ["--output", str(tmp_path / "two")], runner=TWO_PROCESSES)
    counts = {L: len(json.loads((one_out / f"L{L}" / "manifest.json").read_text())["shards"]) for L in (64, 128, 512)}
    assert len(set(counts.values())) > 1 and max(counts.values()) > 1, counts
    for L in (64, 128, 512):
        a, b = one_out / f"L{L}", tmp_path / "two" / f"L{L}"
        check_shard_set(str(a), expected_examples("alpaca", records), L, truncate=True)
        assert shard_bytes(str(a)) == shard_bytes(str(b))
        assert without_volatile((a / "manifest.json").read_text()) == without_volatile((b / "manifest.json").read_text())
    assert one.stats[64]["examples_truncated"] > 0


def test_tiny_write_windows_write_the_same_bytes(small_shards_run, tmp_path, monkeypatch):
    """Rows are written window by window (part files streamed into the shard): with windows of
    200 row slots (one row per window at L=512, a few at L=64) across two workers, the shards,
    manifests and dead letters are byte-identical to the default windows in one process."""
    from pipelines.planning import WINDOW_TOKENS_ENV

    records = SMALL_SHARDS_RECORDS
    _, path, default_out = small_shards_run
    monkeypatch.setenv(WINDOW_TOKENS_ENV, "200")
    pack(small_shards_args(path) + ["--output", str(tmp_path / "tiny")], runner=TWO_PROCESSES)
    for L in (64, 128, 512):
        a, b = default_out / f"L{L}", tmp_path / "tiny" / f"L{L}"
        check_shard_set(str(b), expected_examples("alpaca", records), L, truncate=True)
        assert shard_bytes(str(a)) == shard_bytes(str(b))
        assert without_volatile((a / "manifest.json").read_text()) == without_volatile((b / "manifest.json").read_text())
        assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    assert not list((tmp_path / "tiny").glob(".staging-*")), "part files must go with the run's staging prefix"


def test_lost_elements_end_the_job_with_one_line(tmp_path, monkeypatch):
    """A write window whose elements never arrive (fault hook: as a runner losing grouped
    elements would) is caught by the shard check: JobError with one line, nothing published."""
    from pipelines.planning import WINDOW_TOKENS_ENV
    from pipelines.stages.write import FAULT_DROP_WINDOW_ENV

    path = write_jsonl(str(tmp_path / "a.jsonl"), alpaca_records(40, seed=3))
    monkeypatch.setenv(WINDOW_TOKENS_ENV, "512")  # L=128: 4 rows per window
    monkeypatch.setenv(FAULT_DROP_WINDOW_ENV, "0:1")
    out = tmp_path / "out"
    with pytest.raises(JobError) as caught:
        pack(["--input", path, "--format", "alpaca", "--max-length", "128", "--output", str(out)])
    message = str(caught.value)
    assert message.startswith("the shard check failed, nothing was published, the previous shard sets are intact: "
                              "L=128: shard 0 lacks the rows of write windows [1] (starting at rows [4])")
    assert "\n" not in message and "Traceback" not in message and "multi_processing" in message
    assert not (out / "L128" / "manifest.json").exists()


def test_several_sub_buckets_thousands_of_records_one_vs_two_workers(tmp_path):
    """3,000 records, 6 sub-buckets, two max lengths under truncate: in-process and on two
    worker processes (other bundles, other arrival orders at the routing step) the job writes
    the same bytes, and its rows are the global BFD rows with every kept example once."""
    records = alpaca_records(3000, seed=21)
    path = write_jsonl(str(tmp_path / "a.jsonl"), records)
    args = ["--input", path, "--format", "alpaca", "--max-length", "64", "256", "--overlong", "truncate",
            "--sub-buckets", "6"]
    one = pack(args + ["--output", str(tmp_path / "one")])
    pack(args + ["--output", str(tmp_path / "two")], runner=TWO_PROCESSES)
    expected = expected_examples("alpaca", records)
    for L in (64, 256):
        a, b = tmp_path / "one" / f"L{L}", tmp_path / "two" / f"L{L}"
        manifest, _ = check_shard_set(str(a), expected, L, truncate=True)
        assert manifest.options["sub_buckets"] == 6
        assert shard_bytes(str(a)) == shard_bytes(str(b))
        assert without_volatile((a / "manifest.json").read_text()) == without_volatile((b / "manifest.json").read_text())
    assert one.stats[64]["examples_read"] == 3000 and one.stats[64]["examples_truncated"] > 0
