"""Every output a `prepack train` run writes, listed in one place, and the checks made before any weight loads.

`run_outputs(cfg)` names each output the flags ask for (flag, path, what it is), so that one
check before step 1 can cover them all: `check_outputs(cfg)` refuses, in one line and before any
weight loads, an output the one output rule refuses (prepack/storage/output_rule.py: one inside
or around an input such as --shards, the working folder or one above it, two outputs that overlap
except --profile-dir in --tensorboard), an output whose path names no place (prepack.storage.location_problem: a scheme
other than gs://, a gs:// URL without a bucket), that is a file where a folder goes or the other
way round, that lies under a file, that cannot be written (locally an unnamed temporary file is
made and dropped in its folder; on gs:// one empty object is written and deleted in its folder,
as `prepack pack` probes its output), or that exists where it would be
replaced (--metrics-out and --save-lora need --overwrite; a resumed run appends to its metrics,
and is refused when that file has another name, a hard link, or is one of its inputs: every other
file a run writes is a new file renamed into place, prepack/storage/new_file.py).
Each new output option of train is added to `run_outputs`, and to `OUTPUT_FIELDS`: `prepack train`
resolves each output path once as it reads its options (`with_resolved_paths`), and the checks and
the writers use that string.

A failure after training never loses the trained adapter: `export_or_recover` saves it under
--checkpoint-dir, or beside the --save-lora path (PATH.recovered), and names the place in the
one line the run fails with (ExportFailed, exit 1).
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from collections.abc import Callable
from typing import Any

from prepack import storage
from prepack.storage import new_file, output_rule
from train.compilation import compile_cache
from train.run_config.config import TrainConfig, TrainError

FILE, FOLDER = "file", "folder"


@dataclasses.dataclass(frozen=True)
class Output:
    flag: str
    path: str
    kind: str  # FILE or FOLDER
    replaced_only_with_overwrite: bool  # an existing target is refused unless --overwrite
    local_only: bool = False  # its writer cannot write gs:// (use a gcsfuse mount)
    appended_on_resume: bool = False  # a resumed run appends to it without --overwrite


def run_outputs(cfg: TrainConfig) -> list[Output]:
    out = []
    if cfg.metrics_out:
        out.append(Output("--metrics-out", cfg.metrics_out, FILE, True, local_only=True, appended_on_resume=True))
    if cfg.checkpoint_dir:
        out.append(Output("--checkpoint-dir", cfg.checkpoint_dir, FOLDER, False))  # a folder of the same run resumes
    if cfg.save_lora:
        kind = FOLDER if cfg.lora_format == "peft" else FILE
        out.append(Output("--save-lora", cfg.save_lora, kind, True))
    if cfg.tensorboard:
        out.append(Output("--tensorboard", cfg.tensorboard, FOLDER, False, local_only=True))  # event files are added
    if cfg.profile_steps:
        out.append(Output("--profile-dir", profile_folder(cfg), FOLDER, False, local_only=True))
    cache = compile_cache.resolve(cfg.compile_cache)
    if cache:  # XLA adds its executables there (shared by runs: never replaced)
        out.append(Output(compile_cache.source(cfg.compile_cache), cache, FOLDER, False, local_only=True))
    return out


# The TrainConfig fields that name outputs, by flag (with --compile-cache: compile_cache.resolved_option).
OUTPUT_FIELDS = {"--metrics-out": "metrics_out", "--checkpoint-dir": "checkpoint_dir", "--save-lora": "save_lora",
                 "--tensorboard": "tensorboard", "--profile-dir": "profile_dir"}


def with_resolved_paths(cfg: TrainConfig) -> TrainConfig:
    """cfg with each output path resolved once (prepack.storage.output_rule.output_path), where
    `prepack train` reads its options: the output rule judges, and every writer writes at, that
    string. A path through a dangling link or a link loop is refused (TrainError, one line)."""
    try:
        changed = {name: output_rule.output_path(flag, getattr(cfg, name))
                   for flag, name in OUTPUT_FIELDS.items() if getattr(cfg, name)}
        changed["compile_cache"] = compile_cache.resolved_option(cfg.compile_cache)
    except output_rule.OutputPathError as e:
        raise TrainError(str(e)) from None
    return dataclasses.replace(cfg, **changed)


# The outputs of a run that its layout puts one inside the other (inner flag, outer flag): the
# profiler's trace goes to TensorBoard's own folder (its profile tab reads it there). Every other
# pair of outputs must not overlap (prepack/storage/output_rule.py).
OUTPUTS_INSIDE_OUTPUTS = {("--profile-dir", "--tensorboard"): ""}


def run_inputs(cfg: TrainConfig) -> list[output_rule.Place]:
    """Every path a run reads, by flag: no output may be, contain or lie inside one. The
    --checkpoint-dir a run resumes from is its output, not listed here."""
    Place = output_rule.Place
    found = [Place("--shards", cfg.shards)]
    if cfg.eval_shards:
        found.append(Place("--eval-shards", cfg.eval_shards))
    if cfg.weights and cfg.weights not in ("random", "gguf"):
        found.append(Place("--weights", cfg.weights))
    if cfg.eval_generate:
        found.append(Place("--eval-generate", cfg.eval_generate))
    return found


def run_paths(cfg: TrainConfig) -> output_rule.RunPaths:
    """What the run reads and writes, for the one output rule."""
    return output_rule.RunPaths(run_inputs(cfg), [output_rule.Place(o.flag, o.path) for o in run_outputs(cfg)], OUTPUTS_INSIDE_OUTPUTS)


def profile_folder(cfg: TrainConfig) -> str:
    folder = cfg.profile_dir or cfg.tensorboard
    if not folder:
        raise TrainError("--profile-steps needs a folder for the trace: --profile-dir DIR, or --tensorboard DIR "
                         "(the trace then shows in TensorBoard's profile tab)")
    return folder


def profile_range(cfg: TrainConfig) -> tuple[int, int] | None:
    """--profile-steps A:B as (A, B), optimizer steps counted from 1, both included."""
    if not cfg.profile_steps:
        return None
    text = cfg.profile_steps
    try:
        a, b = (int(x) for x in text.split(":"))
    except ValueError:
        raise TrainError(f"--profile-steps {text!r}: expected A:B, the first and last optimizer step to trace (e.g. 3:5)") from None
    if not 1 <= a <= b <= cfg.steps:
        raise TrainError(f"--profile-steps {text}: need 1 <= A <= B <= --steps ({cfg.steps})")
    return a, b


def profiler_options(cfg: TrainConfig) -> Any:
    """Tunix's profiler for --profile-steps: it starts the JAX trace before step A's batch and stops it after step B.

    Tunix counts loop iterations from 0 (after a restore, from the restored step), one per
    optimizer step here (micro-batches are stacked into one element): step A begins at iteration
    A - 1. The trainer fetches step B's results before the trace stops (train/run_setup.py), so
    the trace holds B's device work."""
    span = profile_range(cfg)
    if span is None:
        return None
    from tunix.sft import profiler

    a, b = span
    return profiler.ProfilerOptions(log_dir=profile_folder(cfg), skip_first_n_steps=a - 1, profiler_steps=b - a + 1)


def _nearest_existing(path: str) -> str:
    """The path itself, or its nearest ancestor that exists (where a writer would create folders)."""
    here = os.path.abspath(path)
    while not os.path.lexists(here):
        parent = os.path.dirname(here)
        if parent == here:
            break
        here = parent
    return here


def _local_refusal(o: Output, overwrite: bool, appends: bool) -> str | None:
    """appends: the existing file is a resumed run's own metrics, appended to."""
    path = o.path
    if os.path.lexists(path):
        if o.kind == FOLDER and not os.path.isdir(path):
            return f"{o.flag} {path} is a file; give a folder"
        if o.kind == FILE and os.path.isdir(path):
            return f"{o.flag} {path} is a folder; give a file path"
        if o.replaced_only_with_overwrite and not overwrite and not appends:
            also = " (no checkpoint in --checkpoint-dir resumes into it)" if o.appended_on_resume else ""
            return f"{o.flag} {path} already exists{also}; pass --overwrite to replace it, or give another path"
    base = _nearest_existing(path)
    if not os.path.isdir(base) and base != os.path.abspath(path):
        return f"{o.flag} {path}: {base} is a file, so no folder can be made there; give another path"
    return _unwritable(o, base if os.path.isdir(base) else os.path.dirname(base))


def _unwritable(o: Output, folder: str) -> str | None:
    """Writes nothing that stays: an unnamed temporary file (O_TMPFILE where the filesystem has it)
    in the folder the output will be written in, or its nearest existing ancestor. os.access would
    say yes to root on a read-only mount's folders."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"{o.flag} {o.path}: cannot write in {folder} ({e.strerror or e}); give a writable path"
    if o.kind == FILE and os.path.isfile(o.path) and not os.access(o.path, os.W_OK):
        return f"{o.flag} {o.path}: the file is not writable; give a writable path"
    return None


def _gcs_refusal(o: Output, overwrite: bool) -> str | None:
    """A gs:// output: a local-only writer refused; what exists there; writable, by writing and
    deleting one empty object in the folder it goes to (as `prepack pack` probes its output)."""
    if o.local_only:
        return f"{o.flag} {o.path}: writes to a local folder only; give a local path (or a gcsfuse mount)"
    store = storage.storage_for(o.path)
    try:
        if o.replaced_only_with_overwrite and not overwrite:
            there = store.list_files(o.path) if o.kind == FOLDER else ([o.path] if store.is_file(o.path) else [])
            if there:
                return f"{o.flag} {o.path} already exists; pass --overwrite to replace it, or give another path"
        folder = o.path.rstrip("/") if o.kind == FOLDER else o.path.rstrip("/").rsplit("/", 1)[0]
        probe = storage.join(folder, f".prepack-train-probe-{os.getpid()}")
        store.write(probe, b"")
        store.delete([probe])
    except Exception as e:  # noqa: BLE001  (no bucket, no access, no credentials: the client's own words)
        return f"{o.flag} {o.path}: cannot write there ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})"
    return None


def check_outputs(cfg: TrainConfig, resumes: Callable[[], bool] = lambda: False) -> None:
    """Refuses, before any weight loads, outputs that cannot be written as asked; one line for the first.

    resumes: whether --checkpoint-dir holds a checkpoint to resume from (then the metrics JSONL is
    appended to, as the resumed run's own, without --overwrite); asked only once every output's
    location is known good, and only when it matters."""
    profile_range(cfg)
    listed = run_outputs(cfg)
    asked: list[bool] = []

    def resumes_once() -> bool:  # it lists the checkpoint folder: asked once at most
        if not asked:
            asked.append(resumes())
        return asked[0]

    # first: paths that name no place (gs:///x), outputs over inputs, the working folder, each other
    refused = output_rule.refusal(run_paths(cfg))
    if refused:
        raise TrainError(refused)
    for o in listed:
        if storage.is_gcs(o.path):
            refusal = _gcs_refusal(o, cfg.overwrite)
        else:
            appends = o.appended_on_resume and not cfg.overwrite and os.path.lexists(o.path) and resumes_once()
            refusal = _local_refusal(o, cfg.overwrite, appends) or _append_refusal(cfg, o, resumes_once)
        if refusal:
            raise TrainError(refusal)


def _append_refusal(cfg: TrainConfig, o: Output, resumes: Callable[[], bool]) -> str | None:
    """A resumed run appends to its metrics file (with or without --overwrite): only to a file
    with no other name that is none of the run's inputs (prepack/storage/new_file.py), since
    appending writes into that file. Every other write of a run's file makes a new one."""
    if not o.appended_on_resume or not os.path.isfile(o.path) or not resumes():
        return None
    problem = new_file.append_problem(o.path, [p.path for p in run_inputs(cfg)])
    if problem is None:
        return None
    return (f"{o.flag} {o.path} {problem}; a resumed run appends to its metrics: give it a file of its own "
            f"(a copy: cp {o.path} NEW, then {o.flag} NEW)")


# ----------------------------------------------------------------------------- a late failure


class ExportFailed(Exception):
    """--save-lora failed after training; the message says where the adapter was saved instead (exit 1)."""


def recovery_path(cfg: TrainConfig, exists: Callable[[str], bool] | None = None) -> str:
    """Where the trained adapter goes when --save-lora fails after training: under --checkpoint-dir
    when there is one, else beside the path given (PATH.recovered); a free name, never a replaced one."""
    suffix = ".safetensors" if cfg.lora_format == "prepack" else ""
    if cfg.checkpoint_dir:
        base = storage.join(cfg.checkpoint_dir.rstrip("/"), "recovered-lora")
    else:
        target = cfg.save_lora.rstrip("/") or cfg.save_lora
        base, suffix = target + ".recovered", ""
    exists = exists or (lambda p: storage.storage_for(p).exists(p) or bool(storage.is_gcs(p) and storage.storage_for(p).list_files(p)))
    candidate, n = base + suffix, 1
    while exists(candidate):
        n += 1
        candidate = f"{base}-{n}{suffix}"
    return candidate


def export_or_recover(cfg: TrainConfig, export: Callable[[str, bool], Any], say: Any) -> tuple[str, str | None]:
    """Runs export(path, overwrite) on --save-lora; on any failure, on recovery_path(cfg), then raises
    ExportFailed naming both. Returns (the path written, None) when --save-lora itself worked."""
    try:
        export(cfg.save_lora, cfg.overwrite)
        return cfg.save_lora, None
    except Exception as e:  # noqa: BLE001  (whatever failed, the trained adapter must not be lost)
        error = _one_line(e)
    try:
        recovered = recovery_path(cfg)
        export(recovered, False)
    except Exception as e2:  # noqa: BLE001
        kept = (f"; the last checkpoint in --checkpoint-dir {cfg.checkpoint_dir} holds the trained adapter: rerun the same "
                "command to export it" if cfg.checkpoint_dir else ": the trained adapter is lost")
        raise ExportFailed(f"--save-lora {cfg.save_lora}: the export failed after training ({error}), and saving the "
                           f"adapter beside it failed too ({_one_line(e2)}){kept}") from e2
    print(f"--save-lora {cfg.save_lora} failed; the trained adapter was saved to {recovered}", file=say, flush=True)
    raise ExportFailed(f"--save-lora {cfg.save_lora}: the export failed after training ({error}); the trained adapter "
                       f"was saved to {recovered} instead")


def _one_line(e: BaseException) -> str:
    text = str(e).splitlines()[0][:300] if str(e) else ""
    return f"{type(e).__name__}: {text}" if not isinstance(e, (TrainError, ValueError)) or not text else text
