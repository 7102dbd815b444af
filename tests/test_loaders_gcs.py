"""gs:// shard sets against the local GCS emulator (testkit/gcs_emulator.py): the manifest,
sizes and whole-shard downloads come through google-cloud-storage; records are read
from the local shard cache. A counting proxy (testkit/http_delay_proxy.py) in front of
the emulator shows what each read costs in requests."""

from __future__ import annotations

import json
import os
from urllib.parse import unquote

import numpy as np
import pytest
from testkit.http_delay_proxy import start_proxy
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.shard_sets import build_shard_set, row_ids

import loaders
from loaders import shards as shards_module
from loaders import mounts
from prepack import storage
from loaders.dataset import READ_THREADS_GCS, READ_THREADS_LOCAL, READ_THREADS_NETWORK_MOUNT, default_read_threads


def upload(emulator, local: str, url: str, skip: tuple[str, ...] = ()) -> str:
    for name in sorted(os.listdir(local)):
        if name not in skip:
            emulator.upload_file(os.path.join(local, name), f"{url}/{name}")
    return url


@pytest.fixture
def proxy(gcs_emulator, monkeypatch):  # noqa: F811
    """The emulator behind the counting proxy (no delay): clients in this test go through it."""
    with start_proxy(gcs_emulator.endpoint) as p:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.endpoint)
        yield p


@pytest.fixture
def opened(monkeypatch):
    """Counts reader opens (each one reads a shard's footer) per file path."""
    counts: dict[str, int] = {}
    real = shards_module._open_reader

    def counting(path):
        counts[path] = counts.get(path, 0) + 1
        return real(path)

    monkeypatch.setattr(shards_module, "_open_reader", counting)
    return counts


def shard_downloads(stats: dict) -> dict[str, int]:
    """GET requests per shard object, from the proxy's counts."""
    names = {unquote(k).rsplit("/", 1)[-1]: v for k, v in stats["by_path"].items() if k.startswith("GET ")}
    return {k: v for k, v in names.items() if k.endswith(".array_record")}


def test_open_and_read_gs(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=24, num_shards=3, max_length=16)
    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/sets/v1/L16")
    view = loaders.open_shards(url + "/", expected_max_length=16, verify=True, cache_dir=str(tmp_path / "cache"))
    assert view.path == url and len(view) == 24
    assert row_ids(view.read([23, 0, 9])).tolist() == [23, 0, 9]
    local = loaders.open_shards(str(tmp_path / "set"))
    for name in ("input_ids", "segment_ids", "loss_mask"):
        np.testing.assert_array_equal(view[17][name], local[17][name])

    ds = loaders.make_dataset(url, batch_size=4, seed=3, shard_index=0, shard_count=1, num_epochs=1, cache_dir=str(tmp_path / "cache"))
    seen = np.concatenate([row_ids(b) for b in ds])
    assert sorted(seen.tolist()) == list(range(24))


def test_gs_errors_name_the_url(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=8, num_shards=2, max_length=16)
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(f"{gcs_prefix}/sets/none")
    assert str(e.value) == f"no manifest.json in {gcs_prefix}/sets/none: not a published shard set (an interrupted run leaves none)"

    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/sets/partial", skip=("rows-00001-of-00002.array_record",))
    with pytest.raises(loaders.ShardSetError) as e:
        loaders.open_shards(url)
    assert str(e.value).startswith(f"{url}/rows-00001-of-00002.array_record: shard file listed in {url}/manifest.json is missing")


def test_gs_reads_cost_one_request_per_shard_not_per_row(gcs_emulator, gcs_prefix, proxy, opened, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=60, num_shards=3, max_length=16)
    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/L16")
    cache = str(tmp_path / "cache")
    proxy.reset()
    ds = loaders.make_dataset(url, batch_size=4, seed=1, shard_index=0, shard_count=1, num_epochs=2, cache_dir=cache)
    rows = sum(len(b["input_ids"]) for b in ds)
    stats = proxy.stats()
    assert rows == 120
    # One GET per shard, plus the manifest, one listing and the client's one bucket lookup
    # on first use: far below one request per row.
    assert shard_downloads(stats) == {f"rows-0000{k}-of-00003.array_record": 1 for k in range(3)}
    assert stats["requests"] <= 3 + 3 and stats["requests"] / rows < 0.1
    # Each shard's footer is read once in this process (not by open, validation and Grain in turn).
    assert sorted(opened.values()) == [1, 1, 1]
    assert all(p.startswith(cache) for p in opened)

    # A second run on the same host reads the cached copies: no shard is fetched again.
    proxy.reset()
    again = loaders.make_dataset(url, batch_size=4, seed=1, shard_index=0, shard_count=1, num_epochs=1, cache_dir=cache)
    assert sum(len(b["input_ids"]) for b in again) == 60
    assert shard_downloads(proxy.stats()) == {}


def test_gs_batches_resume_and_host_splits_match_local(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=37, rows_per_shard=[12, 0, 20, 5], max_length=16)
    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/L16")
    cache = str(tmp_path / "cache")

    def batches(path, shard_index, state=None, limit=None, **kw):
        it = iter(loaders.make_dataset(path, 3, 7, shard_index, 2, 2, **kw))
        if state is not None:
            it.set_state(state)
        out = []
        for b in it:
            out.append(row_ids(b).tolist())
            if limit and len(out) == limit:
                return out, json.loads(json.dumps(it.get_state()))
        return out, None

    for host in range(2):
        local, _ = batches(str(tmp_path / "set"), host)
        remote, _ = batches(url, host, cache_dir=cache)
        assert remote == local  # same rows, same order, same host split as reading the local copy
        head, state = batches(url, host, limit=4, cache_dir=cache)
        tail, _ = batches(url, host, state=state, cache_dir=cache)
        assert head + tail == local  # exact resume from a JSON state


def test_gs_shard_with_other_bytes_is_refused_naming_the_url(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=20, num_shards=2, max_length=16)
    shard = tmp_path / "set" / "rows-00001-of-00002.array_record"
    data = bytearray(shard.read_bytes())
    data[200] ^= 0xFF  # same size, other bytes: only the content hash can tell
    shard.write_bytes(bytes(data))
    build_shard_set(tmp_path / "good", num_rows=20, num_shards=2, max_length=16)
    os.replace(tmp_path / "good" / "manifest.json", tmp_path / "set" / "manifest.json")
    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/L16")

    view = loaders.open_shards(url, cache_dir=str(tmp_path / "cache"))  # sizes match: opening is fine
    assert row_ids(view.read([0, 9])).tolist() == [0, 9]
    with pytest.raises(loaders.ShardSetError) as e:
        view[15]
    assert str(e.value).startswith(f"{url}/rows-00001-of-00002.array_record: downloaded ")
    assert str(e.value).endswith("; the file is corrupt or was replaced")
    with pytest.raises(loaders.ShardSetError, match=r"rows-00001-of-00002.array_record: downloaded .* the file is corrupt"):
        loaders.open_shards(url, verify=True, cache_dir=str(tmp_path / "cache2"))
    # Nothing unchecked is left in the cache for a later run to trust.
    assert sorted(os.listdir(tmp_path / "cache2")) == sorted(
        [f"{s.sha256}.array_record" for s in view.manifest.shards[:1]] + [f"{s.sha256}.array_record.lock" for s in view.manifest.shards]
    )


def test_gs_cache_that_cannot_be_written_says_what_to_do(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=4, num_shards=1, max_length=16)
    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/L16")
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("")
    view = loaders.open_shards(url, cache_dir=str(blocked))
    with pytest.raises(loaders.ShardSetError) as e:
        view[0]
    message = str(e.value)
    assert message.startswith(f"{url}/rows-00000-of-00001.array_record: could not copy the shard into the local shard cache {blocked} (")
    assert message.endswith("point cache_dir or $PREPACK_SHARD_CACHE at a bigger disk, or read through a gcsfuse mount")


def test_gs_worker_processes_share_the_cache(gcs_emulator, gcs_prefix, proxy, tmp_path):  # noqa: F811
    build_shard_set(tmp_path / "set", num_rows=24, num_shards=3, max_length=16)
    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/L16")
    reference = [row_ids(b).tolist() for b in loaders.make_dataset(str(tmp_path / "set"), 4, 2, 0, 1, 1)]
    proxy.reset()
    ds = loaders.make_dataset(url, 4, 2, 0, 1, 1, worker_count=2, cache_dir=str(tmp_path / "cache"))
    assert [row_ids(b).tolist() for b in ds] == reference
    # Three processes (this one and two workers) fetch through one cache: each shard once.
    assert sorted(shard_downloads(proxy.stats()).values()) == [1, 1, 1]


def test_footer_read_once_per_shard_on_local_sets(opened, tmp_path):
    build_shard_set(tmp_path / "set", num_rows=30, num_shards=3, max_length=16)
    ds = loaders.make_dataset(str(tmp_path / "set"), 4, 0, 0, 1, 2, read_threads=4)
    assert sum(len(b["input_ids"]) for b in ds) == 60
    assert sorted(opened.values()) == [1, 1, 1]


def test_corrupt_record_names_the_shard_file(tmp_path):
    # A byte flipped in a later record: the open checks (footer, first record) pass,
    # and the read of that record fails with the file, the record and what to do.
    path = tmp_path / "set"
    build_shard_set(path, num_rows=20, num_shards=1, max_length=64)
    shard = path / "rows-00000-of-00001.array_record"
    data = bytearray(shard.read_bytes())
    data[4000] ^= 0xFF
    shard.write_bytes(bytes(data))
    view = loaders.open_shards(str(path))
    bad = []
    for i in range(20):
        try:
            view[i]
        except loaders.ShardSetError as e:
            bad.append((i, str(e)))
    assert bad, "the flipped byte should fall in one record"
    i, message = bad[0]
    assert message.startswith(f"{shard}: record {i} (row {i}) is unreadable, the file is corrupt (")
    assert message.endswith("); republish the set or check it with verify=True")


def test_read_threads_follow_the_location(tmp_path, monkeypatch):
    build_shard_set(tmp_path / "set", num_rows=4, num_shards=1, max_length=16)
    view = loaders.open_shards(str(tmp_path / "set"))
    assert default_read_threads(view) == READ_THREADS_LOCAL == 1
    monkeypatch.setattr(mounts, "_mount_points", lambda: [("/", "ext4"), (str(tmp_path), "fuse.gcsfuse")])
    assert mounts.is_network_mount(str(tmp_path / "set")) and default_read_threads(view) == READ_THREADS_NETWORK_MOUNT
    monkeypatch.setattr(mounts, "_mount_points", lambda: [("/", "ext4"), (str(tmp_path) + "-other", "fuse.gcsfuse")])
    assert not mounts.is_network_mount(str(tmp_path / "set"))
    remote = loaders.ShardView("gs://bucket/set", view.manifest)
    assert remote.is_remote and default_read_threads(remote) == READ_THREADS_GCS


def test_delay_proxy_holds_each_request_and_counts_it(gcs_emulator, gcs_prefix, tmp_path, monkeypatch):  # noqa: F811
    # The benchmark rig's premise: every request waits at least the delay (a lower bound,
    # so no timing luck), and the counts are what passed through.
    import time

    build_shard_set(tmp_path / "set", num_rows=4, num_shards=1, max_length=16)
    url = upload(gcs_emulator, str(tmp_path / "set"), f"{gcs_prefix}/L16")
    with start_proxy(gcs_emulator.endpoint, delay_ms=40) as p:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", p.endpoint)
        storage.read_text(f"{url}/manifest.json")  # the client's first-use lookups
        p.reset()
        start = time.perf_counter()
        for _ in range(3):
            assert json.loads(storage.read_text(f"{url}/manifest.json"))["num_rows"] == 4
        elapsed = time.perf_counter() - start
        stats = p.stats()
    assert elapsed >= 3 * 0.040
    assert stats["requests"] == 3 and stats["bytes_down"] > 0
    assert list(stats["by_path"].values()) == [3]
