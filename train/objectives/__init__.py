"""What a `prepack train` run trains: `--objective`, one object per objective (train/objectives/base.py
says what each supplies), looked up by name here.

Setup, the memory plan, FLOPs and MFU, the metrics and `prepack report` ask the run's objective
(`of(cfg)`, or `by_name` of a record's `objective`) for what differs between objectives; adding one
is a module here and its entry in REGISTRY (train/README.md, "Objectives").
"""

from __future__ import annotations

import argparse

from train.objectives.base import Objective, ReportSection
from train.objectives.dpo import DPO
from train.objectives.sft import SFT
from train.run_config.config import TrainConfig, TrainError

__all__ = ["DEFAULT", "REGISTRY", "Objective", "ReportSection", "add_arguments", "by_name", "names", "of"]

REGISTRY: dict[str, Objective] = {o.name: o for o in (SFT, DPO)}
DEFAULT: Objective = SFT  # a run that names none


def names() -> tuple[str, ...]:
    return tuple(REGISTRY)


def by_name(name: str) -> Objective:
    if name not in REGISTRY:
        raise TrainError(f"unknown --objective {name!r}; choose one of {', '.join(REGISTRY)}")
    return REGISTRY[name]


def of(cfg: TrainConfig) -> Objective:
    """The run's objective (TrainConfig.objective None: the default), once no other objective's option is
    given (train/resolved_run.py resolves it once a run)."""
    objective = DEFAULT if cfg.objective is None else by_name(cfg.objective)
    refuse_others_options(cfg, objective)
    return objective


def refuse_others_options(cfg: TrainConfig, objective: Objective) -> None:
    """One line for an option of an objective the run did not choose: each objective declares its own
    (`options`), so a new objective's options are refused for every other without touching them."""
    for other in REGISTRY.values():
        for flag, field in other.options.items():
            if other is not objective and getattr(cfg, field) is not None:
                raise TrainError(f"{flag} is --objective {other.name}'s option, but this run's objective is "
                                 f"{objective.name}; add --objective {other.name} or drop {flag}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """`prepack train`'s --objective, then each objective's own options (--beta)."""
    p.add_argument("--objective", default=DEFAULT.name, choices=list(REGISTRY),
                   help=" ".join(f"{o.name}: {o.help}" for o in REGISTRY.values()))
    for objective in REGISTRY.values():
        objective.add_arguments(p)

