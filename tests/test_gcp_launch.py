"""gcp/ tooling without a cloud: the Dataflow launcher's command (dry run, and parsed back by
`prepack pack` and Beam exactly as meant), what Beam stages for the workers, the worker
image's pins, and the TPU VM script's commands (dry run, and the real path against a
fake gcloud that records what it is asked to run)."""

from __future__ import annotations

import ast
import datetime
import os
import re
import shlex
import subprocess
import tarfile
from pathlib import Path

import pytest

from gcp import launch_dataflow as ld

REPO = Path(__file__).resolve().parent.parent
TPU_SCRIPT = REPO / "gcp" / "tpu_vm.sh"
BASE = ["--project", "my-proj", "--input", "gs://b/raw/*.jsonl", "--format", "alpaca", "--output", "gs://b/sets/alpaca"]
# What must never reach a Dataflow worker: the training stack.
TRAINING_ONLY = ("jax", "jaxlib", "google-tunix", "flax", "qwix", "grain", "orbax-checkpoint", "optax", "tensorflow", "torch")


def setup_list(name: str) -> list[str]:
    """A requirements list (PIPELINE, TRAIN) from setup.py, read without running it."""
    for node in ast.parse((REPO / "setup.py").read_text()).body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == name:
            return list(ast.literal_eval(node.value))
    raise AssertionError(f"{name} not in setup.py")


def dist_name(req: str) -> str:
    return re.split(r"[\[<>=!~ ;]", req, maxsplit=1)[0].lower()


def option(cmd: list[str], flag: str) -> str:
    return cmd[cmd.index(flag) + 1]


# ----------------------------------------------------------------------------- Dataflow launcher


def test_dry_run_prints_the_whole_command_and_runs_nothing(capsys, monkeypatch):
    monkeypatch.setattr(ld, "run_job", lambda *a, **k: pytest.fail("--dry-run must not run anything"))
    assert ld.main(BASE + ["--max-length", "2048", "--dry-run"]) == 0
    out = capsys.readouterr().out
    command, _, explained = out.partition("\n\n")
    argv = shlex.split(command)
    assert argv[1:4] == ["-m", "apps.cli", "pack"]
    for flag, value in [("--runner", "DataflowRunner"), ("--project", "my-proj"), ("--region", "us-central1"),
                        ("--temp_location", "gs://b/dataflow/temp"), ("--staging_location", "gs://b/dataflow/staging"),
                        ("--worker_machine_type", "n2-standard-8"), ("--max_num_workers", "16"), ("--disk_size_gb", "50"),
                        ("--number_of_worker_harness_threads", "2"),
                        ("--experiments", "use_runner_v2"), ("--setup_file", str(REPO / "setup.py")),
                        ("--requirements_file", str(REPO / "gcp" / "worker_requirements.txt")),
                        ("--output", "gs://b/sets/alpaca"), ("--max-length", "2048")]:
        assert option(argv, flag) == value, flag
    # Every option is explained on its own comment line.
    for flag in ("--worker_machine_type", "--max_num_workers", "--disk_size_gb", "--region", "--requirements_file"):
        assert re.search(rf"^# {re.escape(flag)} +\S+ +-- \S", explained, re.M), flag


def test_command_means_the_same_to_prepack_pack_and_beam():
    from apache_beam.options.pipeline_options import (
        DebugOptions, GoogleCloudOptions, PipelineOptions, SetupOptions, StandardOptions, WorkerOptions)

    from pipelines.options import parse_args

    launch = ld.build_command(BASE + ["--max-length", "2048", "4096", "--num-shards", "64", "--max_num_workers", "32"])
    config, beam_args = parse_args(launch.cmd[4:])
    assert config.run.output == "gs://b/sets/alpaca" and config.rows.max_lengths == (2048, 4096) and config.rows.num_shards == 64
    options = PipelineOptions(beam_args)
    assert options.view_as(StandardOptions).runner == "DataflowRunner"
    gcloud = options.view_as(GoogleCloudOptions)
    assert (gcloud.project, gcloud.region, gcloud.temp_location) == ("my-proj", "us-central1", "gs://b/dataflow/temp")
    assert gcloud.labels == ["app=tunix-prepack"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", gcloud.job_name) and "l2048-l4096" in gcloud.job_name
    worker = options.view_as(WorkerOptions)
    # Passthrough options come last and win over the launcher's defaults.
    assert (worker.machine_type, worker.max_num_workers, worker.disk_size_gb) == ("n2-standard-8", 32, 50)
    assert "use_runner_v2" in options.view_as(DebugOptions).experiments
    setup = options.view_as(SetupOptions)
    assert (setup.setup_file, setup.requirements_cache) == (str(REPO / "setup.py"), "skip")


def test_overlong_window_reaches_prepack_pack_through_the_launcher():
    """--overlong window and --window-context-tokens are forwarded to `prepack pack`, which reads them."""
    from pipelines.options import parse_args
    from prepack.packing.packer import OverlongPolicy

    cmd = ld.build_command(BASE + ["--overlong", "window", "--window-context-tokens", "96"]).cmd
    config, _ = parse_args(cmd[4:])
    assert config.rows.overlong is OverlongPolicy.WINDOW and config.rows.window_context_tokens == 96


def test_beam_stages_our_package_and_the_pipeline_extra(tmp_path):
    """What Dataflow submission does on the launcher, run offline: the sdist of this repo
    (with the embedded sample data) and the requirements file are staged."""
    from apache_beam.options.pipeline_options import PipelineOptions
    from apache_beam.runners.portability.stager import Stager

    from pipelines.options import parse_args

    _, beam_args = parse_args(ld.build_command(BASE).cmd[4:])
    resources = Stager.create_job_resources(PipelineOptions(beam_args), str(tmp_path))
    staged = {r.role_payload.decode("utf-8", "replace")[2:] for r in resources}
    assert {"requirements.txt", "workflow.tar.gz"} <= staged
    (sdist,) = tmp_path.glob("tunix[-_]prepack-*.tar.gz")  # setuptools 69.3+ names it tunix_prepack (PEP 625)
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    assert {"pipelines/launch/job.py", "pipelines/stages/write.py", "prepack/text/tokenizer.py", "prepack/sample_data/sample_sft.jsonl"} <= names


@pytest.mark.parametrize("examples, workers", [(1_000_000, 4), (10_000_000, 4), (10_000_001, 16), (100_000_000, 16),
                                               (1_000_000_000, 64), (5_000_000_000, 64)])
def test_worker_ceiling_follows_the_sizing_table(examples, workers):
    """docs/gcp.md's table: 4 n2-standard-8 up to 10M examples, 16 up to 100M, 64 above."""
    cmd = ld.build_command(BASE + ["--examples", str(examples)]).cmd
    assert option(cmd, "--max_num_workers") == str(workers)
    assert option(ld.build_command(BASE + ["--examples", str(examples), "--max-workers", "3"]).cmd, "--max_num_workers") == "3"
    table = (REPO / "docs" / "gcp.md").read_text()
    for _, n, machine in ld.SIZING:
        assert f"| {n} × `{machine}` |" in table, (n, machine)
    assert option(cmd, "--worker_machine_type") == ld.sizing_for(examples)[1]


def test_worker_requirements_are_the_pipeline_extra():
    listed = [line.strip() for line in (REPO / "gcp" / "worker_requirements.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert listed == setup_list("PIPELINE")
    assert not [r for r in listed if dist_name(r) in TRAINING_ONLY]


def test_container_packaging(capsys):
    launch = ld.build_command(BASE + ["--packaging", "container", "--region", "europe-west4"])
    assert option(launch.cmd, "--sdk_container_image") == (
        f"europe-west4-docker.pkg.dev/my-proj/prepack/pipeline-worker:{ld.package_version()}")
    assert option(launch.cmd, "--sdk_location") == "container"
    assert "--setup_file" not in launch.cmd and "--requirements_file" not in launch.cmd
    custom = ld.build_command(BASE + ["--packaging", "container", "--image", "gcr.io/x/y:1", "--no-public-ips",
                                      "--service-account", "sa@my-proj.iam.gserviceaccount.com", "--flexrs"])
    assert option(custom.cmd, "--sdk_container_image") == "gcr.io/x/y:1"
    assert "--no_use_public_ips" in custom.cmd and option(custom.cmd, "--flexrs_goal") == "COST_OPTIMIZED"
    assert option(custom.cmd, "--service_account_email") == "sa@my-proj.iam.gserviceaccount.com"
    # Setup packaging without public IPs cannot reach PyPI unless NAT exists: said, not refused.
    assert any("Cloud NAT" in w for w in ld.build_command(BASE + ["--no-public-ips"]).warnings)


# ----------------------------------------------------------------------------- --validate: the real DataflowRunner, offline

# Beam refuses a 1-letter bucket and replaces it by a default bucket over the network.
VALID_BASE = ["--project", "my-proj", "--input", "gs://my-bucket/raw/*.jsonl", "--format", "alpaca",
              "--output", "gs://my-bucket/sets/alpaca", "--max-length", "512", "2048"]


def test_validate_builds_the_job_with_the_dataflow_runner_offline(capsys, monkeypatch):
    """DataflowRunner --dry_run builds the whole graph with no credentials and no network: the
    steps, the worker code (sdist + pipeline-extra requirements), the worker pool, and every
    DoFn/CombineFn/coder unpickled (and our DoFns set up) where the training stack cannot load."""
    from gcp import dataflow_validate as dv

    monkeypatch.setattr(ld, "run_job", lambda *a, **k: pytest.fail("--validate must not launch anything"))
    # The report --validate printed is the one checked below: one build of the job, not two.
    reports = []
    monkeypatch.setattr(dv, "validate", lambda argv, validate=dv.validate: reports.append(validate(argv)) or reports[-1])
    assert ld.main(VALID_BASE + ["--examples", "1000000000", "--validate"]) == 0
    out = capsys.readouterr().out
    assert "the job builds for Dataflow" in out and "problem" not in out
    (report,) = reports
    assert report.problems == []
    assert set(dv.EXPECTED_STEPS) <= set(report.steps)
    assert report.packaging == "setup" and {"workflow.tar.gz", "requirements.txt"} <= set(report.staged)
    assert (report.machine_type, report.disk_size_gb, report.harness_threads, report.max_workers) == (
        "n2-standard-8", ld.DEFAULT_DISK_GB, ld.DEFAULT_HARNESS_THREADS, 64)
    # Every project DoFn with a setup ran it: read, tokenize, fit, route, write shards/dead letters/summary.
    assert report.unpickled["dofns"] >= 20 and report.unpickled["coders"] >= 10 and report.unpickled["setups"] >= 7


def test_validate_catches_training_packages_in_the_worker_requirements(tmp_path):
    from gcp import dataflow_validate as dv

    reqs = tmp_path / "requirements.txt"
    reqs.write_text((REPO / "gcp" / "worker_requirements.txt").read_text() + "jax==0.10.2\n")
    report = dv.validate(ld.build_command(VALID_BASE + ["--requirements_file", str(reqs)]).cmd[4:])
    assert report.problems == ["the staged requirements install training packages ['jax']"]


def test_validate_catches_worker_code_that_needs_the_training_stack(tmp_path, monkeypatch):
    """The unpickling interpreter is not vacuous: a DoFn whose module imports jax fails there
    (and is named), though it unpickles in this test's process, where jax is installed."""
    import apache_beam as beam

    from gcp import dataflow_validate as dv

    (tmp_path / "needs_jax_fn.py").write_text(
        "import apache_beam as beam\nimport jax\n\nclass NeedsJaxFn(beam.DoFn):\n"
        "    def process(self, x):\n        yield jax.numpy.asarray(x)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    import needs_jax_fn

    pipeline = beam.Pipeline()
    _ = pipeline | beam.Create([1]) | "UsesJax" >> beam.ParDo(needs_jax_fn.NeedsJaxFn())
    child = dv.unpickle_in_fresh_interpreter(pipeline.to_runner_api(), "cloudpickle")
    assert any(e.startswith("UsesJax") and "jax" in e for e in child["errors"]), child["errors"]
    assert "jax" in child["blocked_attempts"] and child["loaded"] == []


def test_validate_refuses_what_cannot_build(capsys):
    assert ld.main(VALID_BASE + ["--validate", "--temp_location", "gs://b/tmp", "--staging_location", "gs://b/st"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("launch_dataflow: the job does not build for Dataflow: --temp_location: ") and "\n" == err[-1]
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("argv, message", [
    (["--input", "data/train.jsonl", "--format", "alpaca", "--output", "gs://b/o", "--project", "p"], "cannot read"),
    (["--sample", "--output", "gs://b/o", "--project", "p", "--input", "gs://b/x"], "--sample"),
    (["--input", "gs://b/x", "--format", "alpaca", "--output", "/tmp/out", "--project", "p"], "--output must be a gs://"),
    (["--input", "gs://b/x", "--format", "alpaca", "--output", "gs://b/o"], "--project is required"),
    (["--input", "gs://b/x", "--output", "gs://b/o", "--project", "p"], "--format is required"),
])
def test_what_cannot_work_on_dataflow_fails_before_launch(argv, message, capsys, monkeypatch):
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    monkeypatch.delenv("CLOUDSDK_CORE_PROJECT", raising=False)
    assert ld.main(argv + ["--dry-run"]) == 2
    assert message in capsys.readouterr().err


def no_credentials(monkeypatch, tmp_path) -> None:
    """An environment with no Application Default Credentials and no metadata server."""
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "gcloud"))  # where gcloud keeps ADC
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("GCE_METADATA_HOST", "127.0.0.1:9")  # nothing listens: not on GCE
    monkeypatch.setenv("GCE_METADATA_IP", "127.0.0.1:9")
    monkeypatch.setenv("NO_GCE_CHECK", "True")


def test_launch_without_credentials_says_how_to_log_in(capsys, monkeypatch, tmp_path):
    no_credentials(monkeypatch, tmp_path)
    monkeypatch.setattr(ld, "run_job", lambda *a, **k: pytest.fail("must not start the job without credentials"))
    assert ld.main(BASE + ["--max-length", "2048"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["launch_dataflow: no Google Cloud credentials found: run `gcloud auth application-default login` "
                   "(or set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file), then run this again"]


def test_launch_with_credentials_starts_the_job(capsys, monkeypatch, tmp_path):
    no_credentials(monkeypatch, tmp_path)
    adc = tmp_path / "adc.json"  # the shape `gcloud auth application-default login` writes
    adc.write_text('{"type": "authorized_user", "client_id": "c", "client_secret": "s", "refresh_token": "r"}')
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(adc))
    started = []
    monkeypatch.setattr(ld, "run_job", lambda cmd, env=None: started.append(cmd) or 0)
    assert ld.main(BASE + ["--max-length", "2048"]) == 0
    assert len(started) == 1 and started[0][3] == "pack"


def test_new_max_length_is_one_command():
    now = datetime.datetime(2026, 11, 30, 12, 0, 0, tzinfo=datetime.timezone.utc)
    assert ld.job_name("gs://b/sets/Alpaca_v2/", [4096], now) == "prepack-alpaca-v2-l4096-20261130-120000"
    launch = ld.build_command(BASE + ["--max-length", "4096"])
    assert launch.cmd[launch.cmd.index("--max-length") + 1] == "4096"


def test_new_max_length_from_the_tokenized_set_on_dataflow(capsys):
    launch = ld.build_command(["--project", "p", "--from-tokens", "gs://b/sets/alpaca/tokens", "--output", "gs://b/sets/alpaca",
                               "--max-length", "4096"])
    assert option(launch.cmd, "--from-tokens") == "gs://b/sets/alpaca/tokens" and "--input" not in launch.cmd
    assert "--format" not in launch.cmd and option(launch.cmd, "--runner") == "DataflowRunner"
    assert ld.main(["--project", "p", "--from-tokens", "out/tokens", "--output", "gs://b/o", "--dry-run"]) == 2
    assert "--from-tokens 'out/tokens' is on the launcher's disk" in capsys.readouterr().err


def test_dockerfile_matches_the_pins():
    dockerfile = (REPO / "gcp" / "Dockerfile").read_text()
    (base,) = re.findall(r"^FROM (\S+)", dockerfile, re.M)
    beam = next(r for r in setup_list("PIPELINE") if dist_name(r) == "apache-beam").split("==")[1]
    major, minor = ld.CONTAINER_PYTHON
    assert base == f"apache/beam_python{major}.{minor}_sdk:{beam}"
    assert re.search(r'^RUN pip install "\.\[pipeline\]"$', dockerfile, re.M)
    assert "ENTRYPOINT" not in "\n".join(l for l in dockerfile.splitlines() if not l.startswith("#"))


# ----------------------------------------------------------------------------- TPU VM script


FAKE_GCLOUD = """#!/usr/bin/env bash
# Records each call (one argument per line, calls separated by a line '---'); answers describe.
{ printf '%s\\n' "$@"; echo ---; } >> "${FAKE_GCLOUD_LOG:-/dev/null}"
if [[ " $* " == *" describe "* ]]; then echo "${FAKE_GCLOUD_STATE-READY}"; fi
"""


@pytest.fixture
def fake_gcloud(tmp_path) -> dict[str, str]:
    """An environment whose `gcloud` only records its arguments: no test can reach a real
    project, even on a machine with gcloud credentials, even if --dry-run were misparsed."""
    bin_dir = tmp_path / "fake-bin"
    bin_dir.mkdir()
    (bin_dir / "gcloud").write_text(FAKE_GCLOUD)
    (bin_dir / "gcloud").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("GOOGLE_CLOUD_PROJECT", "CLOUDSDK_CORE_PROJECT")}
    return dict(env, PATH=f"{bin_dir}:{env['PATH']}", FAKE_GCLOUD_LOG=str(tmp_path / "gcloud.log"), TMPDIR=str(tmp_path))


def tpu(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(TPU_SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60)


TPU_BASE = ["--project", "my-proj", "--shards", "gs://b/sets/alpaca/L2048"]


def test_tpu_help_is_the_header_comment_and_the_options(fake_gcloud):
    res = tpu(["--help"], fake_gcloud)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("Train LoRA on a TPU VM from shards in GCS")
    assert "--dry-run prints every command" in res.stdout and "--steps N" in res.stdout
    assert "set -euo" not in res.stdout and not re.search(r"^#", res.stdout, re.M)


def test_tpu_dry_run_prints_every_step(fake_gcloud):
    res = tpu(TPU_BASE + ["--read", "gcsfuse", "--results", "gs://b/runs/r1", "--dry-run", "--", "--lora-rank", "16"], fake_gcloud)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    jax_pin = next(r for r in setup_list("TRAIN") if dist_name(r) == "jax").split("==")[1]
    assert "gcloud compute tpus tpu-vm describe prepack-tpu --zone us-central1-a --project my-proj" in out
    assert "tpu-vm create prepack-tpu --zone us-central1-a --project my-proj --accelerator-type v5litepod-8 " \
           "--version v2-alpha-tpuv5-lite" in out
    assert f"'jax[tpu]=={jax_pin}'" in out and "tunix-prepack[train]" in out
    assert re.search(r"gcsfuse -o ro --implicit-dirs .*--metadata-cache-ttl-secs=-1 .*b /mnt/gcs/b", out)
    assert re.search(r"prepack train --shards /mnt/gcs/b/sets/alpaca/L2048 --model gemma3-270m --mesh fsdp=8\\?,tp=1 "
                     r"--batch-size 32 --steps 1000 .* --lora-rank 16", out)
    assert "gcloud storage cp -r ~/prepack-run/* gs://b/runs/r1/" in out


def test_tpu_dry_run_direct_gcs_and_other_slices(fake_gcloud):
    out = tpu(TPU_BASE + ["--accelerator", "v4-8", "--spot", "--dry-run"], fake_gcloud).stdout  # gs:// direct is the default
    assert "gcsfuse" not in out
    assert "--accelerator-type v4-8 --version tpu-ubuntu2204-base --spot" in out
    assert re.search(r"prepack train --shards gs://b/sets/alpaca/L2048 .*--mesh fsdp=4\\?,tp=1", out)


@pytest.mark.parametrize("args, message", [
    (["--project", "p", "--shards", "/local/dir"], "--shards must be a gs://"),
    (["--shards", "gs://b/x/L1"], "--project is required"),
    (["--project", "p", "--shards", "gs://b/x/L1", "--read", "nfs"], "--read must be"),
    (["--project", "p", "--shards", "gs://b/x/L1", "--accelerator", "v9"], "--accelerator looks wrong"),
])
def test_tpu_bad_options(args, message, fake_gcloud):
    res = tpu(args + ["--dry-run"], fake_gcloud)
    assert res.returncode == 2 and message in res.stderr


def test_tpu_real_path_sends_the_scripts_it_shows(fake_gcloud, tmp_path):
    """Without --dry-run, against a fake gcloud: the VM is reused (describe says READY), and
    each remote script arrives through ssh --command quoting intact and valid bash."""
    env, log = fake_gcloud, Path(fake_gcloud["FAKE_GCLOUD_LOG"])
    ours, train_args = TPU_BASE + ["--read", "gcsfuse", "--results", "gs://b/runs/r1"], ["--", "--eval-shards", "gs://b/sets/eval set/L2048"]
    res = tpu(ours + train_args, env=env)
    assert res.returncode == 0, res.stderr
    calls = [c.strip("\n").split("\n") for c in log.read_text().split("---\n") if c.strip()]
    verbs = [c[3] for c in calls]  # gcloud compute tpus tpu-vm VERB
    assert verbs == ["describe", "scp", "ssh", "ssh", "ssh", "ssh"]  # no create: reused
    assert tarfile.open(tmp_path / "tunix-prepack-src.tar.gz").getmember("setup.py")

    shown = tpu(ours + ["--dry-run"] + train_args, env=env).stdout
    shown_scripts = ["\n".join(line[6:] for line in block.splitlines()).strip("\n")
                     for block in re.findall(r"((?:^    \| .*\n?)+)", shown, re.M)]
    sent = []
    for call in calls:
        if call[3] != "ssh":
            continue
        command = "\n".join(call[call.index("--command") + 1:])
        # The VM's login shell parses `bash -euo pipefail -c <quoted script>`; parse it the same
        # way, with a `bash` function that prints the script instead of running it.
        script = subprocess.run(["bash", "-c", 'bash() { printf "%s" "${@: -1}"; }; eval "$CMD"'],
                                env={**os.environ, "CMD": command}, capture_output=True, text=True, check=True).stdout
        assert command.startswith("bash -euo pipefail -c ")
        assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0, script
        sent.append(script.strip("\n"))
    assert len(sent) == 4
    assert "gs://b/sets/eval\\ set/L2048" in sent[2]
    assert shown_scripts == sent


def test_tpu_creates_a_missing_vm_and_starts_a_stopped_one(fake_gcloud):
    log = Path(fake_gcloud["FAKE_GCLOUD_LOG"])
    for state, second in (("", "create"), ("STOPPED", "start")):
        log.unlink(missing_ok=True)
        res = tpu(TPU_BASE + ["--spot"], dict(fake_gcloud, FAKE_GCLOUD_STATE=state))
        assert res.returncode == 0, res.stderr
        calls = [c.strip("\n").split("\n") for c in log.read_text().split("---\n") if c.strip()]
        assert [c[3] for c in calls[:2]] == ["describe", second]
        if second == "create":
            assert calls[1][4:] == ["prepack-tpu", "--zone", "us-central1-a", "--project", "my-proj", "--accelerator-type",
                                    "v5litepod-8", "--version", "v2-alpha-tpuv5-lite", "--spot"]


def test_the_launchers_format_list_is_the_registrys():
    from prepack.text.formats import template_names

    assert ld.FORMATS == template_names()
