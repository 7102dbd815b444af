"""open_shards on a mixture set (row format 2): its `mixture.sources` must name every source id
its rows carry, and a record that breaks the row format is named by its shard file and set."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import loaders
from apps import cli
from prepack.format import rowformat, shardfile
from prepack.format.manifest import MANIFEST_NAME, Manifest

SAMPLE_MIX = os.path.join(os.path.dirname(rowformat.__file__), "..", "sample_data", "sample_mix.yaml")


@pytest.fixture(scope="module")
def mix_set(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("mix") / "out")
    assert cli.main(["pack", "--mixture", SAMPLE_MIX, "--max-length", "64", "--output", out, "--no-progress"]) == 0
    return os.path.join(out, "L64")


@pytest.fixture
def mix_copy(mix_set, tmp_path) -> str:
    return shutil.copytree(mix_set, str(tmp_path / "L64"))


def _manifest(path: str) -> dict:
    with open(os.path.join(path, MANIFEST_NAME)) as f:
        return json.load(f)


def _write_manifest(path: str, data: dict) -> None:
    with open(os.path.join(path, MANIFEST_NAME), "w") as f:
        json.dump(data, f)


def test_a_whole_mixture_set_opens_and_reads(mix_set):
    view = loaders.open_shards(mix_set)
    batch = view.read(np.arange(len(view)))
    assert set(np.unique(batch["source_ids"])) == {0, 1, 2}


def test_a_manifest_listing_one_of_two_sources_is_refused(mix_copy):
    data = _manifest(mix_copy)
    kept = data["mixture"]["sources"][0]
    data["mixture"]["sources"] = [kept]
    _write_manifest(mix_copy, data)
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(mix_copy)
    assert str(e.value) == (
        f"{mix_copy}/{MANIFEST_NAME}: mixture.sources lists 1 sources whose examples_written add up to "
        f"{kept['examples_written']}, but the set holds {data['stats']['examples_written']} (stats.examples_written): "
        "its rows carry source ids the list does not name; republish the set")


def _rewrite_first_shard(path: str, records_of) -> str:
    """Replaces the first shard's records by records_of(records) and fixes its manifest entry, so
    that only the records themselves are wrong."""
    manifest = Manifest.from_json(open(os.path.join(path, MANIFEST_NAME)).read())
    info = manifest.shards[0]
    from array_record.python.array_record_module import ArrayRecordReader

    reader = ArrayRecordReader(os.path.join(path, info.path))
    records = list(reader.read_all())
    reader.close()
    os.remove(os.path.join(path, info.path))
    manifest.shards[0] = shardfile.write_shard(os.path.join(path, info.path), records_of(records))
    with open(os.path.join(path, MANIFEST_NAME), "w") as f:
        f.write(manifest.to_json())
    return os.path.join(path, manifest.shards[0].path)


def test_a_record_of_the_wrong_size_names_its_file_and_set(mix_copy):
    shard = _rewrite_first_shard(mix_copy, lambda records: records[:1] + [records[1][:-4]] + records[2:])
    view = loaders.open_shards(mix_copy)  # open reads record 0 of each shard only
    size = rowformat.record_size(64, rowformat.MIXTURE_FORMAT_VERSION)
    with pytest.raises(loaders.ShardSetError) as e:
        view.read([0, 1])
    assert str(e.value) == (
        f"{shard}: record 1 (row 1 of shard set {mix_copy}): record has {size - 4} bytes, expected {size} "
        "for max_length 64; the shards do not match their manifest, republish the set")
    with pytest.raises(loaders.ShardSetError, match=f"^{shard}: record 1 "):
        view[1]


def test_a_source_id_beyond_the_listed_sources_names_its_file_and_set(mix_copy):
    def beyond(records):
        matrix = np.frombuffer(records[2], "<i4").reshape(6, 64).copy()
        matrix[5][matrix[4] == 1] = 3  # the sample mixture has 2 sources
        return records[:2] + [matrix.tobytes()] + records[3:]

    shard = _rewrite_first_shard(mix_copy, beyond)
    view = loaders.open_shards(mix_copy)
    with pytest.raises(loaders.ShardSetError) as e:
        view.read([0, 2])
    assert str(e.value) == (
        f"{shard}: record 2 (row 2 of shard set {mix_copy}): segment 1, token 0: source_ids must be 1..N on every real "
        "token and 0 on padding (there: source_ids 3); the shard was edited or is not what its manifest describes: "
        "check the set with prepack verify, and republish it")
