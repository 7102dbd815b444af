"""`--objective dpo [--beta B]`: the sigmoid DPO loss of train/objectives/dpo_loss.py on a preference set (row
formats 5 and 6, `prepack pack --format preference`), with beta (default 0.1, TRL's and Tunix's).

The step runs the policy forward and backward and the reference (the same model with LoRA off)
forward, on both sides of every pair; the loss is the mean over the step's pairs, and the records
carry TRL's metrics (train/objectives/dpo_metrics.py). It refuses a set of single examples: DPO
needs each pair's two sides.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable, Mapping
from typing import Any

from prepack.format.rowformat import has_pairs
from train.objectives import dpo_metrics
from train.objectives.base import ReportSection
from train.run_config.config import TrainConfig, TrainError

# What the metrics' `loss_mean` says a DPO step's `loss` is: the mean over its pairs.
PAIR_MEAN = "pair"


class Dpo:
    name = "dpo"
    title = "DPO"
    help = ("the sigmoid DPO loss on a preference set (prepack pack --format preference): each pair's chosen against "
            "its rejected reply, against the base model with LoRA switched off as the reference; metrics under TRL's "
            "names. Each refuses the other's sets: SFT on pair rows would train the rejected replies as targets too")
    takes_pairs = True
    segments_per_example = 2  # a pair's two sides, segments 2k-1 and 2k of its row
    extra_forwards = 1  # the reference's forward, with LoRA off
    plan_note = "DPO (policy forward and backward, reference forward with LoRA off), "
    metric_names = dpo_metrics.TRL_NAMES
    report = ReportSection(
        heading="Preference optimisation (DPO)",
        note="Runs trained with `prepack train --objective dpo`: `loss` is the DPO loss (the mean over each step's "
             "pairs), a reward is beta (log pi - log ref) of a side's summed completion log-probability, the "
             "reference being the base model with LoRA switched off (TRL's names). At step 1 the policy is the "
             "reference: every reward is 0 and the loss ln 2 = 0.693. Last = the mean over the last 10% of steps.",
        verdict_metric=dpo_metrics.REWARDS_ACCURACIES, verdict_words="reward accuracy", figure="dpo_rewards.png")
    options: Mapping[str, str] = {"--beta": "beta"}

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        p.add_argument("--beta", type=float, default=None,
                       help="the DPO loss's beta, how far the policy may move from the reference (--objective dpo; "
                       "default 0.1, TRL's and Tunix's)")

    def beta(self, cfg: TrainConfig) -> float:
        return dpo_metrics.DEFAULT_BETA if cfg.beta is None else float(cfg.beta)

    def check_flags(self, cfg: TrainConfig) -> None:
        if cfg.beta is not None and not (isinstance(cfg.beta, (int, float)) and math.isfinite(cfg.beta) and cfg.beta > 0):
            raise TrainError(f"--beta must be a positive number, got {cfg.beta}")
        if cfg.loss != "masked":
            raise TrainError(f"--objective dpo computes its loss from the policy's and the reference's log-probabilities; "
                             f"--loss {cfg.loss} is SFT's (leave --loss masked)")
        if cfg.loss_mean != "token":
            raise TrainError(f"--loss-mean {cfg.loss_mean} is SFT's; --objective dpo averages its loss over the step's pairs")

    def check_set(self, cfg: TrainConfig, manifest: Any, path: str, flag: str) -> None:
        del cfg
        if not has_pairs(int(manifest.format_version)):
            raise TrainError(f"--objective dpo needs preference pairs, but {flag} {path} holds single examples (row format "
                             f"{manifest.format_version}); pack a preference set with `prepack pack --format preference`")

    def identity(self, cfg: TrainConfig) -> dict[str, Any]:
        return {"name": self.name, "beta": self.beta(cfg)}

    def static_fields(self, cfg: TrainConfig) -> dict[str, Any]:
        return {"loss_mean": PAIR_MEAN, "objective": self.name, "beta": self.beta(cfg)}

    def loss_fn(self, cfg: TrainConfig) -> Callable[..., Any]:
        from train.objectives import dpo_loss  # the same loss path as SFT's (chunked or full logits), per pair

        return dpo_loss.make_dpo_loss_fn(self.beta(cfg), cfg.loss_chunk_tokens, kernel=cfg.loss_kernel)

    def model_input_fn(self, base: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        from train.objectives import dpo_loss  # and each target's pair and side

        return dpo_loss.make_gen_model_input_fn(base)

    def step_sums(self) -> Any:
        from train.objectives import dpo_loss

        return dpo_loss.step_sums()

    def step_fields(self, aux: Mapping[str, Any]) -> dict[str, Any]:
        return dpo_metrics.record_fields(aux)  # TRL's names at the top level

    def eval_loss_terms(self, aux: Mapping[str, Any]) -> tuple[float, float]:
        return float(aux[dpo_metrics.LOSS_SUM]), float(aux[dpo_metrics.PAIRS])

    def add_eval_sums(self, sums: dict[str, float], aux: Mapping[str, Any]) -> None:
        dpo_metrics.add_sums(sums, aux)

    def eval_fields(self, sums: Mapping[str, float]) -> dict[str, Any]:
        return dpo_metrics.trl_metrics(sums) if sums else {}

    def loss_label(self, loss_mean: str) -> str:
        del loss_mean  # always the pair mean
        return " (DPO)"

    def progress(self, record: Mapping[str, Any]) -> str:
        return dpo_metrics.progress(record)


DPO = Dpo()
