"""Every output a `prepack train` run writes, listed in one place, and the checks made before any weight loads.

`run_outputs(cfg)` names each output the flags ask for (flag, path, what it is), so that one
check before step 1 can cover them all; `check_outputs(cfg)` refuses, in one line, the ones
that are wrong already (today: the adapter export, the TensorBoard folder and the profile folder).
Each new output option of train is added to `run_outputs`.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from prepack import storage
from train.config import TrainConfig, TrainError

FILE, FOLDER = "file", "folder"


@dataclasses.dataclass(frozen=True)
class Output:
    flag: str
    path: str
    kind: str  # FILE or FOLDER
    replaced_only_with_overwrite: bool  # an existing target is refused unless --overwrite
    local_only: bool = False  # its writer cannot write gs:// (use a gcsfuse mount)


def run_outputs(cfg: TrainConfig) -> list[Output]:
    out = []
    if cfg.metrics_out:
        out.append(Output("--metrics-out", cfg.metrics_out, FILE, False, local_only=True))
    if cfg.checkpoint_dir:
        out.append(Output("--checkpoint-dir", cfg.checkpoint_dir, FOLDER, False))  # a folder of the same run resumes
    if cfg.save_lora:
        kind = FOLDER if cfg.lora_format == "peft" else FILE
        out.append(Output("--save-lora", cfg.save_lora, kind, True))
    if cfg.tensorboard:
        out.append(Output("--tensorboard", cfg.tensorboard, FOLDER, False, local_only=True))  # event files are added
    if cfg.profile_steps:
        out.append(Output("--profile-dir", profile_folder(cfg), FOLDER, False, local_only=True))
    return out


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


def _refusal(o: Output, overwrite: bool) -> str | None:
    path = o.path
    if storage.is_gcs(path):
        if o.local_only:
            return f"{o.flag} {path}: writes to a local folder only; give a local path (or a gcsfuse mount)"
        try:
            storage.split_gcs(path)
        except ValueError:
            return f"{o.flag} {path}: names no bucket; write gs://BUCKET/..."
        return None
    if os.path.exists(path):
        if o.kind == FOLDER and not os.path.isdir(path):
            return f"{o.flag} {path} is a file; give a folder"
        if o.kind == FILE and os.path.isdir(path):
            return f"{o.flag} {path} is a folder; give a file path"
        if o.replaced_only_with_overwrite and not overwrite:
            return f"{o.flag} {path} already exists; pass --overwrite to replace it, or give another path"
    return None


def check_outputs(cfg: TrainConfig) -> None:
    """Refuses, before any weight loads, outputs that cannot be written as asked; one line for the first."""
    profile_range(cfg)
    for o in run_outputs(cfg):
        refusal = _refusal(o, cfg.overwrite)
        if refusal:
            raise TrainError(refusal)
