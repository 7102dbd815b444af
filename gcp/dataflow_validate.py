"""The packing job built by Beam's real DataflowRunner, offline, and checked.

`gcp/launch_dataflow.py --validate` (and tests/test_gcp_launch.py) run the job
construction exactly as a launch would, `--runner DataflowRunner`, with Beam's
`--dry_run=True` test option and `--no_auth`: the runner applies its overrides,
stages the worker's code (sdist of setup.py + the requirements file, or a
container image), turns the graph into the portable pipeline proto Dataflow
runs, and returns before talking to any Google API. Then:

1. the pipeline proto has the job's steps, every step runs in a Docker
   environment, and the Dataflow Environment (worker pool) built from it has
   the launcher's machine type, disk and harness threads;
2. the worker gets the project's code with the `pipeline` extra only: the
   staged requirements name no training package (jax, flax, tunix, ...), the
   staged sdist holds the pipeline code, or the custom image is the one asked for;
3. every DoFn, CombineFn and coder in the proto unpickles, and each of the
   project's DoFns runs its setup(), in a fresh interpreter where the training
   stack cannot be imported (see `_unpickle_child`).

Why an import blocker rather than a second venv with only the pipeline extra:
building that venv downloads ~3 GB (transformers, pyarrow, tfds, Beam[gcp]) and
takes minutes, and it would differ from the main venv only in the packages the
blocker hides. The child interpreter makes jax, jaxlib, flax, tunix, grain,
orbax, optax and qwix unimportable (a meta path finder ahead of all others raises
ModuleNotFoundError for them, as if they were not installed), records every
attempt, and fails the check if any code even tried to import one of them.

No input is read and no output written: each --input (or each input of a --mixture
source) becomes one read task named after its spec, and the plan-side steps, the mix
step of a mixture job included, are built as for any input size.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent

# The training stack: what a Dataflow worker never installs and never needs.
TRAINING_MODULES = ("jax", "jaxlib", "flax", "tunix", "grain", "orbax", "optax", "qwix")
TRAINING_DISTS = ("jax", "jaxlib", "flax", "google-tunix", "grain", "orbax-checkpoint", "optax", "qwix")

# The steps of pipelines/launch/graph.build_pipeline a Dataflow job must have (top-level names).
# Every job's (Mix: each source's share of every length, between Fit and the plan; a plain run
# is one source, passed through).
EXPECTED_STEPS = ("Read", "Prepare", "Fit", "Mix", "Route", "Write", "WriteTokenSet")
# Steps whose DoFns the project wrote (their setup() runs in the child interpreter).
PROJECT_MODULE_PREFIXES = ("pipelines.", "prepack.")


class ValidationError(ValueError):
    """The job does not build for Dataflow, or what it would ship is wrong; one line."""


@dataclasses.dataclass
class Report:
    steps: list[str]
    environments: int
    packaging: str  # setup | container
    staged: list[str]
    image: str
    machine_type: str
    disk_size_gb: int
    harness_threads: int
    max_workers: int
    unpickled: dict[str, int]  # dofns, combinefns, coders, setups
    problems: list[str]

    def lines(self) -> list[str]:
        out = [
            f"built by DataflowRunner (dry run): {len(self.steps)} top-level steps, {self.environments} environment(s)",
            "steps: " + ", ".join(self.steps),
            f"worker code: {self.packaging}: " + (", ".join(self.staged) if self.staged else f"image {self.image}"),
            f"worker pool: {self.machine_type}, {self.disk_size_gb} GB disk, "
            f"{self.harness_threads or 'default'} harness threads, up to {self.max_workers} workers",
            "unpickled without the training stack: " + ", ".join(f"{v} {k}" for k, v in self.unpickled.items()),
        ]
        out += [f"problem: {p}" for p in self.problems]
        return out


# ----------------------------------------------------------------------------- offline inputs


def offline_inputs(specs: Sequence[str]) -> tuple[list, list]:
    """(ResolvedInput, ReadTask) lists for the specs without reading anything: one task each."""
    from pipelines.inputs.sources import ReadTask, ResolvedInput, file_kind

    inputs, tasks = [], []
    for index, spec in enumerate(specs):
        if spec.startswith("hf:"):
            kind = "hf_hub"
            task = ReadTask(index, index, kind, spec[3:], "train", 0, (("end", 1), ("split", "train"), ("start", 0)))
        elif spec.startswith("tfds:"):
            kind = "tfds"
            task = ReadTask(index, index, kind, spec[5:], "train", 0, (("end", 1), ("split", "train"), ("start", 0)))
        else:
            kind = "files"
            task = ReadTask(index, index, file_kind(spec) or "jsonl", spec, spec.rstrip("/").rsplit("/", 1)[-1], 0)
        inputs.append(ResolvedInput(index, spec, kind, 0))
        tasks.append(task)
    return inputs, tasks


# ----------------------------------------------------------------------------- build


def _check_locations(options: Any) -> None:
    """Beam replaces an invalid temp/staging location by a default bucket it creates over the
    network (retrying for minutes offline): refuse those before the runner sees them."""
    from apache_beam.options.pipeline_options import GoogleCloudOptions
    from apache_beam.options.pipeline_options_validator import PipelineOptionsValidator

    view = options.view_as(GoogleCloudOptions)
    validator = PipelineOptionsValidator(options, None)
    for name in ("temp_location", "staging_location"):
        errors = validator.validate_gcs_path(view, name)
        if errors:
            raise ValidationError(f"--{name}: {errors[0]}")


def build_dry_run(pack_argv: Sequence[str]) -> tuple[Any, Any, Any]:
    """Runs the job's construction under DataflowRunner --dry_run: (result job, options, config)."""
    import apache_beam as beam
    from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

    from pipelines.launch.graph import build_pipeline
    from pipelines.launch.prepare_job import prepare
    from pipelines.options import parse_args
    from pipelines.launch.errors import JobError

    config, beam_args = parse_args(list(pack_argv))
    options = PipelineOptions([*beam_args, "--dry_run=True", "--no_auth"])
    if options.view_as(StandardOptions).runner != "DataflowRunner":
        raise ValidationError(f"--runner must be DataflowRunner to validate a Dataflow job, got {options.view_as(StandardOptions).runner!r}")
    _check_locations(options)
    try:
        prepared = prepare(config, run_id="validate", resolved=offline_inputs(config.rows.inputs))
    except JobError as e:
        raise ValidationError(str(e)) from e
    pipeline = beam.Pipeline(options=options)
    build_pipeline(pipeline, prepared)
    result = pipeline.run()
    return result.job, options, config


# ----------------------------------------------------------------------------- checks


def _docker_environments(proto: Any) -> dict[str, Any]:
    from apache_beam.portability import common_urns

    envs = dict(proto.components.environments)
    wrong = [env_id for env_id, env in envs.items() if env.urn != common_urns.environments.DOCKER.urn]
    if wrong:
        raise ValidationError(f"environments {wrong} are not Docker environments; Dataflow runs only those")
    return envs


def _staged_files(env: Any) -> dict[str, str]:
    """Staged name -> local path of an environment's artifacts."""
    from apache_beam.portability.api import beam_runner_api_pb2

    out = {}
    for dep in env.dependencies:
        path = beam_runner_api_pb2.ArtifactFilePayload.FromString(dep.type_payload).path
        name = beam_runner_api_pb2.ArtifactStagingToRolePayload.FromString(dep.role_payload).staged_name
        out[name] = path
    return out


def _requirement_names(path: str) -> list[str]:
    import re

    names = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            names.append(re.split(r"[\[<>=!~ ;]", line, maxsplit=1)[0].lower())
    return names


def check_worker_code(proto: Any, options: Any) -> tuple[str, list[str], str, list[str]]:
    """(packaging, staged names, image, problems) for what the workers would get."""
    from apache_beam.options.pipeline_options import SetupOptions, WorkerOptions
    from apache_beam.portability.api import beam_runner_api_pb2

    envs = _docker_environments(proto)
    problems: list[str] = []
    images = {beam_runner_api_pb2.DockerPayload.FromString(env.payload).container_image for env in envs.values()}
    image = ", ".join(sorted(images))
    setup = options.view_as(SetupOptions)
    requested_image = options.view_as(WorkerOptions).sdk_container_image
    staged: dict[str, str] = {}
    for env in envs.values():
        staged.update(_staged_files(env))
    if requested_image:
        if images != {requested_image}:
            problems.append(f"workers would run {image}, not the requested image {requested_image}")
        if staged:
            problems.append(f"a custom image should need no staged files, got {sorted(staged)}")
        return "container", sorted(staged), image, problems
    if not setup.setup_file:
        problems.append("neither --setup_file nor --sdk_container_image: workers would not get the project's code")
    sdist = [path for name, path in staged.items() if name == "workflow.tar.gz"]
    if not sdist:
        problems.append("the project's sdist (workflow.tar.gz) is not staged")
    else:
        with tarfile.open(sdist[0]) as tar:
            members = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
        missing = {"setup.py", "pipelines/launch/job.py", "pipelines/stages/write.py", "prepack/text/tokenizer.py"} - members
        if missing:
            problems.append(f"the staged sdist lacks {sorted(missing)}")
    reqs = [path for name, path in staged.items() if name == "requirements.txt"]
    if not reqs:
        problems.append("no requirements.txt staged: Beam installs the setup_file package without extras, "
                        "so the workers would lack the pipeline extra")
    else:
        training = sorted(set(_requirement_names(reqs[0])) & set(TRAINING_DISTS))
        if training:
            problems.append(f"the staged requirements install training packages {training}")
    return "setup", sorted(staged), image, problems


def dataflow_environment(job: Any, options: Any) -> Any:
    """The Dataflow Environment message (worker pool) a submission would send, built offline."""
    from apache_beam.runners.dataflow.internal import apiclient

    return apiclient.Environment(
        packages=[], options=options, environment_version=apiclient._FNAPI_ENVIRONMENT_MAJOR_VERSION,
        proto_pipeline_staged_url=f"{job.google_cloud_options.staging_location}/pipeline.pb",
        proto_pipeline=job.proto_pipeline,
    ).proto


def top_level_steps(proto: Any) -> list[str]:
    transforms = proto.components.transforms
    roots = [transforms[t] for t in proto.root_transform_ids]
    names: list[str] = []
    for root in roots:
        if root.subtransforms:
            names += [transforms[t].unique_name for t in root.subtransforms]
        else:
            names.append(root.unique_name)
    return names


def unpickle_in_fresh_interpreter(proto: Any, pickle_library: str, main_session: str | None = None,
                                  timeout_s: float = 600) -> dict[str, Any]:
    """Runs `_unpickle_child` on the serialized proto (and the staged main session, which a
    worker loads first) in a new interpreter; its JSON report."""
    with tempfile.TemporaryDirectory(prefix="prepack-validate-") as tmp:
        path = os.path.join(tmp, "pipeline.pb")
        with open(path, "wb") as f:
            f.write(proto.SerializeToString())
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        done = subprocess.run([sys.executable, "-m", "gcp.dataflow_validate", "--unpickle", path, pickle_library,
                               main_session or ""],
                              capture_output=True, text=True, timeout=timeout_s, env=env, cwd=str(REPO_ROOT))
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"dofns": 0, "combinefns": 0, "coders": 0, "setups": 0, "blocked_attempts": [], "loaded": [],
                "errors": [f"the unpickling interpreter failed: {tail}"]}
    return json.loads(lines[-1])


def validate(pack_argv: Sequence[str]) -> Report:
    """Builds the job with DataflowRunner --dry_run and checks it; raises ValidationError for a
    job that does not build, returns a Report whose `problems` list what would go wrong."""
    from apache_beam.options.pipeline_options import DebugOptions, SetupOptions

    job, options, config = build_dry_run(pack_argv)
    proto = job.proto_pipeline
    problems: list[str] = []
    steps = top_level_steps(proto)
    missing = [s for s in EXPECTED_STEPS if s not in steps]
    if missing:
        problems.append(f"the Dataflow pipeline lacks the steps {missing}")
    packaging, staged, image, code_problems = check_worker_code(proto, options)
    problems += code_problems
    environment = dataflow_environment(job, options)
    (pool,) = environment.worker_pools
    threads = options.view_as(DebugOptions).number_of_worker_harness_threads or 0
    if threads and pool.num_threads_per_worker != threads:
        problems.append(f"worker pool has {pool.num_threads_per_worker} harness threads, not {threads}")
    sessions = [path for env in proto.components.environments.values()
                for name, path in _staged_files(env).items() if name == "pickled_main_session"]
    child = unpickle_in_fresh_interpreter(proto, options.view_as(SetupOptions).pickle_library, (sessions or [None])[0])
    problems += child["errors"]
    if child["blocked_attempts"]:
        problems.append(f"worker code tried to import the training stack: {sorted(set(child['blocked_attempts']))}")
    if child["loaded"]:
        problems.append(f"training modules loaded on the worker: {child['loaded']}")
    return Report(
        steps=steps, environments=len(proto.components.environments), packaging=packaging, staged=staged, image=image,
        machine_type=pool.machine_type, disk_size_gb=pool.disk_size_gb, harness_threads=pool.num_threads_per_worker,
        max_workers=pool.autoscaling_settings.max_num_workers,
        unpickled={k: child[k] for k in ("dofns", "combinefns", "coders", "setups")}, problems=problems,
    )


# ----------------------------------------------------------------------------- the child interpreter


class _TrainingStackBlocker:
    """A meta path finder that makes the training stack unfindable and records who asked."""

    def __init__(self, blocked: Sequence[str]):
        self.blocked = tuple(blocked)
        self.attempts: list[str] = []

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".", 1)[0] in self.blocked:
            self.attempts.append(name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: not in the pipeline extra)", name=name)
        return None


def _unpickle_child(pb_path: str, pickle_library: str, main_session: str = "") -> dict[str, Any]:
    """What an SDK worker does with the staged pipeline, short of running it: unpickle every
    DoFn and CombineFn payload (as bundle_processor does), build every coder, and run the
    project's DoFns' setup() (tokenizer and template loading)."""
    blocker = _TrainingStackBlocker(TRAINING_MODULES)
    sys.meta_path.insert(0, blocker)
    from apache_beam.internal import pickler
    from apache_beam.portability import common_urns, python_urns
    from apache_beam.portability.api import beam_runner_api_pb2
    from apache_beam.runners import pipeline_context

    pickler.set_library(pickle_library)
    report: dict[str, Any] = {"dofns": 0, "combinefns": 0, "coders": 0, "setups": 0, "errors": []}
    if main_session:
        try:
            pickler.load_session(main_session)
        except Exception as e:
            report["errors"].append(f"main session: {type(e).__name__}: {e}")
    proto = beam_runner_api_pb2.Pipeline.FromString(Path(pb_path).read_bytes())
    for tid, transform in proto.components.transforms.items():
        urn = transform.spec.urn
        try:
            if urn == common_urns.primitives.PAR_DO.urn:
                payload = beam_runner_api_pb2.ParDoPayload.FromString(transform.spec.payload)
                if payload.do_fn.urn != python_urns.PICKLED_DOFN_INFO:
                    continue
                fn = pickler.loads(payload.do_fn.payload)[0]
                report["dofns"] += 1
                if type(fn).__module__.startswith(PROJECT_MODULE_PREFIXES):
                    fn.setup()
                    report["setups"] += 1
            elif urn in (common_urns.composites.COMBINE_PER_KEY.urn, common_urns.composites.COMBINE_GLOBALLY.urn):
                payload = beam_runner_api_pb2.CombinePayload.FromString(transform.spec.payload)
                if payload.combine_fn.urn == python_urns.PICKLED_COMBINE_FN:
                    pickler.loads(payload.combine_fn.payload)
                    report["combinefns"] += 1
        except Exception as e:  # reported, so every failing step is named at once
            report["errors"].append(f"{transform.unique_name}: {type(e).__name__}: {e}")
    context = pipeline_context.PipelineContext(proto.components)
    for coder_id in proto.components.coders:
        try:
            context.coders.get_by_id(coder_id)
            report["coders"] += 1
        except Exception as e:
            report["errors"].append(f"coder {coder_id}: {type(e).__name__}: {e}")
    report["blocked_attempts"] = blocker.attempts
    report["loaded"] = sorted(m for m in sys.modules if m.split(".", 1)[0] in TRAINING_MODULES)
    return report


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--unpickle":
        print(json.dumps(_unpickle_child(sys.argv[2], sys.argv[3], sys.argv[4])))
        sys.exit(0)
    print("usage: python -m gcp.dataflow_validate --unpickle PIPELINE_PB PICKLE_LIBRARY MAIN_SESSION_OR_EMPTY", file=sys.stderr)
    sys.exit(2)
