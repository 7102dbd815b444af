"""The checkpoint folder of `prepack train --checkpoint-dir`: what a run is, when it saves, and the loader state.

Layout of `--checkpoint-dir DIR` (a local folder, a gcsfuse mount or gs://):

    DIR/run.json                          what the run is (model, LoRA, base weights, data, optimizer);
                                          a resume must match it (checked before any weight is read)
    DIR/tunix/<step>/model_params         Tunix's own CheckpointManager (TrainingConfig.checkpoint_root_directory):
    DIR/tunix/<step>/optimizer_state        only the nnx.LoRAParam values when LoRA is on, and the optimizer state
    DIR/data/process_<i>-of-<n>.json      each host's loader state (loaders' get_state JSON) after <step> batches,
                                          for the most recent checkpoint steps

Saving. Tunix saves inside its train loop, after every optimizer step, whenever the
Orbax save-decision policy says so; ours (`EveryNStepsAndLast`) says "every N steps and
the last step". The trainer's `checkpoint_manager` is wrapped (`DataStateCheckpoints`) so
that each save first writes the loader state for that step, then lets Tunix save the
weights: a step that Orbax has committed always has its loader state on disk (the other
order could leave a committed step without one if the process died between the two).

How a run picks up from it is train/checkpointing/resume.py; the LoRA export is train/adapter_files/lora_file.py.

Not covered: Orbax's save-on-preemption policy (it would save at a step our loader state
was not written for, and needs jax.distributed's preemption service); periodic checkpoints
bound the lost work instead. Changing the number of hosts between save and resume is
refused by the loader.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any

from prepack import storage
from prepack.storage import places
from prepack.hostile_input.untrusted import shown, shown_with_type
from train.run_config import options
from train.objectives.sft import SFT

log = logging.getLogger(__name__)

RUN_FORMAT = 1
DATA_FORMAT = 1

# run.json fields a resume must match, with the words used in error messages. Anything else
# (--steps, --checkpoint-every, eval settings, --mesh, read threads, metrics path) may change.
IDENTITY_LABELS: dict[str, str] = {
    "model": "model",
    "dtype": "parameter dtype",
    "vocab_size": "vocabulary size",
    "config_overrides": "model config overrides",
    "lora_rank": "LoRA rank",
    "lora_alpha": "LoRA alpha",
    "lora_module_path": "LoRA module paths",
    "shard_set": "shard set (content id)",
    "seed": "seed",
    "batch_size": "batch size",
    "processes": "number of processes",
    "learning_rate": "learning rate",
    "loss": "loss",
    "lora_dtype": "LoRA dtype",
    "nan_policy": "--nan-policy",
    "loss_mean": "--loss-mean",
    "lr_schedule": "learning-rate schedule",
    "max_grad_norm": "--max-grad-norm",
    "grad_accum_steps": "--grad-accum-steps",
    "qlora": "--qlora",
    "objective": "--objective",
}
# What a checkpoint written before a field existed ran with: it stays resumable by a run that
# keeps that default, and refuses one that does not (clipping was off before --max-grad-norm).
IDENTITY_DEFAULTS: dict[str, Any] = {
    "loss_mean": "token",
    "lr_schedule": {"kind": "constant", "warmup_steps": 0, "min_lr_ratio": 0.0, "total_steps": None},
    "max_grad_norm": 0.0,
    "grad_accum_steps": 1,
    "qlora": None,
    "objective": {"name": SFT.name},  # SFT was all there was
}


class CheckpointError(ValueError):
    """A checkpoint or LoRA file that cannot be used as asked; the message says why and what to do."""


DAMAGED = "the checkpoint folder was edited or is damaged: use a new --checkpoint-dir"
# What Tunix's CheckpointManager saves in each step's folder; a resume needs both.
ITEMS = {"model_params": "the LoRA parameters", "optimizer_state": "the optimizer's moments and step count"}


def _folder_exists(path: str) -> bool:
    if storage.is_gcs(path):
        return bool(storage.storage_for(path).list_files(path))
    return os.path.isdir(path)


def optimizer_problem(optimizer: Any, step: int) -> str | None:
    """Whether a restored optimizer is the one of checkpoint step `step`: nnx's update count is the
    step, and every optax count (Adam's, the schedule's) plus the updates --nan-policy skip-step
    skipped equals it. One line naming what differs, or None."""
    import jax
    from flax import nnx

    taken = int(optimizer.step.get_value())
    if taken != step:
        return f"its optimizer state is of step {taken:,}, not {step:,}"
    counts, skipped = [], 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(nnx.state(optimizer, nnx.optimizer.OptState))[0]:
        names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
        names = [n for n in names if n != "value"]
        if names and names[-1] == "count":
            counts.append(int(leaf))
        elif names and names[-1] == "total_notfinite":
            skipped += int(leaf)
    wrong = [c for c in counts if c + skipped != step]
    if wrong:
        return (f"its optimizer's update counts are {sorted(set(counts))} with {skipped} skipped, not {step:,}: the "
                "optimizer state is another step's")
    return None



# ----------------------------------------------------------------------------- identity


def _describe(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, sort_keys=True)


def identity_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """'label: checkpoint X, now Y' for every identity field that differs."""
    out = []
    for key, label in IDENTITY_LABELS.items():
        was = saved.get(key, IDENTITY_DEFAULTS.get(key))
        if key in now and was != now.get(key):
            out.append(f"{label}: checkpoint {_describe(was)}, now {_describe(now.get(key))}")
    return out


# ----------------------------------------------------------------------------- save policy


@dataclasses.dataclass(frozen=True)
class EveryNStepsAndLast:
    """Orbax SaveDecisionPolicy: save every `every` steps and at step `last`.

    The same `wants()` decides, in DataStateCheckpoints, whether to write the loader state
    before a save, so the two can never disagree about which steps are checkpoints.
    """

    every: int | None
    last: int

    def wants(self, step: int) -> bool:
        return step == self.last or (bool(self.every) and step % int(self.every) == 0)

    def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
        del previous_steps, context  # Orbax itself refuses steps <= its latest one
        return self.wants(int(step.step))


# ----------------------------------------------------------------------------- the checkpoint folder


def holds_checkpoint(path: str | None) -> bool:
    """Whether --checkpoint-dir `path` holds a finalized step (a run there resumes, or is refused)."""
    if not path:
        return False
    ckpt = CheckpointDir(path)
    ckpt.require_backend()
    return ckpt.latest_step() is not None


class CheckpointDir:
    """DIR/run.json, DIR/tunix (Tunix's Orbax root) and DIR/data (loader states)."""

    def __init__(self, path: str, process_index: int = 0, process_count: int = 1):
        path = str(path).rstrip("/")
        # Orbax refuses relative local paths ("Checkpoint path should be absolute"); resolved as the
        # output rule judged it (a link followed by `..` is not abspath's place).
        self.path = places.resolved(path)
        self.process_index = process_index
        self.process_count = process_count

    @property
    def tunix_root(self) -> str:
        return storage.join(self.path, "tunix")

    @property
    def run_path(self) -> str:
        return storage.join(self.path, "run.json")

    @property
    def data_path(self) -> str:
        return storage.join(self.path, f"data/process_{self.process_index}-of-{self.process_count}.json")

    def require_backend(self) -> None:
        """Orbax lists and renames gs:// folders through etils.epath, which needs gcsfs; say so up front."""
        if storage.is_gcs(self.path):
            try:
                import gcsfs  # noqa: F401
            except ImportError:
                raise CheckpointError(
                    f"--checkpoint-dir {self.path}: Orbax needs the gcsfs package for gs:// folders "
                    "(pip install gcsfs), or mount the bucket read-write with gcsfuse and pass the local path"
                ) from None

    def latest_step(self) -> int | None:
        """The newest finalized Orbax step (what Tunix will restore), without creating anything."""
        import orbax.checkpoint as ocp

        steps = ocp.utils.checkpoint_steps(self.tunix_root)
        return max(steps) if steps else None

    def read_run(self) -> dict[str, Any] | None:
        """run.json, its shape checked (a stranger's file: `[]`, or an `identity` of "x", was a traceback)."""
        text = storage.read_text(self.run_path)
        if text is None:
            return None
        try:
            record = json.loads(text)
        except (ValueError, RecursionError) as e:  # also a 5,001-digit integer, or nesting 100,000 deep
            raise CheckpointError(f"{self.run_path}: not valid JSON ({str(e)[:120]})") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{self.run_path}: {shown_with_type(record)} is not a run record (a JSON object); {DAMAGED}")
        for key in ("identity", "base_weights"):
            if key in record and not isinstance(record[key], dict):
                raise CheckpointError(f"{self.run_path}: `{key}` is {shown_with_type(record[key])}, not a JSON object; {DAMAGED}")
        # The adapter's scale, as every adapter read back is held to it (an alpha of NaN, Infinity or
        # 1e300 parses as JSON); a run never resumes into it, since --lora-alpha has the same rule.
        identity = record.get("identity", {})
        for key, problem_of in (("lora_alpha", options.lora_alpha_problem), ("lora_rank", options.lora_rank_problem)):
            problem = problem_of(identity[key]) if key in identity else None
            if problem:
                raise CheckpointError(f"{self.run_path}: identity.{key} {problem}; {DAMAGED}")
        return record

    def check_resumable(
        self, identity: Mapping[str, Any], base: Mapping[str, Any] | None = None, info: Mapping[str, Any] | None = None
    ) -> int | None:
        """Raises CheckpointError when DIR holds checkpoints of another run; returns the latest step (None: fresh).

        Called twice by the trainer: with the configuration alone before any weights are
        loaded (cheap, catches model/rank/data mismatches at once), then with the base
        weights' fingerprint once the base model is built, before Tunix restores anything.
        """
        step = self.latest_step()
        if step is None:
            return None
        saved = self.read_run()
        if saved is None:
            raise CheckpointError(
                f"--checkpoint-dir {self.path} holds checkpoints (latest step {step}) but no run.json: "
                "not written by prepack train; use another --checkpoint-dir"
            )
        if saved.get("format") != RUN_FORMAT:
            raise CheckpointError(f"{self.run_path}: format {shown(saved.get('format'))} is not supported (expected {RUN_FORMAT})")
        differ = identity_differences(saved.get("identity", {}), identity)
        if saved.get("identity", {}).get("shard_set") != identity.get("shard_set"):
            differ.append(f"shards: checkpoint read {saved.get('shards')!r}, now {(info or {}).get('shards')!r}")
        if base is not None:
            theirs = saved.get("base_weights", {})
            if theirs.get("fingerprint") != base.get("fingerprint"):
                differ.append(
                    f"base weights: checkpoint {theirs.get('source')!r} (fingerprint {theirs.get('fingerprint')}), "
                    f"now {base.get('source')!r} (fingerprint {base.get('fingerprint')})"
                )
        if differ:
            raise CheckpointError(
                f"--checkpoint-dir {self.path} holds a different run (latest step {step}), so it cannot be resumed: "
                + "; ".join(differ)
                + ". Resume with the checkpoint's settings, or use a new --checkpoint-dir."
            )
        return step

    def step_path(self, step: int) -> str:
        return storage.join(self.tunix_root, str(step))

    def check_complete(self, step: int, micro_batches: int = 1) -> None:
        """Before any weight loads: the step Tunix will restore has every part a resume needs, and its
        loader state is that step's. Tunix restores whatever items a step holds: one whose optimizer
        state was deleted resumed with a fresh Adam (count 1 where an intact resume has 3, LoRA off
        by 1.8e-4), and a loader state edited to another step's position trained a batch twice."""
        for item, meaning in ITEMS.items():
            if not _folder_exists(storage.join(self.step_path(step), item)):
                raise CheckpointError(
                    f"--checkpoint-dir {self.path}: step {step} has no {item} ({meaning}), so it cannot be resumed exactly; "
                    f"{self.remedy(step)}")
        state = self.load_data_state(step)
        if state is None:
            return  # not written by us: Tunix's own re-read positions the data (train/checkpointing/resume.py)
        from loaders.dataset import batches_read

        try:
            position = batches_read(state)
        except ValueError as e:
            raise CheckpointError(f"{self.data_path}: step {step}: {e}; {DAMAGED}") from None
        if position is not None and position != step * micro_batches:
            per_step = f" ({micro_batches} micro-batches a step)" if micro_batches > 1 else ""
            raise CheckpointError(
                f"{self.data_path}: the loader state of step {step} is after {position:,} batches, but step {step} read "
                f"{step * micro_batches:,}{per_step}: resuming there would train batches twice or skip them; {DAMAGED}")

    def restore_problem(self, step: int, error: BaseException) -> str:
        """The one line for a step Tunix (Orbax) could not restore: truncated or missing data files."""
        text = " ".join(str(error).split()).split(" See full TensorStore details")[0][:200]
        return (f"--checkpoint-dir {self.path}: step {step} cannot be restored ({type(error).__name__}: {text}): its files "
                f"are damaged or incomplete; {self.remedy(step)}")

    def remedy(self, step: int) -> str:
        return (f"remove {self.step_path(step)} to resume from the checkpoint before it, or use a new --checkpoint-dir")

    def write_run(self, identity: Mapping[str, Any], base: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        """Only process 0 writes run.json (every host computes the same identity)."""
        if self.process_index != 0:
            return
        record = {"format": RUN_FORMAT, "identity": dict(identity), "base_weights": dict(base), **dict(info)}
        storage.write_text(self.run_path, json.dumps(record, indent=1, sort_keys=True) + "\n")

    # -- loader states

    def _read_data(self) -> dict[str, Any]:
        """The loader states, their shape checked: {"format": 1, "states": {"<step>": {...}}}."""
        text = storage.read_text(self.data_path)
        if text is None:
            return {"format": DATA_FORMAT, "states": {}}
        try:
            record = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise CheckpointError(f"{self.data_path}: not valid JSON ({str(e)[:120]})") from None
        if not isinstance(record, dict):
            raise CheckpointError(f"{self.data_path}: {shown_with_type(record)} is not a record of loader states "
                                  f"(a JSON object); {DAMAGED}")
        if record.get("format") != DATA_FORMAT:
            raise CheckpointError(f"{self.data_path}: format {shown(record.get('format'))} is not supported (expected {DATA_FORMAT})")
        states = record.get("states")
        if not isinstance(states, dict):
            raise CheckpointError(f"{self.data_path}: `states` is {shown_with_type(states)}, not an object of step -> "
                                  f"loader state; {DAMAGED}")
        for step, state in states.items():
            if not (step.isdigit() and len(step) < 19) or not isinstance(state, dict):
                raise CheckpointError(f"{self.data_path}: states[{shown(step)}] is {shown_with_type(state)}: not a loader state "
                                      f"of a step; {DAMAGED}")
        return record

    def save_data_state(self, step: int, state: Mapping[str, Any], keep: int) -> None:
        """Adds this host's loader state for `step` (one small object rewritten atomically), keeping the newest `keep`."""
        record = self._read_data()
        states = record["states"]
        states[str(step)] = dict(state)
        for old in sorted(states, key=int)[:-keep]:
            del states[old]
        storage.write_text(self.data_path, json.dumps(record, indent=1, sort_keys=True) + "\n")

    def load_data_state(self, step: int) -> dict[str, Any] | None:
        return self._read_data()["states"].get(str(step))


class DataStateCheckpoints:
    """Tunix's CheckpointManager with the loader state written first for every step it will save.

    Delegation, not a copy: every call goes to Tunix's manager; `save` only adds the loader
    state beforehand when the shared policy wants that step (or Tunix forces a last save).
    """

    def __init__(self, inner: Any, ckpt: CheckpointDir, stream: Any, policy: EveryNStepsAndLast, keep: int):
        """stream: the run's resume.ResumableStream (its state_after(step) is what gets saved)."""
        self._inner = inner
        self._ckpt = ckpt
        self._stream = stream
        self._policy = policy
        self._keep = keep
        self._closed = False
        self.saved_steps: list[int] = []

    def latest_step(self) -> int | None:
        return self._inner.latest_step()

    def save(self, step: int, model: Any, optimizer: Any = None, **kwargs: Any) -> bool:
        if kwargs.get("force") or self._policy.wants(step):
            if not lora_is_finite(model):
                # --nan-policy stop ends the run before this; a checkpoint of NaNs would only resume into NaNs.
                raise CheckpointError(f"step {step}: the LoRA parameters hold NaN or Inf; not saving a checkpoint of them")
            latest = self._inner.latest_step()
            if latest is None or step > latest:
                # Keep one more loader state than Orbax keeps steps: the newest save may be in flight.
                self._ckpt.save_data_state(step, self._stream.state_after(step), keep=self._keep + 1)
        saved = bool(self._inner.save(step, model, optimizer, **kwargs))
        if saved:
            self.saved_steps.append(step)
        return saved

    def maybe_restore(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.maybe_restore(*args, **kwargs)

    def close(self) -> None:
        """Waits for in-flight saves; safe to call twice (Tunix's close, then ours on the way out)."""
        if not self._closed:
            self._closed = True
            self._inner.close()


def lora_is_finite(model: Any) -> bool:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    leaves = jax.tree.leaves(nnx.state(model, nnx.LoRAParam))
    return bool(all(jnp.isfinite(x).all() for x in leaves))


def checkpoint_options(policy: EveryNStepsAndLast, keep: int) -> Any:
    import orbax.checkpoint as ocp

    # Async saves (Orbax's default) overlap the write with the next steps; Tunix's close()
    # waits for them. Only our policy decides: no initial save at step 1, no time-based saves.
    return ocp.CheckpointManagerOptions(save_decision_policy=policy, max_to_keep=keep)
