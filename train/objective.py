"""`prepack train --objective sft|dpo [--beta B]`: what a run trains, and which shard sets each objective takes.

- sft (the default): the masked token (or example) mean of train/loss.py on any set of single
  examples (row formats 1-4).
- dpo: the sigmoid DPO loss of train/dpo_loss.py on a preference set (row formats 5 and 6,
  `prepack pack --format preference`), with beta (default 0.1, TRL's and Tunix's).

Each objective refuses the other's sets, before any weights load, because neither reading is
what a user wants: DPO needs each pair's two sides, and an SFT run on pair rows would train the
rejected replies as targets just like the chosen ones (teaching the model the answers the data
marks as worse). To fine-tune on the chosen replies alone, pack them as a chat set.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from prepack.format.rowformat import has_pairs
from train.config import TrainConfig, TrainError

SFT, DPO = "sft", "dpo"
OBJECTIVES = (SFT, DPO)
DEFAULT_BETA = 0.1  # TRL's and Tunix's DPO default
# What the metrics' `loss_mean` says a DPO step's `loss` is: the mean over its pairs.
PAIR_MEAN = "pair"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`prepack train`'s --objective and --beta."""
    p.add_argument("--objective", default=SFT, choices=list(OBJECTIVES),
                   help="sft: the masked loss on a set of single examples. dpo: the sigmoid DPO loss on a preference "
                   "set (prepack pack --format preference): each pair's chosen against its rejected reply, against "
                   "the base model with LoRA switched off as the reference; metrics under TRL's names. Each refuses "
                   "the other's sets: SFT on pair rows would train the rejected replies as targets too")
    p.add_argument("--beta", type=float, default=None,
                   help="the DPO loss's beta, how far the policy may move from the reference (--objective dpo; "
                   "default 0.1, TRL's and Tunix's)")


def beta_of(cfg: TrainConfig) -> float:
    return DEFAULT_BETA if cfg.beta is None else float(cfg.beta)


def check_flags(cfg: TrainConfig) -> None:
    """The objective's flags, on their own."""
    if cfg.objective not in OBJECTIVES:
        raise TrainError(f"unknown --objective {cfg.objective!r}; choose one of {', '.join(OBJECTIVES)}")
    if cfg.objective != DPO:
        if cfg.beta is not None:
            raise TrainError("--beta is the DPO loss's; it needs --objective dpo")
        return
    if cfg.beta is not None and not (isinstance(cfg.beta, (int, float)) and math.isfinite(cfg.beta) and cfg.beta > 0):
        raise TrainError(f"--beta must be a positive number, got {cfg.beta}")
    if cfg.loss != "masked":
        raise TrainError(f"--objective dpo computes its loss from the policy's and the reference's log-probabilities; "
                         f"--loss {cfg.loss} is SFT's (leave --loss masked)")
    if cfg.loss_mean != "token":
        raise TrainError(f"--loss-mean {cfg.loss_mean} is SFT's; --objective dpo averages its loss over the step's pairs")


def check_set(cfg: TrainConfig, manifest: Any, path: str, flag: str = "--shards") -> None:
    """A shard set the objective can train on: pairs for dpo, single examples for sft."""
    pairs = has_pairs(int(manifest.format_version))
    if cfg.objective == DPO and not pairs:
        raise TrainError(f"--objective dpo needs preference pairs, but {flag} {path} holds single examples (row format "
                         f"{manifest.format_version}); pack a preference set with `prepack pack --format preference`")
    if cfg.objective != DPO and pairs:
        raise TrainError(f"{flag} {path} holds preference pairs (row format {manifest.format_version}): train it with "
                         f"--objective dpo; SFT on it would train each pair's rejected reply as a target too "
                         f"(to fine-tune on the chosen replies, pack them as a chat set)")


def identity(cfg: TrainConfig) -> dict[str, Any]:
    """run.json's record of the objective: a checkpoint resumes only under the same one."""
    return {"name": DPO, "beta": beta_of(cfg)} if cfg.objective == DPO else {"name": SFT}
