"""Refuses shards whose token ids the model cannot embed, before any weight is loaded."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from train import families
from train.families import Family
from train.run_config.config import TrainError

log = logging.getLogger(__name__)


def check_vocab(tokenizer: Mapping[str, Any], model_name: str, family: Family, model_vocab: int, source: str) -> None:
    """Refuses shards whose token ids can fall outside the model's embedding, or, for a family with a
    tokenizer of its own (`Family.vocab_hash`), whose vocabulary (by vocab_hash; the name is only for
    the message) is another family's. A family without one (Llama3 here) takes any set its embedding fits."""
    vocab = tokenizer.get("vocab_size")
    name = str(tokenizer.get("name") or "?")
    if vocab is None:
        log.warning("%s: manifest has no tokenizer vocab_size; cannot check it against %s", source, model_name)
        return
    if int(vocab) > model_vocab:
        raise TrainError(
            f"{source}: the shards were tokenized with {name!r} (vocab_size {vocab:,}), but {model_name} has "
            f"{model_vocab:,} embedding rows, so ids >= {model_vocab:,} would index past it. Pack with "
            f"{model_name}'s tokenizer, or train a model whose vocabulary covers {name!r}."
        )
    shards_hash = tokenizer.get("vocab_hash")
    if family.vocab_hash is None:
        return
    for other in families.FAMILIES:
        if other is not family and other.vocab_hash is not None and shards_hash == other.vocab_hash:
            raise TrainError(
                f"{source}: the shards were tokenized with {name!r}, whose vocabulary (vocab_hash {other.vocab_hash[:12]}...) "
                f"is the {other.name} tokenizer's, but {model_name} is a {family.name} model: the ids would mean other "
                f"tokens. Pack with {model_name}'s tokenizer."
            )
