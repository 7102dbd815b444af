"""Refuses shards whose token ids the model cannot embed, before any weight is loaded."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from train.run_config.config import TrainError

log = logging.getLogger(__name__)

# The vocab_hash (prepack.text.tokenizer.vocab_hash) of each family's own tokenizer, as every
# manifest records it; tests/test_train_trainer.py checks these against the embedded tokenizers.
FAMILY_VOCAB_HASH = {
    "gemma3": "956ce6ae17ebe03ad27594308e5310f6363616b8b786f47156d524e8f3e0e2f3",
    "qwen3": "2b126ad4a1742c536099a31874320a4da38b49ec91d85e3e219374d897a44566",
}


def check_vocab(tokenizer: Mapping[str, Any], model_name: str, family: str, model_vocab: int, source: str) -> None:
    """Refuses shards whose token ids can fall outside the model's embedding, or whose vocabulary
    (by vocab_hash; the name is only for the message) is another family's."""
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
    for other, other_hash in FAMILY_VOCAB_HASH.items():
        if other != family and shards_hash == other_hash:
            raise TrainError(
                f"{source}: the shards were tokenized with {name!r}, whose vocabulary (vocab_hash {other_hash[:12]}...) is "
                f"the {other} tokenizer's, but {model_name} is a {family} model: the ids would mean other tokens. "
                f"Pack with {model_name}'s tokenizer."
            )
