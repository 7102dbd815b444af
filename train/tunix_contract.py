"""What `prepack train` relies on inside Tunix's PeftTrainer, pinned, and checked before a run starts.

The trainer (train/packed_trainer.py) goes through Tunix's public extension points where they
suffice: `with_loss_fn`, `with_gen_model_input_fn`, `with_training_hooks` (eval timing),
`create_train_step_fn` (our step: accumulation, clipping, the schedule's rate), the `TrainingConfig`
(checkpointing, profiler), and `train`. Three methods have no public equivalent and are
overridden where Tunix 0.1.7 documents them as override points ("Override this function ..."):
`_prepare_inputs` (host-side checks and counts of each batch before it is sharded),
`_post_process_train_step` and `_post_process_eval_step` (the only places a step's aux arrives).
One is overridden to change a single argument: `jit_train_and_eval_step`, whose 0.1.7 logic the
override repeats with the model donated to the train step as well as the optimizer
(train/step/train_step.py `DONATED`); its source stays pinned below, so a Tunix that jits or
caches the step differently is refused rather than silently bypassed, and `_shard_optimizer`,
which the override calls, is pinned by its signature.

What cannot move, because the trainer's correctness depends on it:
- the calling convention of the train step: Tunix jits `create_train_step_fn()` and calls it as
  `step(model, optimizer, inputs)` with one batch per optimizer step. Tunix's main has already
  changed it (`_train_step(model, optimizer, grad_accumulator, inputs, is_update_step)`), so the
  witness is `_train_step`'s signature;
- the loop of `train` (its post-restore skip by reading `iter_steps` elements, which
  train/checkpointing/resume.py answers with placeholders; the save after each step, which
  train/checkpointing/checkpoints.py wraps; when `_post_process_train_step` runs), `jit_train_and_eval_step`,
  `_run_eval`, `close` and `_save_last_checkpoint`, and the constructor's restore: their source,
  hashed as in 0.1.7.

`check()` compares the installed Tunix with these pins and refuses to build a trainer on one
that differs, naming each difference in one line. setup.py pins google-tunix==0.1.7; the check
is what tells a user who installed another version what went wrong, before any weight loads.
"""

from __future__ import annotations

import hashlib
import inspect
from typing import Any

from train.run_config.config import TrainError

TUNIX_VERSION = "0.1.7"
# sha256[:16] of inspect.getsource(PeftTrainer.<method>) in google-tunix 0.1.7.
SOURCE_SHA256: dict[str, str] = {
    "__init__": "37c32b59f1890c85",
    "train": "ca7a8d4e7f78d95c",
    "jit_train_and_eval_step": "5208cb2237d70b86",
    "_run_eval": "361ec4afc4a711e7",
    "close": "73fdfdf8a3737d4b",
    "_save_last_checkpoint": "5aa1d03c241d6090",
}
# The override points and the calling-convention witness: their parameters in 0.1.7.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "_prepare_inputs": ("self", "input_data"),
    "_post_process_train_step": ("self", "aux"),
    "_post_process_eval_step": ("self", "aux"),
    "create_train_step_fn": ("self",),
    "_train_step": ("self", "model", "optimizer", "inputs"),
    "_shard_optimizer": ("self", "mesh"),
}
WHY: dict[str, str] = {
    "__init__": "its checkpoint restore and step counters",
    "train": "its loop: the post-restore skip, the per-step save, when the aux is handed over",
    "jit_train_and_eval_step": "how it jits and calls the train step (the trainer repeats it, donating the model too)",
    "_run_eval": "its eval loop",
    "close": "what it saves and closes at the end",
    "_save_last_checkpoint": "the final save",
    "_train_step": "the train step's calling convention (model, optimizer, inputs)",
    "_shard_optimizer": "what the trainer's jit_train_and_eval_step calls before it jits the step",
}


def source_hash(fn: Any) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]


def differences(trainer_cls: Any = None, version: str | None = None) -> list[str]:
    """What differs from the pinned Tunix, one phrase each; [] when nothing does."""
    if trainer_cls is None:
        from tunix.sft import peft_trainer

        trainer_cls = peft_trainer.PeftTrainer
    if version is None:
        from importlib import metadata

        version = metadata.version("google-tunix")
    out = []
    for name, expected in SIGNATURES.items():
        fn = getattr(trainer_cls, name, None)
        params = tuple(inspect.signature(fn).parameters) if fn is not None else None
        if params != expected:
            out.append(f"PeftTrainer.{name}{'(' + ', '.join(params) + ')' if params is not None else ' is missing'} "
                       f"(0.1.7: ({', '.join(expected)}); {WHY.get(name, 'an override point')})")
    for name, expected in SOURCE_SHA256.items():
        fn = getattr(trainer_cls, name, None)
        if fn is None or source_hash(fn) != expected:
            out.append(f"PeftTrainer.{name} changed ({WHY[name]})")
    if out and version != TUNIX_VERSION:
        out.insert(0, f"google-tunix {version} is installed, not {TUNIX_VERSION}")
    return out


def check(trainer_cls: Any = None, version: str | None = None) -> None:
    """Raises TrainError (one line) when the installed Tunix is not the one the trainer is built against."""
    found = differences(trainer_cls, version)
    if found:
        raise TrainError(
            f"prepack train is built against google-tunix {TUNIX_VERSION}'s PeftTrainer internals, and the installed "
            f"Tunix differs: {'; '.join(found)}. Install google-tunix=={TUNIX_VERSION} (pip install -e \".[train]\")"
        )
