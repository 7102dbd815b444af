"""The DPO step's metrics under TRL's names, from the sums the loss returns (train/objectives/dpo_loss.py), and
the loss's default beta.

TRL's DPOTrainer logs, per step, the means over the step's pairs of:
`rewards/chosen` = beta (log pi(chosen) - log ref(chosen)), `rewards/rejected` likewise,
`rewards/accuracies` = the share of pairs whose chosen reward beats the rejected one,
`rewards/margins` = chosen - rejected reward, `logps/chosen` and `logps/rejected` = the policy's
summed completion log-probabilities; `loss` is the DPO loss. Tunix 0.1.7's DPOTrainer logs
other names (`rewards/margin`, `rewards/accuracy`, `log_probs/...`); these are TRL's, which
users' dashboards know. The loss hands over sums and the pair count (never means), so the
step's K micro-batches and an eval's batches combine exactly before the division here.
Nothing here imports JAX: the recorder and `prepack report` read these names, and the loss
(train/objectives/dpo_loss.py) and the objective (train/objectives/dpo.py) share the default beta from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

DEFAULT_BETA = 0.1  # TRL's and Tunix's DPO default

# The sums in a DPO loss's aux (device side), over the batch's pairs.
PAIRS = "pairs"
LOSS_SUM = "dpo_loss_sum"
CHOSEN_REWARDS_SUM = "chosen_rewards_sum"
REJECTED_REWARDS_SUM = "rejected_rewards_sum"
ACCURACY_SUM = "accuracies_sum"
CHOSEN_LOGPS_SUM = "chosen_logps_sum"
REJECTED_LOGPS_SUM = "rejected_logps_sum"
SUMS = (PAIRS, LOSS_SUM, CHOSEN_REWARDS_SUM, REJECTED_REWARDS_SUM, ACCURACY_SUM, CHOSEN_LOGPS_SUM, REJECTED_LOGPS_SUM)

# TRL's names, in the order TRL logs them.
REWARDS_CHOSEN = "rewards/chosen"
REWARDS_REJECTED = "rewards/rejected"
REWARDS_ACCURACIES = "rewards/accuracies"
REWARDS_MARGINS = "rewards/margins"
LOGPS_CHOSEN = "logps/chosen"
LOGPS_REJECTED = "logps/rejected"
TRL_NAMES = (REWARDS_CHOSEN, REWARDS_REJECTED, REWARDS_ACCURACIES, REWARDS_MARGINS, LOGPS_CHOSEN, LOGPS_REJECTED)


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def trl_metrics(sums: Mapping[str, Any]) -> dict[str, float | None]:
    """TRL's per-step means from the summed aux (host values); null where not finite or no pair."""
    pairs = float(sums[PAIRS])
    if pairs <= 0:
        return {name: None for name in TRL_NAMES}
    chosen, rejected = float(sums[CHOSEN_REWARDS_SUM]) / pairs, float(sums[REJECTED_REWARDS_SUM]) / pairs
    return {
        REWARDS_CHOSEN: _finite(chosen),
        REWARDS_REJECTED: _finite(rejected),
        REWARDS_ACCURACIES: _finite(float(sums[ACCURACY_SUM]) / pairs),
        REWARDS_MARGINS: _finite(chosen - rejected),
        LOGPS_CHOSEN: _finite(float(sums[CHOSEN_LOGPS_SUM]) / pairs),
        LOGPS_REJECTED: _finite(float(sums[REJECTED_LOGPS_SUM]) / pairs),
    }


def record_fields(aux: Mapping[str, Any]) -> dict[str, Any]:
    """A DPO step record's own fields: TRL's metrics and the pairs the loss counted on the device."""
    return {**trl_metrics(aux), "device_pairs": int(round(float(aux[PAIRS])))}


def add_sums(acc: dict[str, float], aux: Mapping[str, Any]) -> None:
    """Accumulates one eval batch's sums."""
    for key in SUMS:
        acc[key] = acc.get(key, 0.0) + float(aux[key])


def progress(record: Mapping[str, Any]) -> str:
    """The console line's DPO part."""
    acc, margin = record.get(REWARDS_ACCURACIES), record.get(REWARDS_MARGINS)
    return (f"  accuracy {acc:.2f}" if acc is not None else "") + (f"  margin {margin:+.4f}" if margin is not None else "")
