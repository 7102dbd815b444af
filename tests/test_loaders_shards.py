"""open_shards: random access, and a clear error (naming the path) for every bad shard set."""

from __future__ import annotations

import json
import os
import pickle
import shutil

import numpy as np
import pytest
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set, row_ids

import loaders
from prepack.format import rowformat
from prepack.format.manifest import MANIFEST_NAME, ManifestError


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("set") / "L32")
    build_shard_set(path, num_rows=30, rows_per_shard=[10, 0, 13, 7], max_length=32)
    return path


def copy_set(shard_set: str, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(shard_set, dst)
    return dst


def edit_manifest(path: str, **changes) -> None:
    manifest_path = os.path.join(path, MANIFEST_NAME)
    with open(manifest_path) as f:
        data = json.load(f)
    data.update(changes)
    with open(manifest_path, "w") as f:
        json.dump(data, f)


def test_view_random_access(shard_set):
    view = loaders.open_shards(shard_set, expected_max_length=32, tokenizer=TEST_TOKENIZER)
    assert len(view) == 30 and view.max_length == 32 and view.manifest.num_rows == 30
    # Rows come in manifest shard order, across an empty shard.
    assert [int(row_ids(view[i])) for i in range(30)] == list(range(30))
    assert int(row_ids(view[-1])) == 29
    row = view[12]
    assert set(row) == set(rowformat.FIELD_NAMES)
    assert all(v.dtype == np.int32 and v.shape == (32,) for v in row.values())
    rowformat.check_row(row, 32)

    batch = view.read([29, 0, 10, 10, 17])
    assert all(v.dtype == np.int32 and v.shape == (5, 32) for v in batch.values())
    assert row_ids(batch).tolist() == [29, 0, 10, 10, 17]
    for j, i in enumerate([29, 0, 10, 10, 17]):
        for name in rowformat.FIELD_NAMES:
            np.testing.assert_array_equal(batch[name][j], view[i][name])

    with pytest.raises(IndexError, match="row 30 is out of range"):
        view[30]
    # Pickles without its open readers (for worker processes) and reads again after.
    clone = pickle.loads(pickle.dumps(view))
    assert row_ids(clone.read([3, 25])).tolist() == [3, 25]
    view.close()


def test_tokenizer_object_with_identity(shard_set):
    class Tok:
        def identity(self):
            return dict(TEST_TOKENIZER)

    assert len(loaders.open_shards(shard_set, tokenizer=Tok())) == 30


def test_missing_manifest(tmp_path, shard_set):
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(str(tmp_path / "nowhere"))
    assert str(e.value) == (
        f"no manifest.json in {tmp_path / 'nowhere'}: not a published shard set (an interrupted run leaves none)"
    )
    # Shards without a manifest (an interrupted job) are refused the same way.
    path = copy_set(shard_set, tmp_path)
    os.remove(os.path.join(path, MANIFEST_NAME))
    with pytest.raises(ManifestError, match=f"no manifest.json in {path}: not a published shard set"):
        loaders.open_shards(path)


def test_wrong_max_length(shard_set):
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(shard_set, expected_max_length=2048)
    msg = str(e.value)
    assert msg.startswith(os.path.join(shard_set, MANIFEST_NAME))
    assert "packed for max_length 32, but 2048 was expected" in msg


def test_tokenizer_mismatch(shard_set):
    other = dict(TEST_TOKENIZER, name="gemma3", vocab_size=262_144)
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(shard_set, tokenizer=other)
    assert os.path.join(shard_set, MANIFEST_NAME) in str(e.value)
    assert "tokenizer vocab_size is 50000 in the shards ('test-vocab') but 262144 in the trainer's tokenizer ('gemma3')" in str(e.value)
    with pytest.raises(ManifestError, match="tokenizer vocab_hash"):
        loaders.open_shards(shard_set, tokenizer=dict(TEST_TOKENIZER, vocab_hash="f" * 64))
    with pytest.raises(TypeError, match="Tokenizer .*or its identity dict"):
        loaders.open_shards(shard_set, tokenizer="gemma3")


def test_unsupported_format_version(shard_set, tmp_path):
    path = copy_set(shard_set, tmp_path)
    edit_manifest(path, format_version=99)
    with pytest.raises(ManifestError) as e:
        loaders.open_shards(path)
    assert str(e.value).startswith(os.path.join(path, MANIFEST_NAME) + ": format_version 99 is not supported")


def test_missing_shard_file(shard_set, tmp_path):
    path = copy_set(shard_set, tmp_path)
    os.remove(os.path.join(path, "rows-00002-of-00004.array_record"))
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path)
    assert str(e.value) == (
        f"{path}/rows-00002-of-00004.array_record: shard file listed in {path}/manifest.json is missing "
        "(1 of 4 missing: rows-00002-of-00004.array_record)"
    )


def test_truncated_shard(shard_set, tmp_path):
    path = copy_set(shard_set, tmp_path)
    shard = os.path.join(path, "rows-00003-of-00004.array_record")
    size = os.path.getsize(shard)
    with open(shard, "r+b") as f:
        f.truncate(size - 1000)
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path)
    assert str(e.value) == f"{shard}: {size - 1000} bytes, but the manifest says {size}; the file is truncated or was replaced"


def test_truncated_shard_with_matching_manifest_is_unreadable(shard_set, tmp_path):
    # Even a manifest that agrees with the short size cannot hide a cut file: without its
    # footer, array_record opens it as holding no rows, and the row count check names it.
    path = copy_set(shard_set, tmp_path)
    shard = os.path.join(path, "rows-00000-of-00004.array_record")
    with open(shard, "r+b") as f:
        f.truncate(5000)
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        data = json.load(f)
    data["shards"][0]["num_bytes"] = 5000
    edit_manifest(path, shards=data["shards"])
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path)
    assert str(e.value) == f"{shard}: holds 0 rows, but the manifest says 10; the file was replaced or is corrupt"


def test_corrupt_record_is_unreadable(shard_set, tmp_path):
    # Without verify, riegeli's chunk hash still catches a corrupt first record.
    path = copy_set(shard_set, tmp_path)
    shard = os.path.join(path, "rows-00002-of-00004.array_record")
    with open(shard, "r+b") as f:
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path)
    assert str(e.value).startswith(f"{shard}: not a readable ArrayRecord file, truncated or corrupt (")
    assert "hash mismatch" in str(e.value)


def test_corrupt_shard_caught_by_verify(shard_set, tmp_path):
    path = copy_set(shard_set, tmp_path)
    shard = os.path.join(path, "rows-00002-of-00004.array_record")
    with open(shard, "r+b") as f:  # same size, different bytes
        f.seek(200)
        byte = f.read(1)
        f.seek(200)
        f.write(bytes([byte[0] ^ 0xFF]))
    expected = json.load(open(os.path.join(path, MANIFEST_NAME)))["shards"][2]["sha256"]
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path, verify=True)
    assert str(e.value).startswith(f"{shard}: sha256 ")
    assert str(e.value).endswith(f"differs from the manifest's {expected}; the file is corrupt")


def test_row_count_mismatch(shard_set, tmp_path):
    path = copy_set(shard_set, tmp_path)
    data = json.load(open(os.path.join(path, MANIFEST_NAME)))
    data["shards"][0]["num_rows"] = 11
    data["shards"][3]["num_rows"] = 6  # keeps the total, so only the shard check can see it
    edit_manifest(path, shards=data["shards"])
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path)
    assert str(e.value) == (
        f"{path}/rows-00000-of-00004.array_record: holds 10 rows, but the manifest says 11; the file was replaced or is corrupt"
    )


def test_wrong_record_size(tmp_path):
    path = str(tmp_path / "set")
    build_shard_set(path, num_rows=6, num_shards=2, max_length=32)
    edit_manifest(path, max_length=16)
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(path)
    assert str(e.value) == (
        f"{path}/rows-00000-of-00002.array_record: records are 640 bytes, but max_length 16 needs 320; "
        "the shards do not match their manifest"
    )


def test_make_dataset_reports_the_same_errors(tmp_path):
    with pytest.raises(loaders.ShardSetError, match="no manifest.json in"):
        loaders.make_dataset(str(tmp_path), batch_size=2, seed=0, shard_index=0, shard_count=1)


def test_imports_stay_light():
    # `import loaders` (the mask, open_shards, inspect) must not pull in Grain or JAX;
    # nothing in loaders/ may import Beam.
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(loaders.__file__)))
    code = "import sys, loaders, apps.inspect; print(sorted({'grain', 'jax', 'apache_beam'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    for name in os.listdir(os.path.dirname(loaders.__file__)):
        if name.endswith(".py"):
            with open(os.path.join(os.path.dirname(loaders.__file__), name)) as f:
                text = f.read()
            assert "import apache_beam" not in text and "from apache_beam" not in text, name
