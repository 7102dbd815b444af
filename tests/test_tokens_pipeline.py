"""The tokenized set end to end: a full run publishes OUTPUT/tokens, and `--from-tokens`
packs new max lengths from it into exactly the shard sets a full run makes.

One full run (L 48 and 64, bad records, an example longer than both) makes the set that
every test here packs from; each --from-tokens result is compared byte for byte with a
full run at the same options (`--no-tokens`).
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from testkit.pipeline import IN_PROCESS, TWO_PROCESSES, alpaca_records, oasst1_messages, shard_bytes, write_jsonl
from pipelines.launch.job import run
from pipelines.options import parse_args
from pipelines.launch.errors import JobError
from prepack.format.manifest import without_volatile
from prepack.format.tokenset import TokenSetManifest

FIRST_LENGTHS = ("48", "64")
BAD_LINES = [b'{"instruction": "broken", "output": ', json.dumps({"output": "no instruction"}).encode()]
LONG = {"instruction": "Explain " + " ".join(["everything"] * 120), "input": "", "output": "All of it, briefly."}


def pack(args: list[str], runner: list[str] = IN_PROCESS):
    config, beam_args = parse_args(args + ["--no-progress"] + runner)
    return run(config, beam_args)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens-in")
    return write_jsonl(str(d / "alpaca.jsonl"), alpaca_records(30, seed=7) + [LONG], BAD_LINES)


def source_args(source: str) -> list[str]:
    return ["--input", source, "--format", "alpaca", "--max-bad-fraction", "0.5"]


@pytest.fixture(scope="module")
def first(source, tmp_path_factory):
    out = tmp_path_factory.mktemp("tokens-first") / "out"
    pack(source_args(source) + ["--output", str(out), "--max-length", *FIRST_LENGTHS])
    return out


def read_tokens_manifest(folder) -> TokenSetManifest:
    return TokenSetManifest.from_json((folder / "manifest.json").read_text())


def test_full_run_publishes_the_tokenized_set(first):
    from array_record.python.array_record_module import ArrayRecordReader

    from prepack.format.tokenset import decode_batch

    tokens = first / "tokens"
    manifest = read_tokens_manifest(tokens)
    assert sorted(os.listdir(tokens)) == sorted(["manifest.json", manifest.dropped] + [s.path for s in manifest.shards])
    stats = manifest.stats
    # 31 good examples (one longer than every max length of the run, kept), 2 bad records.
    assert stats["examples_read"] == 33 and stats["examples_kept"] == manifest.num_examples == 31
    assert stats["examples_dropped"] == {"malformed_json": 1, "missing_field": 1}
    assert manifest.choices["format"] == "alpaca" and manifest.tokenizer["name"] == "gemma3"
    assert manifest.tokenizer["vocab_hash"] and "special_ids" in manifest.tokenizer
    assert manifest.inputs[0]["fingerprint"].startswith("sha256:")
    assert stats["bytes"] == manifest.num_bytes and stats["bytes_per_token"] == manifest.num_bytes / manifest.tokens
    records = []
    for s in manifest.shards:
        reader = ArrayRecordReader(str(tokens / s.path))
        records += reader.read_all()
        reader.close()
    decoded = decode_batch(records)
    assert int(decoded.lens.sum()) == manifest.tokens and int(decoded.mask.sum()) == manifest.target_tokens
    assert int(decoded.lens.max()) > int(FIRST_LENGTHS[-1])  # the long example is kept
    dropped = [json.loads(line) for line in (tokens / manifest.dropped).read_text().splitlines()]
    assert [entry["reason"] for _, entry in dropped] == ["malformed_json", "missing_field"]


def assert_same_as_full(from_out, full_out, L: int, tokens_folder) -> None:
    a, b = from_out / f"L{L}", full_out / f"L{L}"
    assert shard_bytes(str(a)) == shard_bytes(str(b))  # shards and dead letter, byte for byte
    got, want = without_volatile((a / "manifest.json").read_text()), without_volatile((b / "manifest.json").read_text())
    lineage = got.pop("lineage")
    assert want.pop("lineage") is None
    assert got == want
    assert lineage["from_tokens"] == str(tokens_folder)
    assert lineage["tokens_created_at"] == read_tokens_manifest(tokens_folder).created_at


@pytest.mark.parametrize("options,runner", [
    (["--max-length", "256"], IN_PROCESS),
    (["--max-length", "256", "--no-pack"], IN_PROCESS),
    (["--max-length", "40", "--overlong", "truncate"], IN_PROCESS),
    (["--max-length", "32", "256", "--num-shards", "2"], TWO_PROCESSES),
], ids=["packed", "no-pack", "truncate", "two-lengths-two-workers"])
def test_from_tokens_equals_a_full_run(first, source, tmp_path, options, runner):
    from_out, full_out = tmp_path / "from", tmp_path / "full"
    result = pack(["--from-tokens", str(first / "tokens"), "--max-bad-fraction", "0.5", "--output", str(from_out)] + options, runner)
    pack(source_args(source) + ["--output", str(full_out), "--no-tokens"] + options)
    assert not (full_out / "tokens").exists() and not (from_out / "tokens").exists()
    for L in result.manifests:
        assert_same_as_full(from_out, full_out, L, first / "tokens")
    stats = next(iter(result.stats.values()))
    assert stats["examples_read"] == stats["examples_written"] + sum(stats["examples_dropped"].values())


def test_from_tokens_of_a_split_run_equals_a_full_run(source, tmp_path):
    """A tokenized set made by an --overlong split run packs again at its own max length into the
    full run's shards (row format 3, example_targets included): the split counts its tally
    stored were counted again, not twice."""
    split_out, from_out, full_out = tmp_path / "split", tmp_path / "from", tmp_path / "full"
    options = ["--max-length", "48", "--overlong", "split"]
    pack(source_args(source) + ["--output", str(split_out)] + options)
    stored = read_tokens_manifest(split_out / "tokens").job["tally"]
    assert all(not per.get("split") for per in stored.get("per_length", {}).values())
    result = pack(["--from-tokens", str(split_out / "tokens"), "--max-bad-fraction", "0.5", "--output", str(from_out)] + options)
    pack(source_args(source) + ["--output", str(full_out), "--no-tokens"] + options)
    assert_same_as_full(from_out, full_out, 48, split_out / "tokens")
    assert json.loads((from_out / "L48" / "manifest.json").read_text())["format_version"] == 3
    assert result.stats[48]["examples_split"] > 0


@pytest.mark.parametrize("case", ["oasst1-table", "jsonl-byte-ranges"])
def test_from_tokens_equals_a_full_run_for_tables_and_byte_ranges(case, source, tmp_path, monkeypatch):
    """oasst1: examples made per message tree, messages filtered by design and a bad role; byte
    ranges: records and lines numbered per range, made file-relative in the dead letters."""
    if case == "oasst1-table":
        path = write_jsonl(str(tmp_path / "oasst1.jsonl"), oasst1_messages())
        args = ["--input", path, "--format", "oasst1", "--max-bad-fraction", "0.5"]
    else:
        from pipelines.inputs import sources

        monkeypatch.setattr(sources, "JSONL_RANGE_MIN_BYTES", 300)
        monkeypatch.setattr(sources, "JSONL_RANGES_PER_FILE", 10_000)
        args = source_args(source)
        assert len(sources.resolve_inputs([source])[1]) > 5
    first_out, from_out, full_out = tmp_path / "first", tmp_path / "from", tmp_path / "full"
    pack(args + ["--output", str(first_out), "--max-length", "32"])
    tokens = read_tokens_manifest(first_out / "tokens")
    if case == "oasst1-table":
        assert tokens.stats["records_filtered"] and tokens.stats["examples_dropped"]
    pack(["--from-tokens", str(first_out / "tokens"), "--max-bad-fraction", "0.5", "--output", str(from_out),
          "--max-length", "256"])
    pack(args + ["--output", str(full_out), "--max-length", "256", "--no-tokens"])
    assert (full_out / "L256" / "dead_letter.jsonl").read_text()
    assert_same_as_full(from_out, full_out, 256, first_out / "tokens")


def test_from_tokens_never_reads_the_inputs_or_loads_the_tokenizer(first, source, tmp_path, monkeypatch):
    import prepack.text.tokenizer

    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded")

    monkeypatch.setattr(prepack.text.tokenizer, "load_tokenizer", refuse)
    moved = tmp_path / "elsewhere.jsonl"
    shutil.move(source, moved)  # the inputs are gone
    try:
        result = pack(["--from-tokens", str(first / "tokens"), "--max-bad-fraction", "0.5", "--output", str(tmp_path / "out"), "--max-length", "128"])
    finally:
        shutil.move(moved, source)
    assert result.stats[128]["examples_read"] == 33


# ----------------------------------------------------------------------------- refusals


def copy_tokens(first, tmp_path):
    folder = tmp_path / "tokens"
    shutil.copytree(first / "tokens", folder)
    return folder


def refused(args: list[str], tmp_path) -> str:
    with pytest.raises(JobError) as err:
        pack(args + ["--output", str(tmp_path / "out"), "--max-length", "128"])
    assert not (tmp_path / "out" / "L128" / "manifest.json").exists()
    return str(err.value)


@pytest.mark.parametrize("extra,message", [
    (["--tokenizer", "sp:other.model"], "--tokenizer sp:other.model differs from the tokenized set's gemma3"),
    (["--format", "chat"], "--format chat differs from the tokenized set's alpaca"),
    (["--chat-format", "chatml"], "--chat-format chatml differs from the tokenized set's auto"),
    (["--input", "other.jsonl"], "--input other.jsonl differs from the tokenized set's "),
    (["--source-lang", "de"], 'template options {"source_lang": "de"} differs from the tokenized set\'s {}'),
])
def test_other_token_choices_are_refused(first, tmp_path, extra, message):
    text = refused(["--from-tokens", str(first / "tokens")] + extra, tmp_path)
    assert message in text and "\n" not in text
    assert "run a full `prepack pack` with --input" in text


def test_same_token_choices_are_accepted(first, source, tmp_path):
    result = pack(["--from-tokens", str(first / "tokens"), "--max-bad-fraction", "0.5", "--format", "alpaca", "--tokenizer", "gemma3", "--input", source,
                   "--chat-format", "auto", "--output", str(tmp_path / "out"), "--max-length", "128"])
    assert 128 in result.manifests


def test_missing_manifest_is_refused(first, tmp_path):
    folder = copy_tokens(first, tmp_path)
    (folder / "manifest.json").unlink()
    assert f"{folder}/manifest.json not found: {folder} is not a tokenized set" in refused(["--from-tokens", str(folder)], tmp_path)


def test_other_format_version_is_refused(first, tmp_path):
    folder = copy_tokens(first, tmp_path)
    text = (folder / "manifest.json").read_text().replace('"format_version": 1', '"format_version": 7')
    (folder / "manifest.json").write_text(text)
    assert "tokenized-set format_version 7 is not supported" in refused(["--from-tokens", str(folder)], tmp_path)


def test_a_shard_set_is_not_a_tokenized_set(first, tmp_path):
    assert "not a tokenized set's manifest" in refused(["--from-tokens", str(first / "L64")], tmp_path)


def test_missing_or_resized_file_is_refused_before_any_work(first, tmp_path, monkeypatch):
    import apache_beam

    def no_pipeline(*args, **kwargs):
        raise AssertionError("a pipeline was built")

    monkeypatch.setattr(apache_beam, "Pipeline", no_pipeline)
    folder = copy_tokens(first, tmp_path)
    shard = read_tokens_manifest(folder).shards[0]
    with open(folder / shard.path, "ab") as f:
        f.write(b"x")
    text = refused(["--from-tokens", str(folder)], tmp_path)
    assert f"{folder}/{shard.path} has {shard.num_bytes + 1} bytes, but {folder}/manifest.json says {shard.num_bytes}" in text
    (folder / shard.path).unlink()
    assert f"{folder}/{shard.path} is listed in {folder}/manifest.json but missing" in refused(["--from-tokens", str(folder)], tmp_path)


def test_changed_file_fails_the_run_and_publishes_nothing(first, tmp_path):
    folder = copy_tokens(first, tmp_path)
    shard = read_tokens_manifest(folder).shards[0]
    data = bytearray((folder / shard.path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, other bytes
    (folder / shard.path).write_bytes(bytes(data))
    with pytest.raises(Exception, match="the file changed after it was published"):
        pack(["--from-tokens", str(folder), "--output", str(tmp_path / "out"), "--max-length", "128"])
    out = tmp_path / "out"
    leftovers = [os.path.join(r, f) for r, _, files in os.walk(out) for f in files] if out.exists() else []
    assert leftovers == []


def test_existing_tokenized_set_is_refused_without_overwrite(first, source, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(first / "tokens", out / "tokens")
    with pytest.raises(JobError, match=r"tokens/manifest.json already exists: refusing to write over an existing tokenized set"):
        pack(source_args(source) + ["--output", str(out), "--max-length", "128"])
    before = (out / "tokens" / "manifest.json").read_text()
    pack(source_args(source) + ["--output", str(out), "--max-length", "128", "--no-tokens"])
    assert (out / "tokens" / "manifest.json").read_text() == before  # --no-tokens leaves it alone
    mine = [out / "notes.txt", out / "L128" / "notes.txt", out / "tokens" / "notes.txt"]
    for path in mine:  # --overwrite replaces the sets' own files; a user's files beside them stay
        path.write_text("mine")
    pack(source_args(source) + ["--output", str(out), "--max-length", "128", "--overwrite"])
    replaced = read_tokens_manifest(out / "tokens")
    assert sorted(os.listdir(out / "tokens")) == sorted(["manifest.json", "notes.txt", replaced.dropped] + [s.path for s in replaced.shards])
    assert all(path.read_text() == "mine" for path in mine)


def test_cli_refusal_is_one_line(first, tmp_path, capsys):
    from pipelines.launch.cli import main

    assert main(["--sample", "--output", str(tmp_path / "s"), "--max-length", "512", "--no-progress", *IN_PROCESS]) == 0
    assert f"tokens: {tmp_path / 's' / 'tokens' / 'manifest.json'} (for new max lengths" in capsys.readouterr().out

    code = main(["--from-tokens", str(first / "tokens"), "--tokenizer", "sp:x.model", "--output", str(tmp_path / "o"),
                 "--max-length", "128", "--no-progress", *IN_PROCESS])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("prepack pack: --tokenizer sp:x.model differs")


def test_inspect_summarizes_and_decodes_the_tokenized_set(first, capsys):
    from apps.inspect_tokens import main

    assert main([str(first / "tokens"), "--rows", "2", "--no-color"]) == 0
    out = capsys.readouterr().out
    assert "tokenized set" in out and "31 examples" in out and "bytes per token" in out
    assert "example 0:" in out and "example 1:" in out and "[[" in out
    manifest = read_tokens_manifest(first / "tokens")
    assert f"{manifest.tokens:,} tokens" in out
    assert np.isfinite(manifest.stats["bytes_per_token"])


def test_killed_run_leaves_the_old_tokenized_set_and_its_staging_is_cleaned_next_time(first, source, tmp_path, monkeypatch):
    """kill -9 after the shard sets are switched, before the tokenized set is (the failpoint
    before_tokens_switch): the old set stays whole (manifest and the files it names); the next
    run reports the killed run's staging, --clean-stale removes it, and the set is published."""
    from test_pipeline_faults import Killed, kill_at

    out = tmp_path / "out"
    shutil.copytree(first / "tokens", out / "tokens")
    before = {n: (out / "tokens" / n).read_bytes() for n in os.listdir(out / "tokens")}
    kill_at(monkeypatch, "before_tokens_switch")
    with pytest.raises(Killed):
        pack(source_args(source) + ["--output", str(out), "--max-length", "128", "--overwrite"])
    assert {n: (out / "tokens" / n).read_bytes() for n in os.listdir(out / "tokens") if not n.startswith(".staging-")} == before
    assert [n for n in os.listdir(out / "tokens") if n.startswith(".staging-")]
    monkeypatch.undo()
    result = pack(source_args(source) + ["--output", str(out), "--max-length", "128", "--overwrite", "--clean-stale"])
    assert result.notes[0].startswith("removed ")
    manifest = read_tokens_manifest(out / "tokens")
    assert sorted(os.listdir(out / "tokens")) == sorted(["manifest.json", manifest.dropped] + [s.path for s in manifest.shards])


def test_pack_applies_the_overwrite_rule_once(tmp_path, monkeypatch, capsys):
    # `prepack pack` refuses existing sets before Beam is imported, and the job does not ask again.
    from pipelines.launch.cli import main
    from prepack import overwrite

    calls = []
    real = overwrite.refuse_existing_sets

    def counted(*args):
        calls.append(args)
        return real(*args)

    monkeypatch.setattr(overwrite, "refuse_existing_sets", counted)
    out = tmp_path / "once"
    argv = ["--sample", "--output", str(out), "--max-length", "512", "--no-progress", *IN_PROCESS]
    assert main(argv) == 0
    assert calls == [(str(out), (512,), True)]
    capsys.readouterr()
    assert main(argv) == 2 and len(calls) == 2  # refused before any work: 2, as every command refuses
    assert capsys.readouterr().err == (f"prepack pack: {out / 'L512' / 'manifest.json'} already exists: refusing to write "
                                       f"into an existing shard set. Pass --overwrite to replace it ({out / 'published.json'} then names exactly this "
                                       "run's lengths), or choose another --output\n")


def published(out) -> list[int]:
    from loaders import published_lengths

    return sorted(published_lengths(str(out)))


def test_a_new_length_keeps_the_lengths_published_before_it(first, tmp_path, capsys):
    """`--from-tokens OUT/tokens --max-length 128 --output OUT` adds L128 to published.json beside
    L48 and L64 (their manifests untouched), and `prepack verify OUT` checks all three as published."""
    from apps.verify import main as verify_main

    out = tmp_path / "out"
    shutil.copytree(first, out)
    before = {L: (out / f"L{L}" / "manifest.json").read_bytes() for L in FIRST_LENGTHS}
    pack(["--from-tokens", str(out / "tokens"), "--max-length", "128", "--max-bad-fraction", "0.5", "--output", str(out)])
    assert published(out) == [48, 64, 128]
    assert {L: (out / f"L{L}" / "manifest.json").read_bytes() for L in FIRST_LENGTHS} == before
    capsys.readouterr()
    assert verify_main([str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines if line.startswith("L")] == ["L48", "L64", "L128"]
    assert not [line for line in lines if line.startswith("not published")]


def test_an_overwrite_run_publishes_exactly_its_lengths(first, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(first, out)
    pack(["--from-tokens", str(out / "tokens"), "--max-length", "128", "--max-bad-fraction", "0.5", "--output", str(out),
          "--overwrite"])
    assert published(out) == [128]
    assert (out / "L48" / "manifest.json").exists()  # still there, no longer published (verify names it)


def test_a_length_already_published_is_refused_in_one_line(first, tmp_path, capsys):
    from pipelines.launch.cli import main

    out = tmp_path / "out"
    shutil.copytree(first, out)
    record = (out / "published.json").read_bytes()
    code = main(["--from-tokens", str(out / "tokens"), "--max-length", "64", "128", "--output", str(out), "--no-progress",
                 *IN_PROCESS])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"prepack pack: {out / 'L64' / 'manifest.json'} already exists: refusing to write into an "
                                 f"existing shard set. Pass --overwrite to replace it ({out / 'published.json'} then names "
                                 "exactly this run's lengths), or choose another --output\n")
    assert (out / "published.json").read_bytes() == record and not (out / "L128").exists()
    # Named by the record, its manifest gone: still published there, still refused.
    (out / "L64" / "manifest.json").unlink()
    code = main(["--from-tokens", str(out / "tokens"), "--max-length", "64", "--output", str(out), "--no-progress", *IN_PROCESS])
    err = capsys.readouterr().err
    assert code == 2 and err == (f"prepack pack: L64 is already published in {out / 'published.json'}: refusing to replace it "
                                 "without --overwrite; pass --overwrite to publish only this run's lengths, or choose another "
                                 "--output\n")


def test_a_record_that_does_not_match_its_manifests_takes_no_new_length(first, tmp_path, capsys):
    """An interrupted publish (L64's manifest is not the one the record names): adding L128 beside it
    would name a mix, so it is refused before any work, and again under the lock."""
    from pipelines.launch.cli import main
    from pipelines.output import NotAddable

    out = tmp_path / "out"
    shutil.copytree(first, out)
    manifest = out / "L64" / "manifest.json"
    manifest.write_bytes(manifest.read_bytes() + b" ")
    argv = ["--from-tokens", str(out / "tokens"), "--max-length", "128", "--output", str(out), "--no-progress"]
    code = main(argv + IN_PROCESS)
    err = capsys.readouterr().err
    assert code == 2 and err == (f"prepack pack: {manifest} is not the manifest {out / 'published.json'} names (a publish was "
                                 "interrupted, or the file was changed since): refusing to add lengths beside it; pass "
                                 "--overwrite to publish only this run's lengths, or choose another --output\n")
    with pytest.raises(JobError, match="is not the manifest .* nothing was published"):  # the check under the lock
        config, beam_args = parse_args(argv + ["--max-bad-fraction", "0.5"] + IN_PROCESS)
        run(config, beam_args, existing_refused=True)
    assert not (out / "L128").exists() and NotAddable
