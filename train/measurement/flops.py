"""The FLOPs of a LoRA train step, counted from the model's shapes and the rows' segments.

XLA's cost analysis counts a loop's body once, and the layer scan (--remat layer), the loss
chunks and blocked attention's tiles are loops; a Pallas kernel counts as nothing. So the
count is made here, analytically, and `--plan-memory` and the metrics' MFU both use it.

Matrix products only, 2 FLOPs per multiply-add (the MFU convention); norms, softmax, masks,
RoPE and the optimizer's update are elementwise and left out (a few percent: on a loop-free
reference step XLA's own count is within 10% of this one, tests/test_train_flops.py).

Per token (every position of the [B, L] batch, padding included: the model computes them):
- decoder layers: every frozen weight element of a layer's projections is one multiply-add
  per token forward, and one backward (the gradient to the layer's input; no weight gradient:
  the base is frozen under LoRA);
- LoRA: each adapter element is one multiply-add forward, two backward (the input gradient
  and the adapter's own gradient);
- the output projection (D x V): forward and the hidden states' gradient; with
  --loss-chunk-tokens the positions are put targets first and only the chunks that hold a
  target are projected, each once forward and once for the hidden states' gradient, both in
  the forward pass (train/step/chunked_loss.py): ceil(targets / N) x N positions, twice.
Per attention score (a query-key pair of one query head): q k and p v forward (4 x head_dim),
and a backward that depends on the kind as implemented:
- dense (Tunix's einsums, probabilities kept): 8 x head_dim;
- flash and splash (a dq kernel and a dk/dv kernel, each recomputing the scores): 14 x head_dim;
- blocked (each query tile checkpointed: its forward runs again, then each checkpointed tile step
  recomputes its scores): 4 + 2 + 8 = 14 x head_dim.
The pairs are the ones each kind computes: dense L x L per row and head, splash the blocks its
static causal (or local) mask leaves, blocked and flash the tiles from each query tile's lowest
segment (key_tile_ranges) on the rows' real segment ids.
--remat layer recomputes each layer's forward (projections, LoRA and attention) once more.
--objective dpo adds the reference pass (train/objectives/dpo_loss.py): the same rows forward once more
with LoRA off, no backward (projections, LoRA's zero adapters, attention, and the output
projection of the chunks with targets, once).

Model FLOPs (what MFU divides by the step time): the same forward and backward without any
recomputation, over the batch's real tokens only, with attention at its token-level ideal
(same-segment causal pairs, within the window on local layers): the work the step must do
whatever the kernels, so wasted work never raises MFU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from train import families

# Attention FLOPs per (query, key) pair per query head, in units of head_dim: (forward, backward).
# Counted in each kind's traced step (the matrix products of its jaxpr, loops by their trips):
# tests/test_train_flops.py.
ATTENTION_PASSES = {"dense": (4, 8), "flash": (4, 14), "splash": (4, 14), "blocked": (4, 14)}


@dataclasses.dataclass(frozen=True)
class ModelCost:
    """What a token and an attention pair cost in one model (from its built, LoRA-applied shapes)."""

    layer_weights: int  # frozen projection weight elements of all decoder layers
    lora_weights: int  # LoRA A and B elements
    head_weights: int  # the output projection's D x V
    heads: int
    head_dim: int
    windows: tuple[int | None, ...]  # per decoder layer: None (global) or the sliding window


def model_cost(model: Any) -> ModelCost:
    """Reads the shapes of a built model (a Tunix model of any family, qwix LoRA applied or not)."""
    from flax import nnx

    layer_weights = lora_weights = 0
    for _, v in nnx.iter_graph(model.layers):
        if isinstance(v, nnx.LoRAParam):
            lora_weights += int(np.prod(v.shape))
        elif isinstance(v, nnx.Param) and len(v.shape) >= 2:  # 1-D: norm scales
            layer_weights += int(np.prod(v.shape))
    config = model.config
    family = families.of(model)
    vocab = family.vocab_size(config)
    windows = tuple(family.window(layer.attn) for layer in model.layers)
    return ModelCost(layer_weights, lora_weights, int(vocab) * int(config.embed_dim), int(config.num_heads),
                     int(config.head_dim), windows)


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """The options of a step that change its work."""

    batch_size: int
    max_length: int
    attention: str  # dense | blocked | flash | splash
    tile: int  # blocked's tile, flash's and splash's block
    loss_chunk_tokens: int  # 0: full logits
    remat: bool
    extra_forwards: int = 0  # the objective's forward passes beside the policy's (DPO's reference, LoRA off)


@dataclasses.dataclass(frozen=True)
class StepFlops:
    total: float
    parts: dict[str, float]  # layers, lora, attention, output_projection, remat
    attention_pairs_per_row: dict[str, float]  # per query head and layer: "global" / "local W"

    def as_json(self) -> dict[str, Any]:
        return {"flops": self.total, "flops_parts": dict(self.parts), "attention_pairs_per_row": dict(self.attention_pairs_per_row)}


def _segments(row: np.ndarray) -> list[int]:
    """Lengths of a row's real segments (contiguous runs of one nonzero id)."""
    row = np.asarray(row)
    cuts = np.flatnonzero(np.diff(row)) + 1
    return [len(run) for run in np.split(row, cuts) if run[0] != 0]


def ideal_pairs(segment_ids: np.ndarray, window: int | None = None) -> np.ndarray:
    """[rows] same-segment causal (query, key) pairs per row, within the window where one is given:
    sum over segments of s (s + 1) / 2, or with a window w the sum over tokens of min(t + 1, w)."""
    out = []
    for row in np.asarray(segment_ids):
        total = 0
        for s in _segments(row):
            if window is None or s <= window:
                total += s * (s + 1) // 2
            else:
                total += window * (window + 1) // 2 + (s - window) * window
        out.append(total)
    return np.asarray(out, np.int64)


def attention_pairs(kind: str, segment_ids: np.ndarray, tile: int, window: int | None = None) -> np.ndarray:
    """[rows] (query, key) pairs a kind computes per row and query head, padding included."""
    from train.attention_kernels.blocked_attention import tile_work

    seg = np.asarray(segment_ids)
    rows, length = seg.shape
    if kind == "dense":  # Tunix computes every score of L x L, then masks
        return np.full(rows, length * length, np.int64)
    if kind == "splash":  # the blocks of its static causal (local) mask; segment ids mask inside them
        blocks = tile_work(np.ones((1, length), np.int32), tile, window).pairs_computed
        return np.full(rows, blocks * tile * tile, np.int64)
    if kind in ("blocked", "flash"):  # key_tile_ranges on the rows' own segments
        return np.asarray([tile_work(r[None], tile, window).pairs_computed * tile * tile for r in seg], np.int64)
    raise ValueError(f"unknown attention {kind!r}")


def _mean_pairs(fn, segment_ids: np.ndarray, windows: tuple[int | None, ...]) -> dict[int | None, float]:
    """Each distinct window's mean pairs per row (global first)."""
    return {w: float(fn(segment_ids, w).mean()) for w in sorted(set(windows), key=lambda w: (w is not None, w or 0))}


def _label(window: int | None) -> str:
    return "global" if window is None else f"local {window}"


def step_flops(cost: ModelCost, opts: StepOptions, segment_ids: np.ndarray, target_fraction: float | None = None) -> StepFlops:
    """The step as it runs: every position, the kind's own pairs and passes, recomputation included.
    segment_ids: rows of the set (the attention pairs are their mean per row, times B).
    target_fraction: the rows' targets per position (the chunked loss projects only the chunks
    that hold targets); None counts every chunk."""
    tokens = opts.batch_size * opts.max_length
    fwd_attn, bwd_attn = ATTENTION_PASSES[opts.attention]
    pairs = _mean_pairs(lambda s, w: attention_pairs(opts.attention, s, opts.tile, w), segment_ids, cost.windows)
    pair_sum = sum(pairs[w] for w in cost.windows) * opts.batch_size * cost.heads  # all layers, rows, heads
    attention_fwd = fwd_attn * cost.head_dim * pair_sum
    if opts.loss_chunk_tokens:
        targets = tokens if target_fraction is None else int(round(target_fraction * tokens))
        projected = -(-targets // opts.loss_chunk_tokens) * opts.loss_chunk_tokens
        head = 2 * cost.head_weights * projected * 2  # forward and the hidden states' gradient, chunks with targets
    else:
        head = 2 * cost.head_weights * tokens * 2
    forward = (2 * cost.layer_weights + 2 * cost.lora_weights) * tokens + attention_fwd + head / 2
    parts = {
        "layers": 2 * cost.layer_weights * tokens * 2,
        "lora": 2 * cost.lora_weights * tokens * 3,
        "attention": attention_fwd + bwd_attn * cost.head_dim * pair_sum,
        "output_projection": float(head),
        "remat": float((2 * cost.layer_weights + 2 * cost.lora_weights) * tokens + attention_fwd) if opts.remat else 0.0,
        "reference": float(forward) * opts.extra_forwards,
    }
    parts = {k: float(v) for k, v in parts.items()}
    return StepFlops(sum(parts.values()), parts, {_label(w): p for w, p in pairs.items()})


def model_flops(cost: ModelCost, segment_ids: np.ndarray, extra_forwards: int = 0) -> float:
    """MFU's numerator for one batch: forward and backward, no recomputation, real tokens only,
    attention at the same-segment causal ideal; each of the objective's extra forward passes (DPO's
    reference) adds a forward."""
    seg = np.asarray(segment_ids)
    tokens = int(np.count_nonzero(seg))
    per_window = {w: float(ideal_pairs(seg, w).sum()) for w in set(cost.windows)}
    pairs = sum(per_window[w] for w in cost.windows) * cost.heads
    fwd, bwd = ATTENTION_PASSES["dense"]
    per_token = 2 * cost.layer_weights * 2 + 2 * cost.lora_weights * 3 + 2 * cost.head_weights * 2
    total = per_token * tokens + (fwd + bwd) * cost.head_dim * pairs
    if extra_forwards:
        total += extra_forwards * (2 * (cost.layer_weights + cost.lora_weights + cost.head_weights) * tokens
                                   + fwd * cost.head_dim * pairs)
    return float(total)
