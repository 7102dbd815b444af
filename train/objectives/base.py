"""What every objective supplies (`Objective`): the one place setup, the memory plan, FLOPs, metrics
and the report learn what a run trains, so that none of them compares objective names or reads the
objective off a batch. Nothing here imports JAX: `prepack report` reads an objective's metric names
without it; the loss and its model inputs import JAX when they are built.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from train.run_config.config import TrainConfig


@dataclasses.dataclass(frozen=True)
class ReportSection:
    """The objective's section of `prepack report`: a heading, what its metrics mean, the run's last
    value of `verdict_metric` said in the verdict as `verdict_words`, and whether its runs log TRL's
    reward curves (apps/plots.py draws them into `figure`)."""

    heading: str
    note: str
    verdict_metric: str
    verdict_words: str
    figure: str | None = None


class Objective(Protocol):
    """One `--objective`: its loss, inputs, step sums, passes, metrics, sets and refusals."""

    name: str  # the option's value, and `objective` on every step record
    title: str  # how the report names it beside a run ("SFT")
    help: str  # its part of --objective's help
    takes_pairs: bool  # the row formats it accepts: preference pairs (5, 6) or single examples (1-4)
    segments_per_example: int  # a row's segments per example (a pair's two sides are one)
    extra_forwards: int  # forward passes the step runs beside the policy's forward and backward
    plan_note: str  # --plan-memory's description of the passes ("" when there is nothing beyond SFT's)
    metric_names: tuple[str, ...]  # its own fields of step and eval records, in the order they are logged
    report: ReportSection | None  # its section of `prepack report` (None: no section)
    # Its own options: the TrainConfig field of each, by flag (None in the field: not given). The registry
    # refuses one given to a run of another objective (train/objectives/__init__.py, `of`), so an
    # objective never names another's options.
    options: Mapping[str, str]

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        """Its own options beside --objective."""

    def check_flags(self, cfg: TrainConfig) -> None:
        """Refuses (TrainError, one line) the options it cannot train with."""

    def check_set(self, cfg: TrainConfig, manifest: Any, path: str, flag: str) -> None:
        """Refuses (TrainError, one line) a shard set whose rows it cannot train on."""

    def identity(self, cfg: TrainConfig) -> dict[str, Any]:
        """run.json's record of it: a checkpoint resumes only under the same one."""

    def static_fields(self, cfg: TrainConfig) -> dict[str, Any]:
        """What every step record says of it: `loss_mean` (which mean `loss` is), `objective`, its options."""

    def loss_fn(self, cfg: TrainConfig) -> Callable[..., Any]:
        """The has_aux Tunix loss the options choose (imports JAX)."""

    def model_input_fn(self, base: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        """The loss's model inputs: `base` (the attention kind's, train/step/model_inputs.py) plus what it needs."""

    def step_sums(self) -> Any:
        """What a step of K micro-batches divides (train_step.StepSums); None: SFT's by --loss-mean."""

    def step_fields(self, aux: Mapping[str, Any]) -> dict[str, Any]:
        """Its own fields of a step record, from the loss's (host) aux."""

    def eval_loss_terms(self, aux: Mapping[str, Any]) -> tuple[float, float]:
        """(numerator, denominator) of one eval batch's loss: summed over batches, their ratio is the eval loss."""

    def add_eval_sums(self, sums: dict[str, float], aux: Mapping[str, Any]) -> None:
        """Accumulates one eval batch's sums of its own metrics."""

    def eval_fields(self, sums: Mapping[str, float]) -> dict[str, Any]:
        """Its own fields of an eval record, from the eval batches' sums."""

    def loss_label(self, loss_mean: str) -> str:
        """What the console line says `loss` is, after its value ("" for the token mean)."""

    def progress(self, record: Mapping[str, Any]) -> str:
        """Its part of the console line of a step."""
