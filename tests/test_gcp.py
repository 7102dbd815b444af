"""The packing job and the loader against a real local GCS emulator (tests/gcs_emulator.py).

What runs through the emulator is the code that runs on Dataflow and on TPU VMs:
Beam's GcsIO (resumable uploads, listing, batch copy+delete for renames) in the
job's writer and publish steps, google-cloud-storage in the loader, and
array_record's own C++ gs:// reader (google-cloud-cpp) for the shard records.

The job runs on the in-process FnApiRunner, so failures can be injected with
monkeypatch into the very DoFns that run.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np
import pytest

from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl
from testkit.gcs_emulator import GcsEmulator, gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)

MAX_LENGTH = 128
NUM_SHARDS = 3


def pack(args: list[str]) -> int:
    """Runs `prepack pack` through its CLI entry point, as a user (or Dataflow launcher) would."""
    from pipelines.launch.cli import main

    return main(args + ["--no-progress", *IN_PROCESS])


def job_args(input_spec: str, output: str) -> list[str]:
    return ["--input", input_spec, "--format", "alpaca", "--output", output,
            "--max-length", str(MAX_LENGTH), "--num-shards", str(NUM_SHARDS)]


def comparable_manifest(text: str) -> dict:
    """The manifest without what legitimately differs between the two runs:
    created_at, and where the (identical) input file was read from."""
    from prepack.format.manifest import without_volatile

    data = without_volatile(text)
    for item in data["inputs"]:
        item.pop("spec")
    return data


def gcs_objects(emulator: GcsEmulator, url: str) -> list[str]:
    return emulator.list(url)


@pytest.fixture(scope="module")
def input_file(tmp_path_factory) -> str:
    return write_jsonl(str(tmp_path_factory.mktemp("gcp-in") / "alpaca.jsonl"), alpaca_records(48, seed=3))


@pytest.fixture(scope="module")
def local_run(input_file, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("gcp-local") / "out")
    assert pack(job_args(input_file, out)) == 0
    return f"{out}/L{MAX_LENGTH}"


@pytest.fixture(scope="module")
def gcs_run(gcs_emulator, input_file) -> str:
    """The same job with its input and output on gs:// (as on Dataflow, where workers
    cannot see the launcher's disk)."""
    base = gcs_emulator.url("test_gcp-module")
    gcs_input = f"{base}/in/alpaca.jsonl"
    gcs_emulator.upload_file(input_file, gcs_input)
    assert pack(job_args(gcs_input, f"{base}/out")) == 0
    return f"{base}/out/L{MAX_LENGTH}"


# ----------------------------------------------------------------------------- the emulator itself


def test_emulator_serves_beam_and_array_record(gcs_emulator, gcs_prefix, tmp_path):
    """What the job and the loader rely on, each checked directly: a multi-chunk resumable
    upload, the storage interface's move (copy, then delete), and array_record's C++ reader on a
    file over 1 MiB (its footer is fetched with a suffix range, which the stock emulator ignores)."""
    from prepack.storage import storage_for
    from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

    rng = np.random.default_rng(0)
    records = [rng.integers(0, 256, size=48_000, dtype=np.uint8).tobytes() for _ in range(32)]
    local = str(tmp_path / "big.array_record")
    writer = ArrayRecordWriter(local, "group_size:1,zstd:3")
    for r in records:
        writer.write(r)
    writer.close()
    assert os.path.getsize(local) > 1 << 20

    staged, final = f"{gcs_prefix}/staging/big.array_record", f"{gcs_prefix}/final/big.array_record"
    blob = gcs_emulator.client().bucket(gcs_emulator.bucket).blob(gcs_emulator.split(staged)[1])
    blob.chunk_size = 256 * 1024  # several resumable chunks
    blob.upload_from_filename(local)
    storage_for(staged).move([staged], [final])
    assert gcs_objects(gcs_emulator, gcs_prefix) == ["final/big.array_record"]
    assert gcs_emulator.read_bytes(final) == open(local, "rb").read()

    for options in ("readahead_buffer_size:0", ""):  # the loader's options, and the default (parallel prefetch)
        reader = ArrayRecordReader(final, options)
        try:
            assert reader.num_records() == len(records)
            assert reader.read([31, 0, 17]) == [records[31], records[0], records[17]]
            reader.seek(5)
            assert reader.read() == records[5]
            assert reader.read_all() == records
        finally:
            reader.close()


# ----------------------------------------------------------------------------- the job on gs://


def test_job_on_gcs_matches_local_run_byte_for_byte(gcs_emulator, local_run, gcs_run):
    names = gcs_objects(gcs_emulator, gcs_run)
    # Exactly a published set: no staging prefix, temp manifest or probe left behind.
    assert names == sorted(os.listdir(local_run))
    assert names[0] == "manifest.json"
    assert [re.sub(r"-[0-9a-f]{12}\.", ".", n) for n in names[1:]] == [
        f"rows-{i:05d}-of-{NUM_SHARDS:05d}.array_record" for i in range(NUM_SHARDS)
    ]
    local_manifest = open(os.path.join(local_run, "manifest.json"), encoding="utf-8").read()
    gcs_manifest = gcs_emulator.read_bytes(f"{gcs_run}/manifest.json").decode("utf-8")
    assert comparable_manifest(gcs_manifest) == comparable_manifest(local_manifest)
    for name in names:
        if name.endswith(".array_record"):
            assert gcs_emulator.read_bytes(f"{gcs_run}/{name}") == open(os.path.join(local_run, name), "rb").read(), name
    # Nothing else was written anywhere under the job's output.
    out = gcs_run.rsplit("/", 1)[0]
    others = [n for n in gcs_objects(gcs_emulator, out) if not n.startswith(f"L{MAX_LENGTH}/")]
    assert [n for n in others if not n.startswith("tokens/tokens-")] == ["published.json", "tokens/manifest.json"]
    assert others[2:] and all(re.fullmatch(r"tokens/tokens-[0-9a-f]{16}\.array_record", n) for n in others[2:])


def test_from_tokens_on_gcs_equals_a_full_run_on_gcs(gcs_emulator, gcs_prefix, gcs_run):
    """--from-tokens reads the tokenized set from gs:// (GcsIO, as on Dataflow) and writes
    gs://: the same shards, dead letter and manifest as a full run from the gs:// input."""
    from prepack.format.manifest import without_volatile

    base = gcs_run.rsplit("/", 2)[0]
    from_out, full_out = f"{gcs_prefix}/from", f"{gcs_prefix}/full"
    assert pack(["--from-tokens", f"{base}/out/tokens", "--output", from_out, "--max-length", "512", "--num-shards", "2"]) == 0
    assert pack(job_args(f"{base}/in/alpaca.jsonl", full_out)[:-4] + ["--max-length", "512", "--num-shards", "2",
                                                                     "--no-tokens"]) == 0
    names = gcs_objects(gcs_emulator, f"{full_out}/L512")
    assert names == gcs_objects(gcs_emulator, f"{from_out}/L512") and len(names) == 3
    for name in names:
        a, b = gcs_emulator.read_bytes(f"{from_out}/L512/{name}"), gcs_emulator.read_bytes(f"{full_out}/L512/{name}")
        if name == "manifest.json":
            got, want = without_volatile(a.decode()), without_volatile(b.decode())
            assert got.pop("lineage")["from_tokens"] == f"{base}/out/tokens" and want.pop("lineage") is None
            assert got == want
        else:
            assert a == b, name


def test_loader_reads_the_gcs_set_like_the_local_one(local_run, gcs_run):
    import loaders

    manifest = json.load(open(os.path.join(local_run, "manifest.json"), encoding="utf-8"))
    gcs_view = loaders.open_shards(gcs_run, expected_max_length=MAX_LENGTH, tokenizer=manifest["tokenizer"], verify=True)
    local_view = loaders.open_shards(local_run, expected_max_length=MAX_LENGTH)
    try:
        assert len(gcs_view) == len(local_view) == manifest["num_rows"]
        everything = np.arange(len(local_view))
        assert gcs_view.records(everything) == local_view.records(everything)
        a, b = gcs_view.read(everything[::-1]), local_view.read(everything[::-1])
        assert sorted(a) == sorted(b)
        for field in a:
            np.testing.assert_array_equal(a[field], b[field])
    finally:
        gcs_view.close()
        local_view.close()
    # Grain's pipeline over the gs:// set yields every row once per epoch.
    ds = loaders.make_dataset(gcs_run, batch_size=4, seed=1, shard_index=0, shard_count=1, num_epochs=1,
                              drop_remainder=False, read_threads=2)
    rows = np.concatenate([batch["input_ids"] for batch in ds])
    local_rows = np.stack([local_view[i]["input_ids"] for i in range(len(local_view))])
    assert sorted(map(bytes, rows)) == sorted(map(bytes, local_rows))


# ----------------------------------------------------------------------------- interrupted runs


def _interrupt_upload_of_shard(monkeypatch, shard_index: int) -> None:
    """The copy of one shard from the worker's disk to GCS dies half way, as on a lost worker
    or a dropped connection; the other shards upload normally."""
    from pipelines.stages import write as writer
    from prepack.storage import create_stream

    original = writer.copy_local_to
    victim = f"rows-{shard_index:05d}-of-"

    def copy_then_fail(local_path: str, dest: str) -> None:
        if victim not in dest:
            return original(local_path, dest)
        data = open(local_path, "rb").read()
        with create_stream(dest) as f:
            f.write(data[: len(data) // 2])
            raise ConnectionResetError(f"injected: upload of {dest} interrupted")

    monkeypatch.setattr(writer, "copy_local_to", copy_then_fail)


def test_interrupted_upload_publishes_no_manifest(gcs_emulator, gcs_prefix, gcs_run, monkeypatch):
    _interrupt_upload_of_shard(monkeypatch, 1)
    out = f"{gcs_prefix}/out"
    with pytest.raises(Exception, match="injected: upload"):
        pack(job_args(f"{gcs_run.rsplit('/', 2)[0]}/in/alpaca.jsonl", out))
    left = gcs_objects(gcs_emulator, out)
    assert not [n for n in left if n.endswith("manifest.json")]
    assert left == [], f"staging not cleaned up: {left}"


def test_interrupted_overwrite_keeps_the_published_gcs_set(gcs_emulator, gcs_run, monkeypatch):
    """--overwrite over a published gs:// set, and the run dies in the copy step:
    readers still find the old set, byte for byte."""
    before = {n: gcs_emulator.read_bytes(f"{gcs_run}/{n}") for n in gcs_objects(gcs_emulator, gcs_run)}
    _interrupt_upload_of_shard(monkeypatch, 0)
    base = gcs_run.rsplit("/", 2)[0]
    with pytest.raises(Exception, match="injected: upload"):
        pack(job_args(f"{base}/in/alpaca.jsonl", f"{base}/out") + ["--overwrite"])
    after = {n: gcs_emulator.read_bytes(f"{gcs_run}/{n}") for n in gcs_objects(gcs_emulator, gcs_run)}
    assert after == before


def test_crash_before_the_manifest_leaves_an_unpublished_folder(gcs_emulator, gcs_prefix, gcs_run, monkeypatch):
    """The launcher is interrupted after moving the shards into place but before switching
    manifest.json: the folder holds shards, and no reader accepts it."""
    import loaders
    from pipelines.faults import failpoints

    def die_before_the_manifest(name: str, detail: str | None = None) -> None:
        if name == "shards_in_place":
            raise KeyboardInterrupt("injected: launcher killed before the manifest")

    monkeypatch.setattr(failpoints, "hit", die_before_the_manifest)
    out = f"{gcs_prefix}/out"
    # The CLI turns an interrupt into exit status 130 after its cleanup.
    assert pack(job_args(f"{gcs_run.rsplit('/', 2)[0]}/in/alpaca.jsonl", out)) == 130
    assert not [n for n in gcs_objects(gcs_emulator, out) if n.endswith("manifest.json")]
    with pytest.raises(loaders.ShardSetError, match="no manifest.json"):
        loaders.open_shards(f"{out}/L{MAX_LENGTH}")


def test_jsonl_byte_ranges_read_from_gcs_like_local_ones(gcs_emulator, gcs_prefix, input_file, tmp_path, monkeypatch):
    """Byte-range reads seek inside a gs:// object (Beam's GcsIO); with ranges of a few hundred
    bytes the shards, manifest and dead letters equal a local run with the same ranges."""
    from pipelines.inputs import sources

    monkeypatch.setattr(sources, "JSONL_RANGE_MIN_BYTES", 300)
    monkeypatch.setattr(sources, "JSONL_RANGES_PER_FILE", 10_000)
    dirty = write_jsonl(str(tmp_path / "dirty.jsonl"), alpaca_records(20, seed=4), [b"{broken", b"", b"[1]"])
    gcs_input = f"{gcs_prefix}/in/dirty.jsonl"
    gcs_emulator.upload_file(dirty, gcs_input)
    assert len(sources.resolve_inputs([gcs_input])[1]) > 5
    local_out, gcs_out = str(tmp_path / "local"), f"{gcs_prefix}/out"
    extra = ["--max-bad-fraction", "0.2"]
    assert pack(job_args(dirty, local_out) + extra) == 0
    assert pack(job_args(gcs_input, gcs_out) + extra) == 0
    local_dir, gcs_dir = f"{local_out}/L{MAX_LENGTH}", f"{gcs_out}/L{MAX_LENGTH}"
    names = gcs_objects(gcs_emulator, gcs_dir)
    assert names == sorted(os.listdir(local_dir))
    for name in names:
        data = gcs_emulator.read_bytes(f"{gcs_dir}/{name}")
        local = open(os.path.join(local_dir, name), "rb").read()
        if name == "manifest.json":
            assert comparable_manifest(data.decode()) == comparable_manifest(local.decode())
        elif name == "dead_letter.jsonl":
            entries = [json.loads(line) for line in data.decode().splitlines()]
            assert [(e["source"]["line"], e["source"]["record"], e["reason"]) for e in entries] == [
                (21, 20, "malformed_json"), (23, 21, "not_an_object")]
            assert [e["source"]["line"] for e in entries] == [
                json.loads(line)["source"]["line"] for line in local.decode().splitlines()]
        else:
            assert data == local, name


def test_gcs_overwrite_is_exclusive_and_replaces_the_set_whole(gcs_emulator, gcs_prefix, input_file, tmp_path,
                                                               monkeypatch, capsys):
    """On gs:// (lock by ifGenerationMatch=0, manifest switched by a generation precondition): a
    second run while the first publishes is refused at start; the first replaces the old set,
    deletes its shards after the switch, and writes published.json."""
    import loaders
    from pipelines.faults import failpoints

    out = f"{gcs_prefix}/out"
    other = write_jsonl(str(tmp_path / "other.jsonl"), alpaca_records(30, seed=8))
    assert pack(job_args(other, out)) == 0
    old_names = set(gcs_objects(gcs_emulator, f"{out}/L{MAX_LENGTH}"))
    capsys.readouterr()
    refused = []

    def race(name: str, detail: str | None = None) -> None:
        if name == "shards_in_place" and not refused:
            refused.append(pack(job_args(input_file, out) + ["--overwrite"]))

    monkeypatch.setattr(failpoints, "hit", race)
    assert pack(job_args(input_file, out) + ["--overwrite"]) == 0
    assert refused == [1]
    assert f"prepack pack: {out} is being written by run " in capsys.readouterr().err
    names = set(gcs_objects(gcs_emulator, f"{out}/L{MAX_LENGTH}"))
    manifest = json.loads(gcs_emulator.read_bytes(f"{out}/L{MAX_LENGTH}/manifest.json"))
    assert names == {"manifest.json", *(s["path"] for s in manifest["shards"])}
    assert not (names & old_names) - {"manifest.json"}
    assert sorted(loaders.published_lengths(out)) == [MAX_LENGTH]
    with loaders.open_shards(f"{out}/L{MAX_LENGTH}", expected_max_length=MAX_LENGTH, verify=True) as view:
        assert len(view) == manifest["num_rows"]
    # The tokenized set published with it was replaced whole too: its manifest and the files it names.
    tokens = json.loads(gcs_emulator.read_bytes(f"{out}/tokens/manifest.json"))
    assert gcs_objects(gcs_emulator, out) == sorted(["published.json", *(f"L{MAX_LENGTH}/{n}" for n in names),
                                                     "tokens/manifest.json", *(f"tokens/{s['path']}" for s in tokens["shards"])])
