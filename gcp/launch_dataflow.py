#!/usr/bin/env python3
"""Run `prepack pack` on Dataflow with sensible defaults; --dry-run prints the whole command.

    python gcp/launch_dataflow.py --project P --region us-central1 \\
        --input 'gs://B/raw/*.jsonl' --format alpaca --output gs://B/sets/alpaca \\
        --max-length 2048 [--dry-run]

A mixture (prepack/packing/mixture.py's file, local or gs://; relative inputs resolve against
its folder, so a file uploaded beside its data needs no edits) is read here by the launcher,
each source checked to be one a worker can read, and the job is the mixture job:

    python gcp/launch_dataflow.py --project P --mixture gs://B/raw/mix.yaml \\
        --output gs://B/sets/mix --max-length 2048 [--validate]

Regenerating the shards for another max length is the same command with another
--max-length (each length gets its own OUTPUT/L<L>/ folder, so existing sets stay):

    python gcp/launch_dataflow.py ... --max-length 4096

Options this launcher does not know go to `prepack pack` unchanged, after ours,
so they can also override a Beam option it sets (e.g. --num-shards 64,
--tokenizer hf:Qwen/Qwen3-0.6B, --overlong truncate, --overlong window --window-context-tokens 256,
--max_num_workers 32).

The launcher process stays up until the Dataflow job ends: `prepack pack` waits
for the job, then publishes (moves the shards into place, switches manifest.json
last) from here. Run it where it can outlive your laptop's lid (Cloud Shell with
tmux, a small VM). Interrupting it (Ctrl-C, SIGTERM) cancels the Dataflow job; if
it dies mid-job, nothing is published; run it again.

Standard library only, so --dry-run works anywhere, Beam installed or not (a real
launch first checks credentials with google.auth, which the pipeline extra brings);
--mixture reads its file with the project's core (PyYAML; google-cloud-storage for gs://);
--validate (gcp/dataflow_validate.py) builds the job with the real DataflowRunner offline
and needs the pipeline extra.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import datetime
import os
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
SETUP_FILE = REPO_ROOT / "setup.py"
WORKER_REQUIREMENTS = Path(__file__).resolve().parent / "worker_requirements.txt"

# The SDK container the workers run is chosen by the launcher's Python minor version
# (setup packaging) or is ours (gcp/Dockerfile, built on beam_python3.11_sdk).
CONTAINER_PYTHON = (3, 11)

DEFAULT_REGION = "us-central1"
# `prepack pack --format` names (prepack/text/formats/; written out here: this launcher imports no
# project code, and tests/test_gcp_launch.py checks the list against the registry).
FORMATS = ("alpaca", "chat", "oasst1", "preference", "prompt_completion", "prompt_response", "sharegpt", "text",
           "translation")
# Sizing from measurement (docs/gcp.md, "Sizing"): ~1.9 us of CPU per token measured end to end,
# x1.5 for Dataflow's remote shuffle, at 512 tokens per example ~1.49 ms per example; at most
# 1.5 GB per concurrent bundle (pipelines/README.md, "Bounded worker memory").
# 8 vCPUs / 32 GB: Dataflow bills per vCPU-hour and GB-hour whatever the shape, so a larger VM
# costs the same per core but boots (and pip-installs) once for 8 SDK processes. N2 cores are
# faster than N1's at the same Dataflow rate.
DEFAULT_MACHINE_TYPE = "n2-standard-8"
# 2 bundles per SDK process: the DoFns are CPU-bound under the GIL, so a second thread only fills
# the GCS and shuffle waits; 8 processes x 2 x 1.5 GB = 24 GB of the VM's 32 GB.
DEFAULT_HARNESS_THREADS = 2
# (examples up to, workers, machine type): docs/gcp.md's table; the default is the 100M row.
# The plan step (one bundle) streams its slices and holds ~10 bytes per row of one L: under
# 2 GB at 1B examples (benchmarks/bench_plan_scale.py), within the 8 GB a 32 GB VM has left
# beside its 16 bundles, so no size needs a highmem VM.
SIZING = ((10_000_000, 4, DEFAULT_MACHINE_TYPE), (100_000_000, 16, DEFAULT_MACHINE_TYPE),
          (1_000_000_000, 64, DEFAULT_MACHINE_TYPE))
DEFAULT_EXAMPLES = 100_000_000


def sizing_for(examples: int) -> tuple[int, str]:
    """(autoscaling ceiling, machine type) for an input of this many examples (docs/gcp.md, 5a)."""
    for upto, workers, machine in SIZING:
        if examples <= upto:
            return workers, machine
    return SIZING[-1][1], SIZING[-1][2]


def workers_for(examples: int) -> int:
    return sizing_for(examples)[0]


DEFAULT_MAX_WORKERS = workers_for(DEFAULT_EXAMPLES)
# Holds the container image, the pip-installed pipeline extra (~3 GB) and the local
# temp shard files (each shard is written to local disk, then copied to GCS).
DEFAULT_DISK_GB = 50


class LaunchError(ValueError):
    """Bad launcher options: printed as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class Choice:
    """One option given to the job, and why it has this value (shown by --dry-run)."""

    flag: str
    value: str | None  # None: a bare flag
    why: str

    def args(self) -> list[str]:
        return [self.flag] if self.value is None else [self.flag, self.value]


def package_version() -> str:
    """tunix-prepack's version, read from setup.py without running it."""
    for node in ast.walk(ast.parse(SETUP_FILE.read_text(encoding="utf-8"))):
        if isinstance(node, ast.keyword) and node.arg == "version":
            return str(ast.literal_eval(node.value))
    return "0"


def job_name(output: str, max_lengths: Sequence[int], now: datetime.datetime | None = None) -> str:
    """A Dataflow job name ([a-z]([-a-z0-9]*[a-z0-9])?) that says what and when."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    leaf = output.rstrip("/").rsplit("/", 1)[-1]
    slug = re.sub(r"[^a-z0-9]+", "-", leaf.lower()).strip("-")[:24] or "set"
    lengths = "-".join(f"l{L}" for L in sorted(max_lengths)) or "ldefault"
    name = f"prepack-{slug}-{lengths}"[:48].rstrip("-")
    return f"{name}-{now:%Y%m%d-%H%M%S}"


def bucket_of(url: str) -> str:
    return url[len("gs://") :].split("/", 1)[0]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gcp/launch_dataflow.py",
        description="Run `prepack pack` on Dataflow. Unknown options go to `prepack pack` (and through it to Beam).",
    )
    p.add_argument("--project", default=os.environ.get("GOOGLE_CLOUD_PROJECT") or os.environ.get("CLOUDSDK_CORE_PROJECT"),
                   help="GCP project (default: $GOOGLE_CLOUD_PROJECT)")
    p.add_argument("--region", default=DEFAULT_REGION, help=f"Dataflow region; keep it the bucket's (default {DEFAULT_REGION})")
    p.add_argument("--input", action="append", default=[], metavar="SPEC",
                   help="repeatable: gs:// file or glob, hf:NAME..., or tfds:NAME (workers cannot read the launcher's disk)")
    p.add_argument("--format", help=f"source format ({', '.join(FORMATS)}, or auto); --columns/--roles pass on to the job")
    p.add_argument("--mixture", metavar="FILE",
                   help="instead of --input/--format: a mixture file (local or gs://) read here; every source's inputs "
                        "must be gs://, hf: or tfds: (relative ones resolve against the file's folder)")
    p.add_argument("--from-tokens", metavar="GS_DIR",
                   help="instead of --input/--format: pack a tokenized set (gs://.../tokens of an earlier run) for new max lengths")
    p.add_argument("--output", help="gs://BUCKET/PREFIX; each max length is published to OUTPUT/L<L>/")
    p.add_argument("--max-length", action="extend", nargs="+", type=int, default=[], metavar="L",
                   help="one or more max lengths (default: prepack pack's)")
    p.add_argument("--bucket", help="gs://BUCKET for Dataflow's temp and staging files (default: the output's bucket)")
    p.add_argument("--machine-type", help="worker machine type (default: from --examples by docs/gcp.md's sizing table, "
                                          f"{DEFAULT_MACHINE_TYPE} at every size)")
    p.add_argument("--examples", type=int, default=DEFAULT_EXAMPLES,
                   help=f"about how many examples the input holds; picks --max-workers from docs/gcp.md's sizing table "
                        f"(default {DEFAULT_EXAMPLES:,})")
    p.add_argument("--max-workers", type=int, help="autoscaling ceiling (default: from --examples, docs/gcp.md)")
    p.add_argument("--harness-threads", type=int, default=DEFAULT_HARNESS_THREADS,
                   help=f"bundles per SDK process (default {DEFAULT_HARNESS_THREADS}; 1.5 GB each)")
    p.add_argument("--disk-gb", type=int, default=DEFAULT_DISK_GB, help=f"worker boot disk in GB (default {DEFAULT_DISK_GB})")
    p.add_argument("--packaging", choices=("setup", "container"), default="setup",
                   help="setup: stage setup.py + gcp/worker_requirements.txt, workers pip-install from PyPI (default); "
                        "container: workers run the image built from gcp/Dockerfile (no PyPI access needed)")
    p.add_argument("--image", help="SDK container image for --packaging container "
                                   "(default REGION-docker.pkg.dev/PROJECT/prepack/pipeline-worker:VERSION)")
    p.add_argument("--service-account", help="worker service account email (default: the Compute Engine default SA)")
    p.add_argument("--subnetwork", help="worker subnetwork, e.g. regions/REGION/subnetworks/NAME")
    p.add_argument("--no-public-ips", action="store_true", help="workers without external IPs (needs Private Google Access)")
    p.add_argument("--flexrs", action="store_true", help="FlexRS: cheaper (preemptible + discounted), starts within 6 h")
    p.add_argument("--job-name", help="Dataflow job name (default: prepack-<output>-l<L>-<UTC time>)")
    p.add_argument("--dry-run", action="store_true", help="print the command and why each option has its value; run nothing")
    p.add_argument("--validate", action="store_true",
                   help="build the job with Beam's DataflowRunner offline (--dry_run=True: no credentials, no network) and "
                        "check its steps, the code the workers get, and that every DoFn and coder unpickles without JAX; "
                        "needs the pipeline extra; submits nothing")
    return p


def check(args: argparse.Namespace, passthrough: Sequence[str]) -> list[str]:
    """Raises LaunchError for what cannot work on Dataflow; returns warnings for what might not."""
    if not args.project:
        raise LaunchError("--project is required (or set GOOGLE_CLOUD_PROJECT)")
    if not args.output or not args.output.startswith("gs://"):
        raise LaunchError(f"--output must be a gs:// URL on Dataflow, got {args.output!r}")
    if "--sample" in passthrough:
        raise LaunchError("--sample reads a file inside the launcher's install, which workers cannot see; "
                          "upload it (gcloud storage cp) and pass --input gs://... --format alpaca")
    if args.from_tokens and not args.from_tokens.startswith("gs://"):
        raise LaunchError(f"--from-tokens {args.from_tokens!r} is on the launcher's disk, which Dataflow workers cannot read; "
                          "pass the gs:// tokenized set an earlier run published (OUTPUT/tokens)")
    args.mixture_sources = []
    if args.mixture:
        for flag, given in (("--input", args.input), ("--format", args.format)):
            if given:
                raise LaunchError(f"--mixture names each source's inputs and format; do not combine it with {flag}")
        args.mixture_sources = mixture_sources(args.mixture, check_inputs=not args.from_tokens)
    if not args.input and not args.from_tokens and not args.mixture:
        raise LaunchError("no input: pass --input gs://... (or hf:/tfds:) at least once, or --from-tokens gs://.../tokens")
    for spec in args.input:
        if not (spec.startswith("gs://") or spec.startswith("hf:") or spec.startswith("tfds:")):
            raise LaunchError(f"--input {spec!r} is on the launcher's disk, which Dataflow workers cannot read; "
                              f"copy it to GCS first: gcloud storage cp {shlex.quote(spec)} gs://BUCKET/raw/")
    if not args.format and not args.from_tokens and not args.mixture:
        raise LaunchError(f"--format is required: {', '.join(FORMATS)}, or auto")
    if args.bucket and not args.bucket.startswith("gs://"):
        raise LaunchError(f"--bucket must look like gs://NAME, got {args.bucket!r}")
    if args.max_workers is None:
        args.max_workers = workers_for(args.examples)
    if args.machine_type is None:
        args.machine_type = sizing_for(args.examples)[1]
    if args.max_workers < 1 or args.disk_gb < 10 or args.harness_threads < 1 or args.examples < 1:
        raise LaunchError("--max-workers, --harness-threads and --examples must be >= 1, and --disk-gb >= 10")
    warnings = []
    if args.packaging == "setup" and args.no_public_ips:
        warnings.append("--no-public-ips with --packaging setup: workers pip-install gcp/worker_requirements.txt from "
                        "PyPI at boot, which needs Cloud NAT on the subnetwork; or use --packaging container")
    if args.packaging == "container" and sys.version_info[:2] != CONTAINER_PYTHON:
        warnings.append(f"launching from Python {sys.version_info.major}.{sys.version_info.minor} but the worker image "
                        f"runs {CONTAINER_PYTHON[0]}.{CONTAINER_PYTHON[1]}: Beam pickles with the launcher's Python, "
                        "so launch from a 3.11 environment")
    if any(spec.startswith("hf:") for spec in [*args.input, *(i for _, inputs in args.mixture_sources for i in inputs)]):
        warnings.append("hf: inputs are downloaded by the workers from the Hugging Face Hub: they need internet access")
    return warnings


WORKER_READABLE = ("gs://", "hf:", "tfds:")


def mixture_sources(path: str, check_inputs: bool = True) -> list[tuple[str, tuple[str, ...]]]:
    """(name, resolved inputs) of each source of the mixture file, read and validated here as
    `prepack pack` reads it (prepack.mixture_file); with `check_inputs`, a source a Dataflow worker
    cannot read (on the launcher's disk) is refused, naming the source and the copy to make."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        from prepack.mixture_file import load_mixture
        from prepack.packing.mixture import MixtureError
    except ImportError as e:
        raise LaunchError(f"--mixture reads its file with the project's core: pip install -e . ({e})") from None
    try:
        # Its local paths are judged below, by what a Dataflow worker can read (never one), with or
        # without --allow-local-inputs: so they are let through the reader's own refusal.
        mixture = load_mixture(path, allow_local_inputs=check_inputs)
    except MixtureError as e:
        raise LaunchError(str(e)) from None
    for source in mixture.sources if check_inputs else ():
        for spec in source.inputs:
            if not spec.startswith(WORKER_READABLE):
                raise LaunchError(
                    f"mixture file {path}: source {source.name!r} input {spec!r} is on the launcher's disk, which "
                    f"Dataflow workers cannot read; copy it to GCS first: gcloud storage cp {shlex.quote(spec)} "
                    "gs://BUCKET/raw/ and name it in the file (or upload the file beside its data: relative inputs "
                    "resolve against the file's folder)")
    return [(s.name, s.inputs) for s in mixture.sources]


def dataflow_choices(args: argparse.Namespace) -> list[Choice]:
    """The Beam/Dataflow options, each with its reason."""
    bucket = args.bucket.rstrip("/") if args.bucket else f"gs://{bucket_of(args.output)}"
    name = args.job_name or job_name(args.output, args.max_length)
    choices = [
        Choice("--runner", "DataflowRunner", "run on Dataflow instead of the local FnApiRunner"),
        Choice("--project", args.project, "project billed for workers, shuffle and storage"),
        Choice("--region", args.region,
               "same region as the bucket (no cross-region egress) and, ideally, as the TPUs that read the shards"),
        Choice("--temp_location", f"{bucket}/dataflow/temp", "Beam's temporary files (gs://, required by Dataflow)"),
        Choice("--staging_location", f"{bucket}/dataflow/staging", "where the job's code and requirements are staged"),
        Choice("--job_name", name, "output, max lengths and UTC start time, so runs are easy to tell apart"),
        Choice("--worker_machine_type", args.machine_type,
               "Dataflow bills per vCPU and GB whatever the shape; 8 vCPUs amortize each VM's boot and pip install "
               "over 8 SDK processes; 4 GB per vCPU holds its bundles at 1.5 GB each"),
        Choice("--number_of_worker_harness_threads", str(args.harness_threads),
               "bundles per SDK process: CPU-bound DoFns under the GIL gain from a second thread only while the "
               "first waits on GCS or shuffle; 8 x 2 x 1.5 GB = 24 GB of 32"),
        Choice("--max_num_workers", str(args.max_workers),
               f"autoscaling ceiling for ~{args.examples:,} examples (docs/gcp.md sizing: 4 up to 10M, 16 up to "
               "100M, 64 up to 1B)"),
        Choice("--autoscaling_algorithm", "THROUGHPUT_BASED", "scale with the backlog, down to 1 worker in the tail"),
        Choice("--disk_size_gb", str(args.disk_gb),
               "container image + pipeline extra (~3 GB) + local temp shards before their copy to GCS"),
        Choice("--experiments", "use_runner_v2",
               "Runner v2 (portable SDK harness): required for custom containers, Beam's default for Python anyway"),
        Choice("--labels", "app=tunix-prepack", "find the job's cost in billing reports"),
    ]
    if args.packaging == "setup":
        choices += [
            Choice("--setup_file", str(SETUP_FILE), "stages this repository as an sdist; workers pip-install it"),
            Choice("--requirements_file", str(WORKER_REQUIREMENTS),
                   "Beam installs the setup_file package without extras, so the pipeline extra's pins come from "
                   "here (equal to setup.py's PIPELINE: no jax, no tunix)"),
            Choice("--requirements_cache", "skip",
                   "workers download the pinned wheels from PyPI at boot instead of the launcher uploading them"),
        ]
    else:
        image = args.image or f"{args.region}-docker.pkg.dev/{args.project}/prepack/pipeline-worker:{package_version()}"
        choices += [
            Choice("--sdk_container_image", image,
                   "gcp/Dockerfile: Beam 2.77 on Python 3.11 with tunix-prepack[pipeline] baked in, no PyPI at boot"),
            Choice("--sdk_location", "container", "use the Beam SDK already in the image; stage none"),
        ]
    if args.service_account:
        choices.append(Choice("--service_account_email", args.service_account,
                              "a dedicated worker SA with roles/dataflow.worker and storage access to the bucket"))
    if args.subnetwork:
        choices.append(Choice("--subnetwork", args.subnetwork, "the VPC subnetwork the workers join"))
    if args.no_public_ips:
        choices.append(Choice("--no_use_public_ips", None, "workers without external IPs (org policy, lower exposure)"))
    if args.flexrs:
        choices.append(Choice("--flexrs_goal", "COST_OPTIMIZED", "preemptible VMs at a discount; the job may wait up to 6 h"))
    return choices


def pack_choices(args: argparse.Namespace) -> list[Choice]:
    out = [Choice("--input", spec, "read by the workers") for spec in args.input]
    if args.mixture:
        names = ", ".join(name for name, _ in args.mixture_sources)
        out.append(Choice("--mixture", args.mixture, f"read by the launcher; its sources ({names}) by the workers"
                          + (" from the tokenized set" if args.from_tokens else "")))
    if args.from_tokens:
        out.append(Choice("--from-tokens", args.from_tokens, "tokenized set read by the workers: no inputs, no tokenizer"))
    if args.format:
        out.append(Choice("--format", args.format, "source format"))
    out.append(Choice("--output", args.output, "published to OUTPUT/L<L>/"))
    if args.max_length:
        out.append(Choice("--max-length", " ".join(map(str, args.max_length)), "tokenized once, one shard set per length"))
    return out


@dataclasses.dataclass(frozen=True)
class Launch:
    cmd: list[str]  # what runs: this Python, `-m apps.cli pack`, then every option
    choices: list[Choice]  # our options and why (passthrough ones are only in cmd)
    warnings: list[str]
    dry_run: bool
    validate: bool = False


def build_command(argv: Sequence[str]) -> Launch:
    """The command to run and the reasons behind it. Raises LaunchError."""
    args, passthrough = build_parser().parse_known_args(list(argv))
    warnings = check(args, passthrough)
    choices = pack_choices(args) + dataflow_choices(args)
    cmd = [sys.executable, "-m", "apps.cli", "pack"]
    for choice in choices:
        if choice.flag == "--max-length":
            cmd += ["--max-length", *choice.value.split()]
        else:
            cmd += choice.args()
    # Last, so they win over ours (argparse keeps the last value of a repeated option).
    cmd += list(passthrough)
    return Launch(cmd, choices, warnings, args.dry_run, args.validate)


def render(launch: Launch) -> str:
    """The command as one copy-pastable shell line, then why each option has its value (as # comments)."""
    lines = [shlex.join(launch.cmd), ""]
    width = max(len(c.flag) for c in launch.choices)
    for c in launch.choices:
        lines.append(f"# {c.flag:<{width}}  {c.value if c.value is not None else '(flag)'}  -- {c.why}")
    lines += [f"# warning: {w}" for w in launch.warnings]
    return "\n".join(lines)


LOGIN_HINT = ("run `gcloud auth application-default login` (or set GOOGLE_APPLICATION_CREDENTIALS "
              "to a service-account key file), then run this again")


def credentials_problem() -> str | None:
    """Why Dataflow would refuse this launch for lack of credentials, or None.

    Checked up front because without credentials Beam's Dataflow client retries
    for minutes, printing tracebacks, before it gives up.
    """
    try:
        import google.auth
        from google.auth.exceptions import DefaultCredentialsError
    except ImportError:
        return "google-auth is not installed; install the pipeline extra: pip install -e '.[pipeline]'"
    try:
        google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
    except DefaultCredentialsError:
        return f"no Google Cloud credentials found: {LOGIN_HINT}"
    return None


def validate(launch: Launch) -> int:
    """Runs gcp/dataflow_validate.py on the command: 0 when the job builds and ships right."""
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))
    try:
        from gcp import dataflow_validate
    except ImportError as e:
        print(f"launch_dataflow: --validate needs the pipeline extra (pip install -e '.[pipeline]'): {e}", file=sys.stderr)
        return 2
    try:
        report = dataflow_validate.validate(launch.cmd[4:])
    except dataflow_validate.ValidationError as e:
        print(f"launch_dataflow: the job does not build for Dataflow: {e}", file=sys.stderr)
        return 1
    print("\n".join(report.lines()))
    if report.problems:
        print(f"launch_dataflow: {len(report.problems)} problem(s); fix them before launching", file=sys.stderr)
        return 1
    print("launch_dataflow: the job builds for Dataflow; run the same command without --validate to launch")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        launch = build_command(argv)
    except LaunchError as e:
        print(f"launch_dataflow: {e}", file=sys.stderr)
        return 2
    if launch.dry_run:
        print(render(launch))
        return 0
    if launch.validate:
        return validate(launch)
    problem = credentials_problem()
    if problem:
        print(f"launch_dataflow: {problem}", file=sys.stderr)
        return 2
    for w in launch.warnings:
        print(f"launch_dataflow: warning: {w}", file=sys.stderr)
    print(f"launch_dataflow: running {shlex.join(launch.cmd)}", file=sys.stderr, flush=True)
    # The repository root on sys.path lets `-m apps.cli` work from a checkout
    # that was not pip-installed (the workers get it through --setup_file).
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    return run_job(launch.cmd, env)


def run_job(cmd: Sequence[str], env: dict[str, str] | None = None) -> int:
    """Runs `prepack pack` and waits. When this launcher is interrupted (SIGINT, SIGTERM), the
    signal is passed on to the job process, which cancels the Dataflow job it submitted, removes
    its staging files and exits; the launcher waits for that, then exits non-zero."""
    received: list[int] = []
    child: subprocess.Popen | None = None

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        if child is not None:
            try:
                child.send_signal(signal.SIGTERM if len(received) == 1 else signal.SIGKILL)
            except ProcessLookupError:
                pass

    # Installed before the job starts, so no signal falls between the start and the handler.
    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        child = subprocess.Popen(list(cmd), env=env)
        if received:  # interrupted while starting it
            child.send_signal(signal.SIGTERM)
        code = child.wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    if received:
        print(f"launch_dataflow: interrupted (signal {received[0]}); the job was asked to cancel its Dataflow job "
              f"and exited with status {code}", file=sys.stderr)
        return 128 + received[0]
    return code


if __name__ == "__main__":
    sys.exit(main())
