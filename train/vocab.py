"""Refuses shards whose token ids the model cannot embed, before any weight is loaded."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from train.config import TrainError

log = logging.getLogger(__name__)


def check_vocab(tokenizer: Mapping[str, Any], model_name: str, family: str, model_vocab: int, source: str) -> None:
    """Refuses shards whose token ids can fall outside the model's embedding."""
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
    other = {"gemma3": "qwen", "qwen3": "gemma"}[family]
    if other in name.lower():
        raise TrainError(
            f"{source}: the shards were tokenized with {name!r}, a {other} tokenizer, but {model_name} is a "
            f"{family} model: the ids would mean other tokens. Pack with {model_name}'s tokenizer."
        )
