"""Helpers shared by the train tests and benchmarks: the same examples laid out packed and unpacked.

Nothing here is used by training itself, so it lives in testkit/, not in train/.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from prepack.format import rowformat


def make_examples(lengths: Sequence[int], vocab_size: int, seed: int = 0, prompt_fraction: float = 0.5) -> list[rowformat.Segment]:
    """Random examples: the first `prompt_fraction` of each is prompt (loss 0), the rest response (loss 1)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, vocab_size, size=n, dtype=np.int32)
        mask = np.zeros(n, dtype=np.int32)
        mask[int(n * prompt_fraction):] = 1
        out.append(rowformat.Segment(ids, mask))
    return out


def stack_rows(rows: Sequence[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {k: np.stack([r[k] for r in rows]) for k in rowformat.FIELD_NAMES}


def packed_batch(examples: Sequence[rowformat.Segment], plan: Sequence[Sequence[int]], max_length: int) -> dict[str, np.ndarray]:
    """Rows holding the examples listed in `plan` (a list of example indices per row)."""
    return stack_rows([rowformat.build_row([examples[i] for i in row], max_length) for row in plan])


def unpacked_batch(examples: Sequence[rowformat.Segment], max_length: int) -> dict[str, np.ndarray]:
    """One example per row, padded: what `prepack pack --no-pack` writes."""
    return stack_rows([rowformat.build_row([ex], max_length) for ex in examples])


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where example `example` sits: row `row`, columns [start, start + length)."""

    example: int
    row: int
    start: int
    length: int


def placements(plan: Sequence[Sequence[int]], examples: Sequence[rowformat.Segment]) -> list[Placement]:
    out = []
    for r, row in enumerate(plan):
        start = 0
        for i in row:
            out.append(Placement(i, r, start, len(examples[i])))
            start += len(examples[i])
    return sorted(out, key=lambda p: p.example)


class FixedLogits:
    """A stand-in model returning given logits, to compare loss functions on the same logits."""

    def __init__(self, logits: Any):
        self.logits = logits

    def __call__(self, *args: Any, **kwargs: Any) -> tuple[Any, None]:
        return self.logits, None


def plain_causal_inputs(batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Tunix's default inputs (its own helpers): causal mask over valid tokens, cumsum positions.

    For a row holding one example this is exactly that example run alone; for a packed row
    it lets every segment attend to the segments before it.
    """
    import jax.numpy as jnp
    from tunix.sft import utils

    valid = jnp.asarray(batch["valid_mask"])
    return {
        "input_tokens": jnp.asarray(batch["input_ids"]),
        "input_mask": jnp.asarray(batch["loss_mask"]),
        "positions": utils.build_positions_from_mask(valid),
        "attention_mask": utils.make_causal_attn_mask(valid),
    }


def learnable_segments(n: int, vocab_size: int, seed: int = 0) -> list[rowformat.Segment]:
    """Rows a tiny model learns in a few steps: a 3-token prompt (loss 0), then an arithmetic
    continuation of its first token (ids >= 3, so 0-2 stay free for pad and test markers)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        start, length = int(rng.integers(3, 8)), int(rng.integers(6, 15))
        ids = ((start + 3 * np.arange(length)) % (vocab_size - 3) + 3).astype(np.int32)
        mask = np.zeros(length, np.int32)
        mask[3:] = 1
        out.append(rowformat.Segment(ids, mask))
    return out
