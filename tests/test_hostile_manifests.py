"""Manifests and run records written by a stranger (issue 24): nothing taken from one can
point outside its set's folder or the shard cache, and every bad field is one line naming
the manifest and the field, never another exception."""

from __future__ import annotations

import hashlib
import io
import json
import os

import pytest
from testkit import fuzz
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, row_ids

import loaders
from apps import inspect as inspect_cli
from loaders.shard_cache import ShardCache, ShardDigestError
from prepack.format.manifest import MANIFEST_NAME, Manifest, ManifestError
from prepack.format.tokenset import TokenSetError, TokenSetManifest
from prepack import storage as prepack_storage


def _edit(folder, **changes) -> dict:
    path = os.path.join(folder, MANIFEST_NAME)
    with open(path) as f:
        data = json.load(f)
    for key, value in changes.items():
        if key.startswith("shard_"):
            data["shards"][0][key[len("shard_"):]] = value
        else:
            data[key] = value
    with open(path, "w") as f:
        json.dump(data, f)
    return data


@pytest.fixture
def shard_set(tmp_path):
    build_shard_set(tmp_path / "set", num_rows=6, num_shards=1, max_length=16)
    return str(tmp_path / "set")


@pytest.mark.parametrize("name", [
    "/etc/passwd", "../../../../etc/passwd", "sub/rows.array_record", "gs://other-bucket/rows.array_record",
    "..", ".hidden", "a\\b", "", "rows\x00.array_record",
])
def test_shard_path_outside_the_folder_is_refused_naming_manifest_and_field(shard_set, name):
    _edit(shard_set, shard_path=name)
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(shard_set, verify=True)
    message = str(e.value)
    assert message.startswith(f"{shard_set}/manifest.json: shards[0].path ")
    assert "is not a plain file name in the set's folder" in message and "\n" not in message
    assert "root:" not in message  # nothing of the file it names was read


def test_absolute_path_to_another_sets_shard_is_not_read(tmp_path, shard_set):
    build_shard_set(tmp_path / "other", num_rows=6, num_shards=1, max_length=16)
    other = tmp_path / "other" / "rows-00000-of-00001.array_record"
    _edit(shard_set, shard_path=str(other))
    with pytest.raises(ManifestError, match=r"shards\[0\]\.path '/"):
        loaders.open_shards(shard_set)


@pytest.mark.parametrize("digest", ["../../../../tmp/x", "0" * 63, "G" * 64, 7, None])
def test_sha256_that_is_not_64_hex_digits_is_refused(shard_set, digest):
    _edit(shard_set, shard_sha256=digest)
    with pytest.raises(ManifestError, match=r"^.*manifest.json: shards\[0\]\.sha256 .* is not a sha256 \(64 lowercase hex digits\)"):
        loaders.open_shards(shard_set)


def test_cache_key_cannot_name_a_file_outside_the_cache(tmp_path):
    cache = ShardCache(str(tmp_path / "cache"))
    outside = tmp_path / "x.array_record"
    outside.write_bytes(b"not a shard")
    with pytest.raises(ShardDigestError, match="is not a sha256"):
        cache.fetch("gs://b/rows.array_record", "../x", len(b"not a shard"))
    assert not os.path.exists(tmp_path / "cache")  # no lock, no .part file anywhere
    assert not list(tmp_path.glob("*.lock")) and not list(tmp_path.glob("*.part*"))


@pytest.mark.parametrize("field,value,words", [
    ("num_rows", "6", "num_rows '6' is not an integer"),
    ("num_rows", True, "num_rows True is not an integer"),
    ("shard_num_bytes", "100", "shards[0].num_bytes '100' is not an integer"),
    ("shard_num_rows", -1, "shards[0].num_rows -1 is not an integer"),
    ("tokenizer", ["gemma3"], "tokenizer is an array, not a JSON object"),
    ("stats", None, "stats is null, not a JSON object"),
    ("max_length", 1 << 31, "max_length 2147483648 is not an integer from 2 to 1,048,576"),
    ("shards", {"path": "x"}, "shards is an object, not a JSON array"),
    ("dead_letter", "../dead.jsonl", "dead_letter '../dead.jsonl' is not a plain file name"),
    ("lineage", [1], "lineage is an array, not a JSON object"),
])
def test_fields_of_the_wrong_type_are_one_line_in_open_shards_and_inspect(shard_set, field, value, words):
    _edit(shard_set, **{field: value})
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(shard_set)
    assert str(e.value).startswith(f"{shard_set}/manifest.json: ") and words in str(e.value)
    out, err = io.StringIO(), io.StringIO()
    assert inspect_cli.main([shard_set, "--rows", "1"], out=out, err=err) == 2
    assert err.getvalue().count("\n") == 1 and words in err.getvalue()


def test_inspect_rows_over_a_corrupt_record_is_one_line(tmp_path):
    path = tmp_path / "set"
    build_shard_set(path, num_rows=20, num_shards=1, max_length=64)
    shard = path / "rows-00000-of-00001.array_record"
    data = bytearray(shard.read_bytes())
    data[4000] ^= 0xFF
    shard.write_bytes(bytes(data))
    out, err = io.StringIO(), io.StringIO()
    assert inspect_cli.main([str(path), "--rows", "20", "--ids"], out=out, err=err) == 1
    line = err.getvalue()
    assert line.count("\n") == 1 and line.startswith(f"prepack inspect: {shard}: record ")
    assert "is unreadable, the file is corrupt" in line


def test_run_record_paths_must_be_the_lengths_manifest(tmp_path):
    out = tmp_path / "out"
    build_shard_set(out / "L16", num_rows=6, num_shards=1, max_length=16)
    digest = hashlib.sha256((out / "L16" / MANIFEST_NAME).read_bytes()).hexdigest()
    record = out / "published.json"
    record.write_text(json.dumps({"run_id": "r", "lengths": {"16": {"manifest": "L16/manifest.json", "sha256": digest}}}))
    assert loaders.published_lengths(str(out)) == {16: f"{out}/L16"}
    for entry, words in [({"manifest": "../../etc/passwd", "sha256": digest}, "lengths[16].manifest '../../etc/passwd' is not 'L16/manifest.json'"),
                         ({"manifest": "L32/manifest.json", "sha256": digest}, "is not 'L16/manifest.json'"),
                         ({"manifest": "L16/manifest.json", "sha256": "../x"}, "lengths[16].sha256 '../x' is not a sha256"),
                         ("L16", "lengths[16] is a string, not a JSON object")]:
        record.write_text(json.dumps({"run_id": "r", "lengths": {"16": entry}}))
        with pytest.raises(loaders.ShardSetError) as e:
            loaders.published_lengths(str(out))
        assert str(e.value).startswith(f"{record}: ") and words in str(e.value), str(e.value)
    record.write_text(json.dumps({"run_id": "r", "lengths": {"../16": {}}}))
    with pytest.raises(loaders.ShardSetError, match=r"lengths key '../16' is not a max length"):
        loaders.published_lengths(str(out))
    record.write_text(json.dumps([1]))
    with pytest.raises(loaders.ShardSetError, match=r"published.json: the record is an array, not a JSON object"):
        loaders.published_lengths(str(out))


def _tokens_manifest() -> dict:
    from prepack.packing.accounting import Tally

    return {
        "kind": "tokens", "format_version": 1, "num_examples": 3, "tokens": 30, "target_tokens": 10,
        "shards": [{"path": "tokens-0123456789abcdef.array_record", "num_rows": 3, "num_bytes": 100, "sha256": "0" * 64}],
        "choices": {"inputs": ["in.jsonl"], "format": "alpaca", "template_options": {}, "chat_format": "auto",
                    "tokenizer": "gemma3"},
        "tokenizer": {"name": "gemma3", "pad_id": 0}, "template": {}, "inputs": [], "stats": {},
        "job": {"tasks": [{"input_index": 0, "input_spec": "in.jsonl", "path": "in.jsonl", "name": "in.jsonl"}],
                "fingerprints": [], "tally": Tally().to_json(), "est_records": 3},
    }


@pytest.mark.parametrize("path,value,words", [
    (("shards", 0, "path"), "../../x.array_record", "shards[0].path '../../x.array_record' is not a plain file name"),
    (("shards", 0, "sha256"), "../x", "shards[0].sha256 '../x' is not a sha256"),
    (("dropped",), "/etc/passwd", "dropped '/etc/passwd' is not a plain file name"),
    (("tokenizer", "pad_id"), "0", "tokenizer.pad_id '0' is not an integer"),
    (("job", "tasks"), None, "job.tasks is null, not a JSON array"),
    (("job", "tally"), {"records_read": 1}, "job.tally is damaged (KeyError"),
    (("choices", "inputs"), "in.jsonl", "choices.inputs is a string, not a JSON array"),
    (("num_examples",), "3", "num_examples '3' is not an integer"),
])
def test_tokens_manifest_fields_are_checked(path, value, words):
    good = _tokens_manifest()
    TokenSetManifest.from_json(json.dumps(good), source="T/manifest.json")
    target = good
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(TokenSetError) as e:
        TokenSetManifest.from_json(json.dumps(good), source="T/manifest.json")
    assert str(e.value).startswith("T/manifest.json: ") and words in str(e.value), str(e.value)


@pytest.mark.parametrize("text, words", [
    ('{"kind": "tokens", "num_examples": ' + "9" * 5001 + "}", "Exceeds the limit (4300 digits) for integer string conversion"),
    ("[" * 100_000 + "]" * 100_000, "maximum recursion depth exceeded"),
])
def test_tokens_manifest_json_a_parser_refuses_is_one_line(tmp_path, text, words):
    """A 5,001-digit integer (ValueError) or arrays nested 100,000 deep (RecursionError): only
    JSONDecodeError was caught, so both were tracebacks in `prepack inspect` and `--from-tokens`."""
    from apps import inspect_tokens
    from pipelines.launch.token_set import open_token_set

    with pytest.raises(TokenSetError) as e:
        TokenSetManifest.from_json(text, source="T/manifest.json")
    message = str(e.value)
    assert message.startswith("T/manifest.json: not valid JSON (") and words in message and "\n" not in message
    assert message.endswith("); run a full `prepack pack` again") and len(message) < 300
    folder = tmp_path / "tokens"
    folder.mkdir()
    (folder / MANIFEST_NAME).write_text(text)
    with pytest.raises(TokenSetError, match=r"manifest.json: not valid JSON \(|not a tokenized set's manifest"):
        open_token_set(str(folder))
    out, err = io.StringIO(), io.StringIO()
    assert inspect_tokens.main([str(folder)], out=out, err=err) == 2 and len(err.getvalue().splitlines()) == 1


# ----------------------------------------------------------------------------- the healing cache


def _flip(path, at: int) -> None:
    data = bytearray(open(path, "rb").read())
    data[at] ^= 0xFF
    with open(path, "wb") as f:
        f.write(bytes(data))


def test_verify_rehashes_a_cached_copy_and_fetches_a_rotted_one_again(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=20, num_shards=1, max_length=64)
    for name in sorted(os.listdir(tmp_path / "set")):
        gcs_emulator.upload_file(str(tmp_path / "set" / name), f"{gcs_prefix}/L64/{name}")
    url, cache = f"{gcs_prefix}/L64", str(tmp_path / "cache")
    view = loaders.open_shards(url, verify=True, cache_dir=cache)
    sha = view.manifest.shards[0].sha256
    cached = os.path.join(cache, f"{sha}.array_record")
    _flip(cached, 4000)  # same size: only a hash can tell
    view = loaders.open_shards(url, verify=True, cache_dir=cache)
    assert hashlib.sha256(open(cached, "rb").read()).hexdigest() == sha  # healed
    assert row_ids(view.read(list(range(20)))).tolist() == list(range(20))


def test_a_corrupt_record_in_a_cached_copy_is_fetched_again_once(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=20, num_shards=1, max_length=64)
    for name in sorted(os.listdir(tmp_path / "set")):
        gcs_emulator.upload_file(str(tmp_path / "set" / name), f"{gcs_prefix}/L64/{name}")
    url, cache = f"{gcs_prefix}/L64", str(tmp_path / "cache")
    view = loaders.open_shards(url, cache_dir=cache)
    sha = view.manifest.shards[0].sha256
    cached = os.path.join(cache, f"{sha}.array_record")
    view.read([0])
    view.close()
    _flip(cached, 4000)
    # Without the heal some record fails its checksum: the copy would stay corrupt forever.
    view = loaders.open_shards(url, cache_dir=cache)
    assert row_ids(view.read(list(range(20)))).tolist() == list(range(20))
    assert hashlib.sha256(open(cached, "rb").read()).hexdigest() == sha


def test_a_record_corrupt_in_the_bucket_too_still_fails_after_one_fetch(gcs_emulator, gcs_prefix, tmp_path, monkeypatch):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=20, num_shards=1, max_length=64)
    for name in sorted(os.listdir(tmp_path / "set")):
        gcs_emulator.upload_file(str(tmp_path / "set" / name), f"{gcs_prefix}/L64/{name}")
    url, cache = f"{gcs_prefix}/L64", str(tmp_path / "cache")
    view = loaders.open_shards(url, cache_dir=cache)
    fetches = []
    real = ShardCache.fetch
    monkeypatch.setattr(ShardCache, "fetch", lambda self, *a, **k: fetches.append(a) or real(self, *a, **k))
    view.read([0])
    sha = view.manifest.shards[0].sha256
    original = open(os.path.join(cache, f"{sha}.array_record"), "rb").read()

    def corrupt_download(url_, out):  # the bucket's bytes are damaged too: the heal cannot help
        data = bytearray(original)
        data[4000] ^= 0xFF
        out.write(bytes(data))
        return len(data), sha

    monkeypatch.setattr(prepack_storage, "download", corrupt_download)
    _flip(os.path.join(cache, f"{sha}.array_record"), 4000)
    view.close()
    with pytest.raises(loaders.ShardSetError, match=r"record \d+ \(row \d+\) is unreadable, the file is corrupt"):
        view.read(list(range(20)))
    assert len(fetches) == 3  # the first open, the reopen after close, and one fetch again


def test_a_manifest_or_run_record_that_is_not_utf8_is_one_line(tmp_path):
    """Bytes that are not UTF-8 (a hostile or damaged file) used to raise UnicodeDecodeError in
    open_shards, published_lengths and prepack inspect."""
    out = tmp_path / "out"
    build_shard_set(out / "L16", num_rows=4, num_shards=1, max_length=16)
    (out / "L16" / MANIFEST_NAME).write_bytes(b'{"max_length": 16, "x": "\xff"}')
    (out / "published.json").write_bytes(b'{"run_id": "\xfe"}')
    expected = f"{out}/L16/{MANIFEST_NAME}: not UTF-8 text (byte 25 is b'\\xff'); the file was edited or is damaged: republish the set"
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(str(out / "L16"))
    assert str(e.value) == expected
    with pytest.raises(ManifestError, match=r"published.json: not UTF-8 text \(byte 12 is "):
        loaders.published_lengths(str(out))
    out_text, err = io.StringIO(), io.StringIO()
    assert inspect_cli.main([str(out / "L16")], out=out_text, err=err) == 2
    assert err.getvalue() == f"prepack inspect: {expected}\n"


# ----------------------------------------------------------------------------- fuzz


def _json_values():
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(min_value=-(1 << 70), max_value=1 << 70) | \
        st.floats(allow_nan=False) | st.text(max_size=20)
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                        max_leaves=8)


_FIELDS = ("max_length", "num_rows", "shards", "tokenizer", "stats", "packing", "template", "inputs", "options",
           "tool", "dead_letter", "created_at", "lineage", "format_version", "fields", "array_record_options",
           "field_order", "mixture", "shard_path", "shard_num_rows", "shard_num_bytes", "shard_sha256", "shard_extra")


def _fuzz_manifest(tmp_path_factory, examples: int) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    folder = str(tmp_path_factory.mktemp("fuzz") / "set")
    build_shard_set(folder, num_rows=4, num_shards=1, max_length=16)
    with open(os.path.join(folder, MANIFEST_NAME)) as f:
        good = json.load(f)

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(fields=st.lists(st.tuples(st.sampled_from(_FIELDS), _json_values()), min_size=1, max_size=3),
           delete=st.booleans())
    def check(fields, delete):
        data = json.loads(json.dumps(good))
        for field, value in fields:
            if field.startswith("shard_"):
                shards = data.get("shards")
                if isinstance(shards, list) and shards and isinstance(shards[0], dict):
                    shards[0][field[len("shard_"):]] = value
            elif delete:
                data.pop(field, None)
            else:
                data[field] = value
        text = json.dumps(data)
        try:
            Manifest.from_json(text, source="m.json")
        except ManifestError as e:
            assert "\n" not in str(e)
        with open(os.path.join(folder, MANIFEST_NAME), "w") as f:
            f.write(text)
        try:
            loaders.open_shards(folder, expected_max_length=16, tokenizer=TEST_TOKENIZER).close()
        except ManifestError as e:
            assert "\n" not in str(e) and str(e).startswith(folder)

    check()


def test_fuzz_manifests_give_a_set_or_a_manifest_error(tmp_path_factory):
    _fuzz_manifest(tmp_path_factory, 300)


@pytest.mark.slow
def test_fuzz_manifests_deep(tmp_path_factory):
    _fuzz_manifest(tmp_path_factory, fuzz.DEEP_EXAMPLES)


def _fuzz_tokens_manifest(examples: int) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = _tokens_manifest()
    paths = [("kind",), ("format_version",), ("num_examples",), ("tokens",), ("target_tokens",), ("shards",),
             ("shards", 0, "path"), ("shards", 0, "sha256"), ("shards", 0, "num_rows"), ("choices",), ("choices", "inputs"),
             ("choices", "template_options"), ("tokenizer",), ("tokenizer", "pad_id"), ("template",), ("inputs",),
             ("stats",), ("job",), ("job", "tasks"), ("job", "tasks", 0), ("job", "tasks", 0, "byte_start"),
             ("job", "tally"), ("job", "tally", "per_length"), ("job", "est_records"), ("dropped",), ("tool",),
             ("created_at",), ("array_record_options",)]

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(edits=st.lists(st.tuples(st.sampled_from(paths), _json_values()), min_size=1, max_size=3))
    def check(edits):
        data = json.loads(json.dumps(good))
        for path, value in edits:
            target = data
            for key in path[:-1]:
                if isinstance(target, dict) and key in target or isinstance(target, list) and isinstance(key, int) and key < len(target):
                    target = target[key]
                else:
                    target = None
                    break
            if isinstance(target, dict) or (isinstance(target, list) and isinstance(path[-1], int) and path[-1] < len(target)):
                target[path[-1]] = value
        try:
            manifest = TokenSetManifest.from_json(json.dumps(data), source="T/manifest.json")
        except TokenSetError as e:
            assert "\n" not in str(e)
            return
        from pipelines.launch.token_set import tasks_of
        from prepack.packing.accounting import Tally

        tasks_of(manifest)  # what the job then builds from it must not raise either
        Tally.from_json(manifest.job["tally"])
        int(manifest.tokenizer["pad_id"])

    check()


def test_fuzz_tokens_manifests_give_a_set_or_a_token_set_error():
    _fuzz_tokens_manifest(300)


@pytest.mark.slow
def test_fuzz_tokens_manifests_deep():
    _fuzz_tokens_manifest(fuzz.DEEP_EXAMPLES)


def test_a_shard_listed_twice_is_refused(tmp_path):
    """The same file named twice would be read twice: its rows trained on twice and counted
    twice. Shown to fail with the `listed twice` check removed from untrusted.shard_entries
    (the set opened with 2x its rows)."""
    folder = str(tmp_path / "set")
    build_shard_set(folder, num_rows=6, num_shards=2, max_length=16)
    path = os.path.join(folder, MANIFEST_NAME)
    with open(path) as f:
        data = json.load(f)
    data["shards"][1] = dict(data["shards"][0])
    data["num_rows"] = sum(s["num_rows"] for s in data["shards"])  # the totals agree: only the repeat is wrong
    with open(path, "w") as f:
        json.dump(data, f)
    name = data["shards"][0]["path"]
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(folder, expected_max_length=16, tokenizer=TEST_TOKENIZER)
    assert str(e.value) == (f"{path}: shards[1].path {name!r} is listed twice; the manifest was edited or is damaged: "
                            "republish the set")
