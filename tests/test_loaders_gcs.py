"""gs:// shard sets against a local GCS emulator: the manifest and sizes come through
google-cloud-storage (STORAGE_EMULATOR_HOST), the records through array_record's own gs:// reader."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
from testkit.shard_sets import build_shard_set, row_ids

import loaders

import gcp_storage_emulator.server as emulator
from google.cloud import storage

BUCKET = "prepack-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def gcs_server():
    port = _free_port()
    server = emulator.create_server("127.0.0.1", port, in_memory=True, default_bucket=BUCKET)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """The emulator's client; only STORAGE_EMULATOR_HOST is set, as a user would."""
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs_server)
    monkeypatch.delenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", raising=False)
    yield storage.Client()
    # open_shards mirrors the emulator for array_record; register it so monkeypatch removes it.
    if "CLOUD_STORAGE_EMULATOR_ENDPOINT" in os.environ:
        monkeypatch.setenv("CLOUD_STORAGE_EMULATOR_ENDPOINT", os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"])


def upload(client, local: str, prefix: str, skip: tuple[str, ...] = ()) -> str:
    bucket = client.bucket(BUCKET)
    for name in sorted(os.listdir(local)):
        if name not in skip:
            bucket.blob(f"{prefix}/{name}").upload_from_filename(os.path.join(local, name))
    return f"gs://{BUCKET}/{prefix}"


def test_open_and_read_gs(gcs, tmp_path):
    build_shard_set(tmp_path / "set", num_rows=24, num_shards=3, max_length=16)
    url = upload(gcs, str(tmp_path / "set"), "sets/v1/L16")
    view = loaders.open_shards(url + "/", expected_max_length=16, verify=True)
    assert view.path == url and len(view) == 24
    assert row_ids(view.read([23, 0, 9])).tolist() == [23, 0, 9]
    local = loaders.open_shards(str(tmp_path / "set"))
    for name in ("input_ids", "segment_ids", "loss_mask"):
        np.testing.assert_array_equal(view[17][name], local[17][name])

    ds = loaders.make_dataset(url, batch_size=4, seed=3, shard_index=0, shard_count=1, num_epochs=1, read_threads=2)
    seen = np.concatenate([row_ids(b) for b in ds])
    assert sorted(seen.tolist()) == list(range(24))


def test_gs_errors_name_the_url(gcs, tmp_path):
    build_shard_set(tmp_path / "set", num_rows=8, num_shards=2, max_length=16)
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(f"gs://{BUCKET}/sets/none")
    assert str(e.value) == f"no manifest.json in gs://{BUCKET}/sets/none: not a published shard set (an interrupted run leaves none)"

    url = upload(gcs, str(tmp_path / "set"), "sets/partial", skip=("rows-00001-of-00002.array_record",))
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(url)
    assert str(e.value).startswith(f"{url}/rows-00001-of-00002.array_record: shard file listed in {url}/manifest.json is missing")
