"""A mixture file on gs:// (the local GCS emulator, never the network): `prepack pack` and
`prepack preflight` read it through the storage interface, with the size cap and the strict
validator applied to its bytes, and its relative inputs resolve against its own gs:// folder
by the same rule as a local file's."""

from __future__ import annotations

import json
import os

import pytest

from prepack.mixture_file import load_mixture
from prepack.packing.mixture import MAX_FILE_BYTES, MixtureError
from prepack.storage import storage_for
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.pipeline import IN_PROCESS, shard_bytes

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "prepack", "sample_data")
RELATIVE = """\
sources:
  - name: a
    input: [data/a.jsonl, ./data/../data/b.jsonl]
    format: alpaca
    weight: 1
  - name: b
    input: ../shared/chat.jsonl
    format: chat
    weight: 2
  - name: c
    input: [gs://other/x.jsonl, hf:tatsu-lab/alpaca:train, /abs/c.jsonl]
    format: alpaca
    weight: 1
"""


def upload(gcs_emulator, url: str, data: bytes) -> None:
    bucket, key = gcs_emulator.split(url)
    gcs_emulator.client().bucket(bucket).blob(key).upload_from_string(data)


def refusal(path: str) -> str:
    with pytest.raises(MixtureError) as e:
        load_mixture(path)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_relative_inputs_resolve_against_the_files_own_folder_local_and_gcs(gcs_emulator, gcs_prefix, tmp_path):
    url = f"{gcs_prefix}/mixes/mix.yaml"
    upload(gcs_emulator, url, RELATIVE.encode())
    (tmp_path / "mixes").mkdir()
    (tmp_path / "mixes" / "mix.yaml").write_text(RELATIVE)
    # --allow-local-inputs: the gs:// file may name /abs/c.jsonl (test_local_paths_in_a_gcs_mixture_...)
    remote, local = load_mixture(url, allow_local_inputs=True), load_mixture(str(tmp_path / "mixes" / "mix.yaml"))
    assert remote.path == url and remote.sha256 == local.sha256
    assert [s.inputs for s in remote.sources] == [
        (f"{gcs_prefix}/mixes/data/a.jsonl", f"{gcs_prefix}/mixes/data/b.jsonl"),
        (f"{gcs_prefix}/shared/chat.jsonl",),
        ("gs://other/x.jsonl", "hf:tatsu-lab/alpaca:train", "/abs/c.jsonl"),
    ]
    # One rule for both: the local file's inputs are the same paths under its own folder.
    assert [s.inputs for s in local.sources] == [
        tuple(spec.replace(gcs_prefix, str(tmp_path)) for spec in s.inputs) for s in remote.sources]


def test_a_file_at_the_bucket_root_and_dot_dot_stay_in_the_bucket(gcs_emulator):
    url = gcs_emulator.url("mix-at-root.yaml")
    upload(gcs_emulator, url, RELATIVE.encode())
    inputs = [s.inputs for s in load_mixture(url, allow_local_inputs=True).sources]
    bucket = f"gs://{gcs_emulator.bucket}"
    assert inputs[0] == (f"{bucket}/data/a.jsonl", f"{bucket}/data/b.jsonl") and inputs[1] == (f"{bucket}/shared/chat.jsonl",)


@pytest.mark.parametrize("spec", ["/etc/hostname", "/home/user/*.jsonl", "hf:/data/saved", "hf:./saved"])
def test_local_paths_in_a_gcs_mixture_are_refused_unless_the_user_says_so(gcs_emulator, gcs_prefix, spec, tmp_path, capsys):
    """A mixture file on gs:// named absolute local paths: the job read this machine's files and
    their raw lines landed in the gs:// set's dead letter. It reaches outside its own storage
    only with --allow-local-inputs; relative inputs stay in its bucket, Hub and TFDS names pass."""
    from apps import preflight
    from pipelines.launch.cli import main

    url = f"{gcs_prefix}/mixes/mix.yaml"
    text = f"sources:\n  - name: a\n    input: [data/a.jsonl, hf:org/set, tfds:mnist]\n    format: alpaca\n    weight: 1\n" \
           f"  - name: b\n    input: [gs://other/b.jsonl, '{spec}']\n    format: alpaca\n    weight: 1\n"
    upload(gcs_emulator, url, text.encode())
    expected = (f"mixture file {url}: source 'b' names the local path {spec!r}; a mixture file on gs:// names gs:// inputs "
                "only (it could make the job read this machine's files): pass --allow-local-inputs if you mean it")
    assert refusal(url) == expected
    assert main(["--mixture", url, "--output", f"{gcs_prefix}/out", "--no-progress", *IN_PROCESS]) == 2
    assert capsys.readouterr().err == f"prepack pack: {expected}\n"
    assert preflight.main(["--mixture", url, "--output", str(tmp_path / "pre"), "--no-plots"]) == 2
    assert capsys.readouterr().err == f"prepack preflight: error: {expected}\n"
    assert load_mixture(url, allow_local_inputs=True).sources[1].inputs == ("gs://other/b.jsonl", spec)
    from pipelines.options import parse_args

    config, _ = parse_args(["--mixture", url, "--allow-local-inputs", "--output", str(tmp_path / "o")])
    assert spec in config.rows.inputs
    local = tmp_path / "mix.yaml"  # the user's own file: its local paths are what they named
    local.write_text(text)
    assert load_mixture(str(local)).sources[1].inputs[1] == spec


def test_gcs_refusals_are_one_line(gcs_emulator, gcs_prefix):
    missing = f"{gcs_prefix}/nope.yaml"
    assert refusal(missing) == f"mixture file {missing}: cannot be read (no such file); check the path"
    big = f"{gcs_prefix}/big.yaml"
    upload(gcs_emulator, big, b"# " + b"x" * (3 * MAX_FILE_BYTES) + b"\n")
    # A ranged read: one byte past the cap comes back, not the object.
    assert len(storage_for(big).read_head(big, MAX_FILE_BYTES + 1)) == MAX_FILE_BYTES + 1
    assert refusal(big) == (f"mixture file {big}: larger than {MAX_FILE_BYTES:,} bytes; a mixture file names its "
                            "sources' inputs, it does not hold data")
    alias = f"{gcs_prefix}/alias.yaml"
    upload(gcs_emulator, alias, RELATIVE.replace("name: a\n", "name: &n a\n").replace("name: b\n", "name: *n\n").encode())
    assert refusal(alias) == (f"mixture file {alias}: line 2: anchors and aliases (&name, *name) are not allowed; "
                              "write each value out")
    dup = f"{gcs_prefix}/dup.json"
    upload(gcs_emulator, dup, b'{"sources": [], "sources": []}')
    assert refusal(dup) == f"mixture file {dup}: line 1: duplicate key 'sources'; each key may appear once"
    empty = f"{gcs_prefix}/empty.yaml"
    upload(gcs_emulator, empty, b"")
    assert refusal(empty).startswith(f"mixture file {empty}: must be a mapping with keys max_repeats, sources, weight_of")
    assert refusal("gs://") == "mixture file gs://: cannot be read (gs://: a gs:// path needs a bucket name)"


def test_a_local_file_that_cannot_be_read_is_one_line(tmp_path):
    assert refusal(str(tmp_path / "nope.yaml")) == f"mixture file {tmp_path}/nope.yaml: cannot be read (no such file); check the path"
    assert refusal(str(tmp_path)) == f"mixture file {tmp_path}: cannot be read (Is a directory)"


@pytest.fixture
def sample_mix_on_gcs(gcs_emulator, gcs_prefix) -> str:
    """The shipped sample mixture and its two inputs, uploaded side by side (its inputs are relative)."""
    for name in ("sample_mix.yaml", "sample_sft.jsonl", "sample_chat.jsonl"):
        gcs_emulator.upload_file(os.path.join(SAMPLES, name), f"{gcs_prefix}/mix/{name}")
    return f"{gcs_prefix}/mix/sample_mix.yaml"


def test_pack_mixture_from_gcs_writes_the_rows_of_the_local_file(sample_mix_on_gcs, tmp_path):
    from pipelines.launch.cli import main

    outs = {}
    for where, mix in (("gcs", sample_mix_on_gcs), ("local", os.path.join(SAMPLES, "sample_mix.yaml"))):
        outs[where] = str(tmp_path / where)
        assert main(["--mixture", mix, "--max-length", "512", "--output", outs[where], "--no-progress", *IN_PROCESS]) == 0
    manifests = {w: json.loads(open(f"{o}/L512/manifest.json").read()) for w, o in outs.items()}
    assert manifests["gcs"]["mixture"] == manifests["local"]["mixture"]
    assert [i["spec"] for i in manifests["gcs"]["inputs"]] == [
        f"{sample_mix_on_gcs.rsplit('/', 1)[0]}/{n}" for n in ("sample_sft.jsonl", "sample_chat.jsonl")]
    rows = {w: {n: b for n, b in shard_bytes(f"{o}/L512").items() if n.endswith(".array_record")} for w, o in outs.items()}
    assert rows["gcs"] == rows["local"] and rows["gcs"]  # the dead letters differ only in where the inputs were


def test_preflight_mixture_from_gcs_forecasts_what_the_local_file_does(sample_mix_on_gcs, tmp_path, capsys):
    from apps.preflight import main

    results = {}
    for where, mix in (("gcs", sample_mix_on_gcs), ("local", os.path.join(SAMPLES, "sample_mix.yaml"))):
        assert main(["--mixture", mix, "--max-length", "512", "--output", str(tmp_path / where), "--no-plots"]) == 0
        results[where] = json.loads((tmp_path / where / "preflight.json").read_text())
    assert f"mixture {sample_mix_on_gcs} (weight_of target_tokens" in capsys.readouterr().out
    assert results["gcs"]["mixture"]["rows"] == results["local"]["mixture"]["rows"] and results["gcs"]["mixture"]["rows"]


def test_pack_refuses_an_unreadable_gcs_mixture_in_one_line(gcs_prefix, capsys):
    from pipelines.launch.cli import main

    assert main(["--mixture", f"{gcs_prefix}/none.yaml", "--output", f"{gcs_prefix}/out", "--no-progress", *IN_PROCESS]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"mixture file {gcs_prefix}/none.yaml: cannot be read (no such file); check the path")
    assert len(err.splitlines()) == 1
