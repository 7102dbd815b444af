"""Tunix's PeftTrainer with our train step, host-side batch checks, and metrics fetched without stalling the device.

What goes through Tunix's public extension points: the loss and model inputs
(`with_loss_fn`, `with_gen_model_input_fn`), the train step (`create_train_step_fn`: K
micro-batches with an exact loss, clipping and the schedule's learning rate,
train/step/train_step.py), eval timing (`with_training_hooks`), checkpointing and the profiler
(`TrainingConfig`). Three documented override points have no public equivalent:
`_prepare_inputs` (each batch checked and counted on the host before it is sharded),
`_post_process_train_step` and `_post_process_eval_step` (where a step's aux arrives). And
`jit_train_and_eval_step` is Tunix's own with one argument changed: the model is donated to the
train step as well as the optimizer, so the frozen weights are not copied every step
(train/step/train_step.py `DONATED`).
train/tunix_contract.py pins what this relies on and refuses a Tunix that differs.

No host sync per step: `_post_process_train_step` hands the step's device results to the
recorder without waiting (Tunix 0.1.7 keeps up to two steps in flight and reads the previous
step's loss for its own logger); the recorder fetches them every --log-every steps, and
before a checkpoint save, an eval and a profile's end, so that a non-finite step under
--nan-policy stop is caught before anything of it is saved.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from train.checkpointing import resume
from train.measurement import divergence
from train.measurement.metrics import MetricsRecorder
from train.run_config.config import TrainError


def refuse_placeholder(input_data: Any) -> None:
    if input_data is resume.PLACEHOLDER:
        # Tunix discards these itself after a restore (resume.ResumableStream); one
        # reaching the step means its skip logic changed, and the data would be misaligned.
        raise TrainError(
            "Tunix handed a skipped-batch placeholder to the train step: its post-restore skip no longer "
            "matches train/checkpointing/resume.py's ResumableStream; refusing to train on misaligned data"
        )


def check_token_ids(input_data: Any, vocab_size: int) -> None:
    ids = input_data["input_ids"]
    low, top = int(np.min(ids)), int(np.max(ids))
    if top >= vocab_size or low < 0:
        # An out-of-range id would not fail on the device: the embedding gather returns NaN/clamped rows.
        bad = low if low < 0 else top  # the offending id itself (-5 was reported as its int32 wrap-around)
        raise TrainError(
            f"a batch holds token id {bad}, outside the model's {vocab_size:,}-row embedding (ids 0 to {vocab_size - 1:,}); "
            "the shards do not match the model's tokenizer"
        )


def eval_timing_hooks(hooks: Any) -> type:
    """Tunix TrainingHooks that time each eval (its first batch's preparation starts the clock) and record it."""

    class EvalTiming(hooks.TrainingHooks):
        """Times each eval (its first batch's preparation starts the clock) and records it."""

        def __init__(self, trainer: Any):
            self.trainer = trainer

        def on_train_start(self, train_ctx: Any) -> None:
            pass

        def on_train_end(self, train_ctx: Any) -> None:
            pass

        def on_train_step_start(self, train_ctx: Any) -> None:
            pass

        def on_train_step_end(self, train_ctx: Any, train_step: int, train_loss: float) -> None:
            pass

        def on_eval_step_start(self, train_ctx: Any) -> None:
            pass

        def on_eval_step_end(self, train_ctx: Any, eval_loss: float) -> None:
            started = self.trainer.eval_started
            self.trainer.eval_started = None
            self.trainer.recorder.eval_done(time.perf_counter() - (started if started is not None else time.perf_counter()))
            self.trainer.recorder.reset_clock()  # eval time is not the next step's

    return EvalTiming


def compile_notice(recorder: MetricsRecorder) -> str:
    """Step 1 compiles the step (minutes for a real model), unless --remat auto's plan did: said before the silence."""
    if recorder.compiled_before_s:
        return "the train step is compiled (--remat auto's plan); step 1 runs it"
    return "compiling the train step (runs as step 1) ..."


class LastFiniteAdapter:
    """(step, a copy of the LoRA values after it) at the last fetch that found every step finite:
    what --save-lora saves when --nan-policy stop ends the run (the model's own values are by then
    the diverged step's). LoRA is small: the copy is a few MB on the device."""

    model: Any
    last_finite: tuple[int, Any] | None = None
    keep_last_finite: bool = False

    def _keep(self, step: int) -> None:
        """Every dispatched step is fetched and finite: the model's LoRA values are step `step`'s."""
        import jax
        import jax.numpy as jnp
        from flax import nnx

        if self.last_finite is None or self.last_finite[0] != step:
            self.last_finite = (step, jax.tree.map(jnp.copy, nnx.state(self.model, nnx.LoRAParam)))


class ModelDonatingJit:
    """Tunix 0.1.7's `jit_train_and_eval_step` (its source pinned by train/tunix_contract.py) with one
    argument changed: the model is donated to the train step as well as the optimizer."""

    _jitted_train_step_fn: Any
    _jitted_eval_step_fn: Any
    model: Any
    optimizer: Any

    def jit_train_and_eval_step(self, skip_jit: bool = False, cache_nnx_graph: bool = False) -> Any:
        """The jitted train and eval steps, made once (train/step/train_step.py DONATED: why the model)."""
        if skip_jit or self._jitted_train_step_fn is not None:
            return super().jit_train_and_eval_step(skip_jit, cache_nnx_graph)  # type: ignore[misc]
        import functools

        from flax import nnx
        from jax.interpreters import pxla

        from train.step.train_step import DONATED

        self._shard_optimizer(pxla.thread_resources.env.physical_mesh)
        train = nnx.jit(self.create_train_step_fn(), donate_argnames=DONATED)
        evaluate = nnx.jit(self.create_eval_step_fn())

        def bind(jitted: Any, *args: Any) -> Any:  # Tunix's maybe_cache_and_partial
            return functools.partial(nnx.cached_partial(jitted, *args)) if cache_nnx_graph else functools.partial(jitted, *args)

        self._jitted_train_step_fn = bind(train, self.model, self.optimizer)
        self._jitted_eval_step_fn = bind(evaluate, self.model)
        return self._jitted_train_step_fn, self._jitted_eval_step_fn


class RecorderLogging:
    """What Tunix would log, left to the MetricsRecorder."""

    recorder: MetricsRecorder

    def _try_get_learning_rate(self) -> None:
        return None  # Tunix's logger would wait for the step to read it (train/tunix_contract.py)

    def _post_process_eval_step(self, aux: Any) -> None:
        import jax

        self.recorder.eval_batch_done(jax.device_get(aux))


def make_trainer_class() -> type:
    """PeftTrainer with our step and metrics; built lazily so importing this module stays light."""
    from tunix.sft import hooks
    from tunix.sft import metrics_logger as tunix_metrics
    from tunix.sft import peft_trainer

    from train import tunix_contract
    from train.step import train_step
    from train.step.model_inputs import device_fields

    tunix_contract.check()

    EvalTiming = eval_timing_hooks(hooks)

    class PackedPeftTrainer(ModelDonatingJit, LastFiniteAdapter, RecorderLogging, peft_trainer.PeftTrainer):
        """Tunix's loop, with train/step/train_step.py's step and the recorder fed at dispatch."""

        recorder: MetricsRecorder
        vocab_size: int
        eval_started: float | None = None
        step_options: dict[str, Any]
        # Steps (1-based) whose results must be fetched before Tunix goes on: checkpoint saves,
        # evals, a profile's last step, the last step (set by train/run_setup.py).
        fetch_before: Callable[[int], bool] = staticmethod(lambda step: False)
        def configure(self, *, loss_fn: Any, gen_model_input_fn: Any, recorder: MetricsRecorder, vocab_size: int,
                      loss_mean: str, grad_accum_steps: int, max_grad_norm: float,
                      fetch_before: Callable[[int], bool], sums: Any = None,
                      keep_last_finite: bool = False) -> "PackedPeftTrainer":
            """sums: what the step's loss divides (train_step.StepSums; None: SFT's by loss_mean);
            keep_last_finite: copy the LoRA values at each fetch that finds the steps finite."""
            self.recorder, self.vocab_size, self.fetch_before = recorder, vocab_size, fetch_before
            self.keep_last_finite = keep_last_finite
            self.step_options = dict(loss_mean=loss_mean, accumulate=grad_accum_steps > 1, max_grad_norm=max_grad_norm, sums=sums)
            self.with_gen_model_input_fn(gen_model_input_fn).with_loss_fn(loss_fn, has_aux=True)
            self.with_training_hooks(EvalTiming(self))
            return self

        def create_train_step_fn(self) -> Any:
            return train_step.make_train_step(self.loss_fn, self.gen_model_input_fn, **self.step_options)

        def _prepare_inputs(self, input_data: Any) -> Any:
            refuse_placeholder(input_data)
            check_token_ids(input_data, self.vocab_size)  # on the host, before Tunix shards it
            if self._mode == tunix_metrics.Mode.TRAIN:
                self.recorder.batch_arrived(input_data)
            elif self.eval_started is None:
                self.eval_started = time.perf_counter()
            return device_fields(input_data)

        def _post_process_train_step(self, aux: Any) -> None:
            step = self.recorder.next_step()
            self.recorder.step_dispatched(aux)  # device arrays: nothing waits here
            if self.recorder.wants_fetch(step) or self.fetch_before(step):
                self.fetch()

        def fetch(self) -> None:
            """The dispatched steps' records; under --nan-policy stop, a non-finite one ends the run
            here, before Tunix's save of this step (it follows this call in its loop)."""
            stopped = self.recorder.fetch()
            if stopped is not None:
                raise divergence.Diverged(stopped["step"], stopped["nonfinite"])
            if self.keep_last_finite and self.recorder.steps:
                self._keep(int(self.recorder.steps[-1]["step"]))

        def train(self, train_ds: Any, eval_ds: Any = None, *args: Any, **kwargs: Any) -> None:
            from jax.interpreters import pxla

            # What Tunix will shard batches over: empty unless a mesh is active through `with mesh:`.
            mesh = pxla.thread_resources.env.physical_mesh
            self.recorder.static_extra["active_mesh"] = None if mesh.empty else dict(mesh.shape)
            print(compile_notice(self.recorder), file=self.recorder.out, flush=True)
            self.recorder.reset_clock()
            super().train(train_ds, eval_ds, *args, **kwargs)
            self.fetch()  # steps the loop ran after the last fetch (a stream that ended early)

    return PackedPeftTrainer
