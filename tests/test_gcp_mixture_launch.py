"""`gcp/launch_dataflow.py --mixture FILE`: the launcher reads the mixture file (local or gs://,
on the local GCS emulator here, never the network), refuses a source a Dataflow worker cannot
read in one line, builds the mixture job with the real DataflowRunner offline (--validate, its
Mix step listed), and passes the packing options on to the job as a local run gets them."""

from __future__ import annotations

import os

import pytest

from gcp import dataflow_validate as dv
from gcp import launch_dataflow as ld
from pipelines.options import parse_args
from prepack.packing.packer import OverlongPolicy, Planner
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)

SAMPLES = os.path.join(os.path.dirname(__file__), "..", "prepack", "sample_data")
ON_GCS = """\
max_repeats: 2
sources:
  - name: alpaca
    input: gs://my-bucket/raw/alpaca.jsonl
    format: alpaca
    weight: 3
  - name: chat
    input: [gs://my-bucket/raw/chat-*.jsonl, hf:someone/chat:train]
    format: chat
    weight: 1
"""
BASE = ["--project", "my-proj", "--output", "gs://my-bucket/sets/mix", "--max-length", "512"]


def write(tmp_path, text: str, name: str = "mix.yaml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def refused(argv: list[str], capsys) -> str:
    assert ld.main(argv + ["--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.endswith("\n") and len(err.strip().splitlines()) == 1, err
    return err.strip()


def test_dry_run_passes_the_mixture_to_prepack_pack(tmp_path, capsys):
    path = write(tmp_path, ON_GCS)
    assert ld.main(BASE + ["--mixture", path, "--dry-run"]) == 0
    out = capsys.readouterr().out
    launch = ld.build_command(BASE + ["--mixture", path])
    assert launch.cmd[launch.cmd.index("--mixture") + 1] == path and "--input" not in launch.cmd and "--format" not in launch.cmd
    assert f"# --mixture" in out and "read by the launcher; its sources (alpaca, chat) by the workers" in out
    assert launch.warnings == ["hf: inputs are downloaded by the workers from the Hugging Face Hub: they need internet access"]


def test_options_given_to_the_launcher_arrive_in_the_mixture_jobs_config(tmp_path):
    """--planner, --max-segments-per-row and --overlong reach the Dataflow job's config (built by
    the real DataflowRunner, offline) as they reach a local run's."""
    path = write(tmp_path, ON_GCS)
    options = ["--planner", "bfd", "--max-segments-per-row", "4", "--overlong", "split"]
    launch = ld.build_command(BASE + ["--mixture", path, *options])
    job, _, config = dv.build_dry_run(launch.cmd[4:])
    local, _ = parse_args(["--mixture", path, "--output", str(tmp_path / "out"), "--max-length", "512", *options])
    assert (config.rows.planner, config.rows.max_segments_per_row, config.rows.overlong) == (Planner.BFD, 4, OverlongPolicy.SPLIT)
    for field in ("planner", "max_segments_per_row", "overlong", "max_lengths", "mixture", "inputs", "format"):
        assert getattr(config.rows, field) == getattr(local.rows, field), field
    assert config.rows.inputs == ("gs://my-bucket/raw/alpaca.jsonl", "gs://my-bucket/raw/chat-*.jsonl", "hf:someone/chat:train")
    assert "Mix" in dv.top_level_steps(job.proto_pipeline)


def test_validate_builds_the_mixture_job_from_a_file_on_gcs(gcs_emulator, gcs_prefix, capsys, monkeypatch):
    """The shipped sample mixture uploaded beside its data: its relative inputs resolve to gs://,
    and the real DataflowRunner builds the mixture job offline, its Mix step listed."""
    monkeypatch.setattr(ld, "run_job", lambda *a, **k: pytest.fail("--validate must not launch anything"))
    for name in ("sample_mix.yaml", "sample_sft.jsonl", "sample_chat.jsonl"):
        gcs_emulator.upload_file(os.path.join(SAMPLES, name), f"{gcs_prefix}/raw/{name}")
    mix = f"{gcs_prefix}/raw/sample_mix.yaml"
    # The report --validate printed is the one checked below: one build of the job, not two.
    reports = []
    monkeypatch.setattr(dv, "validate", lambda argv, validate=dv.validate: reports.append(validate(argv)) or reports[-1])
    assert ld.main(["--project", "my-proj", "--mixture", mix, "--output", f"{gcs_prefix}/sets/mix",
                    "--max-length", "512", "1024", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "steps: Read, Prepare, Fit, Mix, " in out and "problem" not in out, out
    assert out.strip().endswith("the job builds for Dataflow; run the same command without --validate to launch")
    (report,) = reports
    assert report.problems == [] and set(dv.EXPECTED_STEPS) <= set(report.steps)
    assert report.steps.index("Fit") < report.steps.index("Mix") < report.steps.index("Write")


def test_a_mixture_job_without_its_mix_step_is_a_problem(tmp_path, monkeypatch):
    """The Mix check can fail: a job whose graph has no step called Mix is reported."""
    import apache_beam as beam

    applied = beam.Pipeline.apply

    def mix_renamed(self, transform, pvalueish=None, label=None):
        return applied(self, transform, pvalueish, "Unmixed" if label == "Mix" else label)

    monkeypatch.setattr(beam.Pipeline, "apply", mix_renamed)
    report = dv.validate(ld.build_command(BASE + ["--mixture", write(tmp_path, ON_GCS)]).cmd[4:])
    assert report.problems[0] == "the Dataflow pipeline lacks the steps ['Mix']"


def test_a_local_source_is_refused_in_one_line(tmp_path, capsys):
    relative = write(tmp_path, ON_GCS.replace("gs://my-bucket/raw/alpaca.jsonl", "raw/alpaca.jsonl"))
    assert refused(BASE + ["--mixture", relative], capsys) == (
        f"launch_dataflow: mixture file {relative}: source 'alpaca' input '{tmp_path}/raw/alpaca.jsonl' is on the "
        "launcher's disk, which Dataflow workers cannot read; copy it to GCS first: gcloud storage cp "
        f"{tmp_path}/raw/alpaca.jsonl gs://BUCKET/raw/ and name it in the file (or upload the file beside its data: "
        "relative inputs resolve against the file's folder)")
    absolute = write(tmp_path, ON_GCS.replace("hf:someone/chat:train", "/data/my chat.jsonl"), "abs.yaml")
    assert refused(BASE + ["--mixture", absolute], capsys).startswith(
        f"launch_dataflow: mixture file {absolute}: source 'chat' input '/data/my chat.jsonl' is on the launcher's disk, "
        "which Dataflow workers cannot read; copy it to GCS first: gcloud storage cp '/data/my chat.jsonl' gs://BUCKET/raw/")


def test_a_local_source_in_a_file_on_gcs_is_refused_in_one_line(gcs_emulator, gcs_prefix, capsys):
    url = f"{gcs_prefix}/mix.yaml"
    bucket, key = gcs_emulator.split(url)
    gcs_emulator.client().bucket(bucket).blob(key).upload_from_string(ON_GCS.replace("hf:someone/chat:train", "/x.jsonl"))
    assert refused(BASE + ["--mixture", url], capsys).startswith(
        f"launch_dataflow: mixture file {url}: source 'chat' input '/x.jsonl' is on the launcher's disk")


def test_bad_mixture_launches_are_refused_in_one_line(tmp_path, capsys):
    path = write(tmp_path, ON_GCS)
    assert refused(BASE + ["--mixture", path, "--input", "gs://b/x.jsonl"], capsys) == (
        "launch_dataflow: --mixture names each source's inputs and format; do not combine it with --input")
    assert refused(BASE + ["--mixture", path, "--format", "alpaca"], capsys) == (
        "launch_dataflow: --mixture names each source's inputs and format; do not combine it with --format")
    missing = str(tmp_path / "nope.yaml")
    assert refused(BASE + ["--mixture", missing], capsys) == (
        f"launch_dataflow: mixture file {missing}: cannot be read (no such file); check the path")
    bomb = write(tmp_path, ON_GCS.replace("weight: 3", "weight: &w 3").replace("weight: 1", "weight: *w"), "bomb.yaml")
    assert refused(BASE + ["--mixture", bomb], capsys) == (
        f"launch_dataflow: mixture file {bomb}: line 6: anchors and aliases (&name, *name) are not allowed; "
        "write each value out")


def test_a_mixture_from_the_tokenized_set_reads_no_sources(tmp_path):
    """With --from-tokens the workers read the tokenized set, not the sources: local ones are fine."""
    path = write(tmp_path, ON_GCS.replace("gs://my-bucket/raw/alpaca.jsonl", "raw/alpaca.jsonl"))
    launch = ld.build_command(BASE + ["--mixture", path, "--from-tokens", "gs://my-bucket/sets/mix/tokens"])
    assert launch.cmd[launch.cmd.index("--from-tokens") + 1] == "gs://my-bucket/sets/mix/tokens"
    assert launch.cmd[launch.cmd.index("--mixture") + 1] == path
