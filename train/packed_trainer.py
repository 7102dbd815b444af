"""Tunix's PeftTrainer with per-step metrics, token-id checks and synchronized step timing.

Everything is added through PeftTrainer's own override points (_prepare_inputs,
_post_process_train_step, _post_process_eval_step, _run_eval, train); Tunix's loop,
jitted step and checkpointing are unchanged.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import numpy as np

from train import resume
from train.config import TrainError
from train.metrics import MetricsRecorder


def make_trainer_class() -> type:
    """PeftTrainer with per-step metrics; built lazily so importing this module stays light."""
    from tunix.sft import metrics_logger as tunix_metrics
    from tunix.sft import peft_trainer

    from train.model_inputs import device_fields

    class PackedPeftTrainer(peft_trainer.PeftTrainer):
        """Adds host-side batch counts and synchronized step timing through Tunix's override points."""

        recorder: MetricsRecorder

        vocab_size: int

        def _prepare_inputs(self, input_data: Any) -> Any:
            if input_data is resume.PLACEHOLDER:
                # Tunix discards these itself after a restore (resume.ResumableStream); one
                # reaching the step means its skip logic changed, and the data would be misaligned.
                raise TrainError(
                    "Tunix handed a skipped-batch placeholder to the train step: its post-restore skip no longer "
                    "matches train/resume.py's ResumableStream; refusing to train on misaligned data"
                )
            # Runs on the host, before Tunix shards the batch: count here, send only what the device needs.
            top = int(np.max(input_data["input_ids"]))
            if top >= self.vocab_size or int(np.min(input_data["input_ids"])) < 0:
                # An out-of-range id would not fail on the device: the embedding gather returns NaN/clamped rows.
                raise TrainError(
                    f"a batch holds token id {top}, outside the model's {self.vocab_size:,}-row embedding; "
                    "the shards do not match the model's tokenizer"
                )
            if self._mode == tunix_metrics.Mode.TRAIN:
                self.recorder.batch_arrived(input_data)
            return device_fields(input_data)

        def _post_process_train_step(self, aux: Any) -> None:
            import jax

            # Waiting here makes step_time_s the real step time (Tunix otherwise keeps 2 steps in flight).
            aux = jax.device_get(jax.block_until_ready(aux))
            self.recorder.step_done(aux)

        def _post_process_eval_step(self, aux: Any) -> None:
            import jax

            self.recorder.eval_batch_done(jax.device_get(aux))

        def _run_eval(self, eval_ds: Iterable[Any], eval_step_fn: Any) -> None:
            start = time.perf_counter()
            super()._run_eval(eval_ds, eval_step_fn)
            self.recorder.eval_done(time.perf_counter() - start)
            self.recorder.reset_clock()  # eval time is not the next step's

        def train(self, train_ds: Iterable[Any], eval_ds: Iterable[Any] | None = None, *args: Any, **kwargs: Any) -> None:
            from jax.interpreters import pxla

            # What Tunix will shard batches over: empty unless a mesh is active through `with mesh:`.
            mesh = pxla.thread_resources.env.physical_mesh
            self.recorder.static_extra["active_mesh"] = None if mesh.empty else dict(mesh.shape)
            self.recorder.reset_clock()
            super().train(train_ds, eval_ds, *args, **kwargs)

    return PackedPeftTrainer
