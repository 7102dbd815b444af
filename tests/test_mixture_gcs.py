"""A mixture file on gs://, read through the storage interface against the local GCS emulator:
the same validation as a local file, relative inputs against the file's own gs:// folder, and a
real `prepack pack --mixture gs://...` and `prepack preflight --mixture gs://...` run."""

from __future__ import annotations

import json
import os

import pytest

from prepack.mixture_file import load_mixture
from prepack.packing.mixture import MAX_FILE_BYTES, MixtureError
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.pipeline import IN_PROCESS, alpaca_records, chat_records, shard_bytes, write_jsonl

MIX = """\
weight_of: examples
max_repeats: 2
sources:
  - name: alpaca
    input: data/alpaca.jsonl
    format: alpaca
    weight: 2
  - name: chat
    input: [../shared/chat.jsonl]
    format: chat
    weight: 1
"""


def upload_text(emulator, url: str, text: str | bytes, tmp_path, name: str = "upload") -> str:
    local = tmp_path / name
    local.write_bytes(text.encode() if isinstance(text, str) else text)
    emulator.upload_file(str(local), url)
    return url


def test_gcs_file_resolves_relative_inputs_against_its_gcs_folder(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    url = upload_text(gcs_emulator, f"{gcs_prefix}/mixes/mix.yaml", MIX, tmp_path)
    (tmp_path / "mixes").mkdir()
    local = tmp_path / "mixes" / "mix.yaml"
    local.write_text(MIX)
    remote, here = load_mixture(url), load_mixture(str(local))
    assert [s.inputs for s in remote.sources] == [(f"{gcs_prefix}/mixes/data/alpaca.jsonl",),
                                                  (f"{gcs_prefix}/shared/chat.jsonl",)]
    # One resolution rule: the same relative specs land in the same places under each folder.
    assert [s.inputs for s in here.sources] == [(str(tmp_path / "mixes" / "data" / "alpaca.jsonl"),),
                                                (str(tmp_path / "shared" / "chat.jsonl"),)]
    assert remote.path == url and remote.sha256 == here.sha256
    assert [s.describe() | {"inputs": None} for s in remote.sources] == [s.describe() | {"inputs": None} for s in here.sources]


def test_gcs_file_at_the_bucket_root_and_absolute_specs(gcs_emulator, tmp_path):  # noqa: F811
    doc = {"sources": [{"name": "a", "input": ["x/a.jsonl", "gs://other/b.jsonl", "hf:org/ds", "/abs/c.jsonl"],
                        "format": "alpaca", "weight": 1}]}
    url = upload_text(gcs_emulator, gcs_emulator.url("root-mix.json"), json.dumps(doc), tmp_path)
    assert load_mixture(url).sources[0].inputs == (gcs_emulator.url("x/a.jsonl"), "gs://other/b.jsonl", "hf:org/ds",
                                                   "/abs/c.jsonl")


def test_a_relative_input_may_not_climb_out_of_the_bucket(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    url = upload_text(gcs_emulator, f"{gcs_prefix}/mix.yaml",
                      "sources:\n  - {name: a, input: ../../../x.jsonl, format: alpaca, weight: 1}\n", tmp_path)
    with pytest.raises(MixtureError) as e:
        load_mixture(url)
    bucket = gcs_emulator.bucket
    assert str(e.value) == (f"mixture file {url}: source 'a': input '../../../x.jsonl' climbs out of gs://{bucket}/; "
                            "name a path inside the bucket or a full gs:// URL")


def test_a_missing_gcs_file_is_one_line(gcs_emulator, gcs_prefix):  # noqa: F811
    url = f"{gcs_prefix}/nowhere/mix.yaml"
    with pytest.raises(MixtureError) as e:
        load_mixture(url)
    assert str(e.value) == f"mixture file {url}: cannot be read (no such file or object); check the path"


def test_an_oversized_gcs_file_is_refused_from_its_first_bytes(gcs_emulator, gcs_prefix, tmp_path, monkeypatch):  # noqa: F811
    from prepack.storage import gcs

    url = upload_text(gcs_emulator, f"{gcs_prefix}/big.yaml", b"#" * (3 * MAX_FILE_BYTES), tmp_path)
    got = []
    real = gcs.GcsStorage.read_head
    monkeypatch.setattr(gcs.GcsStorage, "read_head", lambda self, p, n: got.append(real(self, p, n)) or got[-1])
    with pytest.raises(MixtureError) as e:
        load_mixture(url)
    assert str(e.value) == (f"mixture file {url}: larger than {MAX_FILE_BYTES:,} bytes; a mixture file names its "
                            "sources' inputs, it does not hold data")
    assert [len(b) for b in got] == [MAX_FILE_BYTES + 1]  # a ranged read, not the 3 MiB object


def test_a_gcs_file_gets_the_strict_validator(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    url = upload_text(gcs_emulator, f"{gcs_prefix}/dup.yaml",
                      "sources:\n  - {name: a, name: b, input: x.jsonl, format: alpaca, weight: 1}\n", tmp_path)
    with pytest.raises(MixtureError) as e:
        load_mixture(url)
    assert str(e.value).startswith(f"mixture file {url}: ") and "duplicate key 'name'" in str(e.value)
    empty = upload_text(gcs_emulator, f"{gcs_prefix}/empty.yaml", b"", tmp_path)
    with pytest.raises(MixtureError, match=r"^mixture file .*/empty.yaml: must be a mapping with keys"):
        load_mixture(empty)


def write_sources(folder) -> None:
    os.makedirs(folder / "mixes" / "data", exist_ok=True)
    os.makedirs(folder / "shared", exist_ok=True)
    write_jsonl(str(folder / "mixes" / "data" / "alpaca.jsonl"), alpaca_records(40, seed=5))
    write_jsonl(str(folder / "shared" / "chat.jsonl"), chat_records(12))
    (folder / "mixes" / "mix.yaml").write_text(MIX)


def test_pack_with_a_gcs_mixture_equals_the_local_run(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    """`prepack pack --mixture gs://.../mix.yaml` with its sources beside it on gs:// writes the
    same shards as the same files on local disk."""
    from pipelines.launch.cli import main

    write_sources(tmp_path)
    for rel in ("mixes/mix.yaml", "mixes/data/alpaca.jsonl", "shared/chat.jsonl"):
        gcs_emulator.upload_file(str(tmp_path / rel), f"{gcs_prefix}/{rel}")
    common = ["--max-length", "128", "--num-shards", "2", "--no-progress", *IN_PROCESS]
    assert main(["--mixture", str(tmp_path / "mixes" / "mix.yaml"), "--output", str(tmp_path / "local"), *common]) == 0
    assert main(["--mixture", f"{gcs_prefix}/mixes/mix.yaml", "--output", str(tmp_path / "remote"), *common]) == 0
    local, remote = shard_bytes(str(tmp_path / "local" / "L128")), shard_bytes(str(tmp_path / "remote" / "L128"))
    assert local and local == remote
    manifest = json.loads((tmp_path / "remote" / "L128" / "manifest.json").read_text())
    assert [i["spec"] for i in manifest["inputs"]] == [f"{gcs_prefix}/mixes/data/alpaca.jsonl", f"{gcs_prefix}/shared/chat.jsonl"]
    assert [s["name"] for s in manifest["mixture"]["sources"]] == ["alpaca", "chat"]


def test_preflight_reads_a_gcs_mixture(gcs_emulator, gcs_prefix, tmp_path, capsys):  # noqa: F811
    from apps.preflight import main

    write_sources(tmp_path)
    for rel in ("mixes/mix.yaml", "mixes/data/alpaca.jsonl", "shared/chat.jsonl"):
        gcs_emulator.upload_file(str(tmp_path / rel), f"{gcs_prefix}/{rel}")
    assert main(["--mixture", f"{gcs_prefix}/mixes/mix.yaml", "--output", str(tmp_path / "pf"),
                 "--max-length", "128", "--no-plots"]) == 0
    assert main(["--mixture", f"{gcs_prefix}/mixes/gone.yaml", "--output", str(tmp_path / "pf2"),
                 "--max-length", "128", "--no-plots"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(
        f"mixture file {gcs_prefix}/mixes/gone.yaml: cannot be read (no such file or object); check the path")
