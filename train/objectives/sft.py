"""`--objective sft` (the default): the masked token (or example) mean of train/step/loss.py on a set of
single examples (row formats 1-4), chunked or on full logits as the memory-path options choose.

It refuses a preference set, before any weights load: SFT on pair rows would train each pair's
rejected reply as a target just like the chosen one (teaching the model the answers the data marks
as worse). To fine-tune on the chosen replies alone, pack them as a chat set.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from prepack.format.rowformat import has_pairs
from train.objectives.base import ReportSection
from train.run_config.config import TrainConfig, TrainError


class Sft:
    name = "sft"
    title = "SFT"
    help = "the masked loss on a set of single examples."
    takes_pairs = False
    segments_per_example = 1
    extra_forwards = 0
    plan_note = ""
    metric_names: tuple[str, ...] = ()
    report: ReportSection | None = None
    options: Mapping[str, str] = {}  # none of its own: --loss and --loss-mean are the loss path's

    def add_arguments(self, p: argparse.ArgumentParser) -> None:
        del p  # no options of its own: --loss and --loss-mean are the loss path's

    def check_flags(self, cfg: TrainConfig) -> None:
        del cfg  # nothing of its own to refuse; another objective's options are the registry's to refuse

    def check_set(self, cfg: TrainConfig, manifest: Any, path: str, flag: str) -> None:
        del cfg
        if has_pairs(int(manifest.format_version)):
            raise TrainError(f"{flag} {path} holds preference pairs (row format {manifest.format_version}): train it with "
                             f"--objective dpo; SFT on it would train each pair's rejected reply as a target too "
                             f"(to fine-tune on the chosen replies, pack them as a chat set)")

    def identity(self, cfg: TrainConfig) -> dict[str, Any]:
        del cfg
        return {"name": self.name}

    def static_fields(self, cfg: TrainConfig) -> dict[str, Any]:
        return {"loss_mean": cfg.loss_mean, "objective": self.name}

    def loss_fn(self, cfg: TrainConfig) -> Callable[..., Any]:
        from train.step import memory_path

        return memory_path.choose_sft_loss(cfg)

    def model_input_fn(self, base: Callable[[Mapping[str, Any]], dict[str, Any]]) -> Callable[[Mapping[str, Any]], dict[str, Any]]:
        return base

    def step_sums(self) -> None:
        return None  # train_step's own: the token or example mean of --loss-mean

    def step_fields(self, aux: Mapping[str, Any]) -> dict[str, Any]:
        del aux
        return {}

    def eval_loss_terms(self, aux: Mapping[str, Any]) -> tuple[float, float]:
        if "examples" in aux:  # --loss-mean example
            return float(aux["example_nll_sum"]), float(aux["examples"])
        return float(aux["nll_sum"]), float(aux["target_tokens"])

    def add_eval_sums(self, sums: dict[str, float], aux: Mapping[str, Any]) -> None:
        del sums, aux  # its eval record is the loss alone

    def eval_fields(self, sums: Mapping[str, float]) -> dict[str, Any]:
        del sums
        return {}

    def loss_label(self, loss_mean: str) -> str:
        return " (example mean)" if loss_mean == "example" else ""

    def progress(self, record: Mapping[str, Any]) -> str:
        del record
        return ""


SFT = Sft()
