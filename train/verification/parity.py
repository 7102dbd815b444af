"""Packed-row parity on the model: every target token's log-probability, packed against alone.

A packed row holds several examples; training is only right if each of them is computed
exactly as it would be alone. For each sampled row this runs the row as stored (packed) and
each of its segments as the only example of a row (positions 0..n-1, then padding: what
`prepack pack --no-pack` writes, the padding after it invisible under the causal mask),
through the model and attention `prepack train` uses: the same ModelConfig and weights,
`--attention` installed by train/step/memory_path.py, the inputs from train/step/model_inputs.py, the
final hidden states and output projection of train/step/chunked_loss.py (the default loss path)
and, for bfloat16, LoRA params cast to the compute dtype as train/step/precision.py does. The
log-probabilities log p(token t | its segment's tokens before t) of every target token are
compared; a segment fails when its differences, summarized as its dtype's statistic says (float32:
the largest; bfloat16: the mean over its targets, widened for short segments), exceed the dtype's
tolerance.
A preference set's segments are its pairs' sides (row formats 5, 6): each side runs alone as
the only example of a row, so its completion's log-probabilities, and the DPO loss's sums of
them, are proven the same packed; a failing side is named by its pair ("pair 2 rejected").

Only the target positions are projected onto the vocabulary (the projection is per token, so
it cannot mix examples): a [B, L, V] logits array for Gemma3's 262,144 ids would not fit.

`packed_layout` is the seam through which tests present the packed rows to the model wrongly
(a plain causal mask, positions counting on across segments, a boundary one token off) and
watch each fail; training never passes it.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from prepack.format import rowformat

# Measured (docs/benchmarks.md, "Parity"): the largest segment statistic (STATISTICS) of correct
# rows, times a margin. float32 (matmuls at 'highest' precision on every backend: train/step/precision.py):
# 3.1e-5 on Gemma3 270M's real weights (8 rows at L512; 1.5e-5 at L128), <= 3.8e-6 on the tiny
# models, 9.5e-7 on a random Qwen3 0.6B: 3e-4 is 10x the largest; the same on every backend.
FLOAT32_TOLERANCE = 3e-4
# bfloat16 rounds differently per backend, so its tolerance is per backend, each set between
# two figures of `python -m benchmarks.bench_verify_tolerance` there: the noise of correct rows
# (the largest segment score) and the miss of a one-key leak across a boundary (the smallest
# score over the later segments; testkit/layout_bugs.py one_key_leak).
BFLOAT16_TOLERANCES: dict[str, float] = {
    # Of the segment scores (STATISTICS, widening). CPU, Gemma3 270M's real weights, the largest score
    # of correct segments and the smallest of a one-key leak's later segments: 0.021 and 0.349 (the
    # sample, 4 rows at L128, blocked), 0.030 and 0.186 (4 rows at L512, blocked), 0.021 and 0.234
    # (Alpaca, 2 rows at L1024, dense). 0.1 lies between: 3.4x the largest noise, 0.54x the smallest leak.
    "cpu": 0.1,
    # TPU v5e, the same real weights and Alpaca rows: the largest correct score 0.045 (L1024 and L8192,
    # flash, splash, dense), the smallest leak 0.248 at L1024. 0.1 is 2.2x that noise and 0.40x that
    # leak; a one-key leak fails the check at both lengths (at L8192 on 198-200 of 203 later segments:
    # the few it misses hold 3-5 targets, under one target's rounding). docs/benchmarks.md, "Tool
    # calls on a TPU v5e".
    "tpu": 0.1,
}
# A backend whose bfloat16 segment means are not measured (a GPU): loose, so correct rows pass; a
# leak is proven or ruled out in float32 there.
BFLOAT16_UNMEASURED = 1.0
TOLERANCES: dict[str, float] = {"float32": FLOAT32_TOLERANCE}  # bfloat16's: BFLOAT16_TOLERANCES, per backend

# How a segment's |packed - alone| log p are summarized before its dtype's tolerance. float32: the
# largest (correct rows agree to ~1e-5 on every backend; a leak moves at least one target far more).
# bfloat16: the mean over the segment's targets. Its rounding differs token by token, and with real
# weights one token's reaches 0.795 on a TPU v5e, 1.3x below the smallest one-key leak (1.05): no
# tolerance on the largest separates them. A leak moves every target after it, rounding a few:
# the mean separates what the largest cannot (docs/benchmarks.md, "Parity in bfloat16"). What a
# mean cannot see is a fault in a segment of very few targets (on a TPU v5e, 3-5 targets under a
# one-key leak score as correct segments can): float32 is the proof for a single boundary.
STATISTICS: dict[str, str] = {"float32": "max", "bfloat16": "mean"}
# A mean over few targets keeps their rounding (one target: its own): below this many targets a
# segment's mean may be sqrt(FULL_MEAN_TARGETS / n) times the tolerance (rounding noise averages
# down as 1/sqrt(n)). At one target that is 5.7x: on a CPU 0.57, above the largest single-token
# rounding measured there (0.47) and below the smallest one-key leak (1.21).
FULL_MEAN_TARGETS = 32


def widening(statistic: str, targets: int) -> float:
    """How much more than the tolerance a segment of `targets` targets may show by `statistic`."""
    if statistic != "mean":
        return 1.0
    return math.sqrt(FULL_MEAN_TARGETS / min(max(targets, 1), FULL_MEAN_TARGETS))


def statistic_for(dtype: str) -> str:
    return STATISTICS.get(dtype, "max")


def tolerance_is_measured(dtype: str, backend: str) -> bool:
    return dtype != "bfloat16" or backend in BFLOAT16_TOLERANCES


def tolerance_for(dtype: str, backend: str) -> float:
    """The largest statistic_for(dtype) of |packed - alone| log p a correct segment may show in `dtype` on `backend`."""
    if dtype == "bfloat16":
        return BFLOAT16_TOLERANCES.get(backend, BFLOAT16_UNMEASURED)
    return TOLERANCES[dtype]


DEFAULT_ROWS = 8
SAMPLE_SEED = 0  # the fixed seed of the row sample, so two runs check the same rows
PROJECT_CHUNK = 256  # target tokens projected onto the vocabulary at a time

Rows = dict[str, np.ndarray]
LayoutFn = Callable[[Rows], Rows]
Progress = Callable[[int, int], None]  # (model calls done, model calls in all)


def stored_layout(rows: Rows) -> Rows:
    """The packed rows exactly as the shards store them: what training feeds the model."""
    return rows


@dataclasses.dataclass(frozen=True)
class SegmentParity:
    label: str  # where the row is: "row 12 (SHARD, record 3)" or "first batch row 2"
    segment: int
    targets: int
    max_abs_diff: float  # inf when a log-probability is not finite
    worst_token: int  # the row column of the worst target
    mean_abs_diff: float  # over the segment's targets; inf when a log-probability is not finite
    # The first column whose position, as the model was given it, is not the one it has alone
    # (0..n-1 from the segment's start); None when all are.
    position_fault: tuple[int, int, int] | None = None  # (column, fed, alone)
    side: str = ""  # a preference set's: "pair k chosen" or "pair k rejected"
    # Every target's |packed - alone| log p, in the segment's order (the statistics above summarize
    # it; benchmarks/bench_verify_tolerance.py keeps it so other summaries can be tried offline).
    abs_diffs: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.float32), repr=False, compare=False)
    first_target: int = 0  # the first target's offset from the segment's start

    @property
    def where(self) -> str:
        return f"{self.label}, segment {self.segment}" + (f" ({self.side})" if self.side else "")

    def value(self, statistic: str) -> float:
        """The segment's differences summarized: "max" (the largest) or "mean" (over its targets)."""
        return {"max": self.max_abs_diff, "mean": self.mean_abs_diff}[statistic]

    def score(self, statistic: str) -> float:
        """value(statistic) in the tolerance's units (a short segment's mean, narrowed by `widening`)."""
        return self.value(statistic) / widening(statistic, self.targets)


@dataclasses.dataclass
class ParityResult:
    dtype: str
    tolerance: float
    attention: str
    rows: int
    segments: list[SegmentParity]
    seconds: float = 0.0
    measured: bool = True  # False: the dtype's tolerance was never measured on this backend (loose)

    @property
    def targets(self) -> int:
        return sum(s.targets for s in self.segments)

    @property
    def max_abs_diff(self) -> float:
        return max((s.max_abs_diff for s in self.segments), default=0.0)

    @property
    def statistic(self) -> str:
        return statistic_for(self.dtype)

    def score(self, s: SegmentParity) -> float:
        return s.score(self.statistic)

    @property
    def worst(self) -> float:
        """The largest segment score: what the tolerance is held against."""
        return max((self.score(s) for s in self.segments), default=0.0)

    def over_tolerance(self, s: SegmentParity) -> bool:
        return not self.score(s) <= self.tolerance

    @property
    def failures(self) -> list[SegmentParity]:
        return [s for s in self.segments if self.over_tolerance(s) or s.position_fault is not None]

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        state = "ok" if self.ok else "FAILED"
        measure = (f"max |packed - alone| log p {self.max_abs_diff:.2e} (tolerance {self.tolerance:.0e})"
                   if self.statistic == "max" else
                   f"largest segment mean |packed - alone| log p {self.worst:.2e} (tolerance {self.tolerance:.0e}, "
                   f"a segment of n < {FULL_MEAN_TARGETS} targets x sqrt(n/{FULL_MEAN_TARGETS}); largest token "
                   f"{self.max_abs_diff:.2e})")
        loose = "" if self.measured else (f"; {self.dtype}'s tolerance is not measured on this backend, so it is "
                                          "loose: prove the rows with --dtype float32")
        return (f"parity {state:<6}  {self.dtype}  {measure} over {self.targets:,} targets in {len(self.segments):,} "
                f"segments of {self.rows} rows, attention {self.attention}  ({self.seconds:.1f} s){loose}")

    def failure_lines(self, limit: int = 3) -> list[str]:
        lines = []
        for s in sorted(self.failures, key=lambda s: -self.score(s))[:limit]:
            if self.over_tolerance(s):
                allowed = self.tolerance * widening(self.statistic, s.targets)
                measure = (f"|packed - alone| log p {s.max_abs_diff:.2e} > {self.tolerance:.0e} at token {s.worst_token}"
                           if self.statistic == "max" else
                           f"mean |packed - alone| log p {s.mean_abs_diff:.2e} > {allowed:.1e} (largest "
                           f"{s.max_abs_diff:.2e} at token {s.worst_token})")
                lines.append(f"{s.where}: {measure} ({s.targets} targets); the packed segment "
                             "does not compute as it does alone")
            if s.position_fault is not None:
                column, fed, alone = s.position_fault
                lines.append(f"{s.where}: the model was given position {fed} at token {column}, "
                             f"alone it is {alone}; positions must restart at 0 in every segment")
        return lines


def sample_rows(num_rows: int, n: int, seed: int = SAMPLE_SEED) -> np.ndarray:
    """n distinct global row indices (all rows when there are fewer), sorted, by a fixed seed."""
    if n >= num_rows:
        return np.arange(num_rows)
    return np.sort(np.random.default_rng(seed).choice(num_rows, size=n, replace=False))


def segments_of(rows: Mapping[str, np.ndarray]) -> list[tuple[int, int, slice]]:
    """(row, segment id, its columns) for every segment of every row (contiguous, ids 1..k)."""
    out = []
    for r, seg in enumerate(np.asarray(rows["segment_ids"])):
        for s in range(1, int(seg.max()) + 1):
            cols = np.flatnonzero(seg == s)
            out.append((r, s, slice(int(cols[0]), int(cols[-1]) + 1)))
    return out


def alone_rows(rows: Mapping[str, np.ndarray], segments: Sequence[tuple[int, int, slice]], batch: int) -> list[Rows]:
    """Each segment as the only example of a row of the same length, in batches of `batch` rows
    (the last one filled with rows of padding, so every call has one shape: one compile)."""
    length = rows["input_ids"].shape[1]
    built = [rowformat.build_row([rowformat.Segment(rows["input_ids"][r, cols], rows["loss_mask"][r, cols])], length)
             for r, _, cols in segments]
    return fixed_batches(built, length, batch)


def fixed_batches(rows: Sequence[Mapping[str, np.ndarray]], length: int, batch: int) -> list[Rows]:
    """Rows of `length` stacked `batch` at a time, the last batch filled with padding rows: one shape."""
    pad = {k: np.zeros(length, np.int32) for k in rowformat.FIELD_NAMES}
    out = []
    for start in range(0, len(rows), batch):
        chunk = list(rows[start:start + batch])
        chunk += [pad] * (batch - len(chunk))
        out.append({k: np.stack([row[k] for row in chunk]) for k in rowformat.FIELD_NAMES})
    return out


class Scorer:
    """Target log-probabilities [B, L] (NaN off target) of rows, through the train path's pieces."""

    def __init__(self, model: Any, attention: str, compute_dtype: Any):
        import jax
        from flax import nnx

        from train.step import chunked_loss, model_inputs, precision

        self.model = model
        self.inputs = model_inputs.make_gen_model_input_fn(attention=attention)
        # jax.jit over the model's state, not nnx.jit over the model: nnx.jit hands the state back
        # out of every call, and the process grew by ~1.5 GB a call on a random Qwen3 0.6B in float32
        # (3 GB of weights: 10 GB after the 8 calls of a check and a bug's; flat with jax.jit). The state
        # is taken from the model at each call (_programs), never kept: --eval-generate scores the model
        # a training step has just updated (and donated the old buffers of).

        def hidden(m: Any, tokens: Any, positions: Any, mask: Any) -> Any:
            return chunked_loss.final_hidden_states(m, tokens, positions, mask)

        def target_nll(m: Any, h: Any, targets: Any) -> Any:
            return chunked_loss.chunked_token_nll(h[None], chunked_loss.output_projection(m), targets[None], PROJECT_CHUNK)[0]

        def on_state(fn: Any) -> Any:
            fn = precision.in_compute_dtype(fn, compute_dtype)
            return lambda graphdef: jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))

        self._on_state = (on_state(hidden), on_state(target_nll))
        self._graphdef: Any = None

    def _programs(self) -> tuple[Any, Any, Any]:
        """(hidden, nll, the model's state now); the programs are made again only if the model's
        structure changed since the last call (a kernel installed, the layers scanned)."""
        from flax import nnx

        graphdef, state = nnx.split(self.model)
        if self._graphdef is None or graphdef != self._graphdef:
            self._graphdef = graphdef
            self._hidden, self._nll = (make(graphdef) for make in self._on_state)
        return self._hidden, self._nll, state

    def logprobs(self, batches: Sequence[Mapping[str, np.ndarray]], progress: Progress | None = None) -> list[np.ndarray]:
        """Per batch, log p of each target token at its column (NaN elsewhere). The states of all
        batches' targets are projected in one call (one compile: packed and alone hold the same targets).
        Afterwards `fed_positions` holds the positions each batch's model call was given. progress(done,
        total) is called after each batch's model call (minutes each for a real model on a CPU)."""
        import jax.numpy as jnp

        states, targets, places = [], [], []
        self.fed_positions = []
        if progress is not None:
            progress(0, len(batches))
        for rows in batches:
            inputs = self.inputs({k: rows[k] for k in ("input_ids", "loss_mask", "positions", "segment_ids")})
            self.fed_positions.append(np.asarray(inputs["positions"]))
            hidden, _, state = self._programs()
            h = hidden(state, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"])
            h = np.asarray(h.astype(jnp.float32))
            ids, mask = np.asarray(rows["input_ids"]), np.asarray(rows["loss_mask"])
            b, t = np.nonzero(mask[:, 1:])  # column t's state predicts token t+1
            states.append(h[b, t])
            targets.append(ids[b, t + 1])
            places.append((b, t + 1))
            if progress is not None:
                progress(len(states), len(batches))
        total = sum(len(t) for t in targets)
        outs = [np.full(np.shape(rows["loss_mask"]), np.nan, np.float32) for rows in batches]
        if not total:
            return outs
        k = -(-total // PROJECT_CHUNK) * PROJECT_CHUNK  # a multiple of the chunk: few shapes, few compiles
        flat_h = np.zeros((k, states[0].shape[-1]), np.float32)
        flat_h[:total] = np.concatenate(states)
        flat_t = np.zeros(k, np.int32)
        flat_t[:total] = np.concatenate(targets)
        dtype = self._projection_dtype()
        _, target_nll, state = self._programs()
        nll = np.asarray(target_nll(state, jnp.asarray(flat_h, dtype), jnp.asarray(flat_t)))
        done = 0
        for out, (b, t) in zip(outs, places):
            out[b, t] = -nll[done:done + len(b)]
            done += len(b)
        return outs

    def _projection_dtype(self) -> Any:
        from train.step import chunked_loss

        return chunked_loss.output_projection(self.model).dtype


def _position_fault(fed: np.ndarray, cols: slice) -> tuple[int, int, int] | None:
    """RoPE sees only position differences, so an offset moves log p by rounding alone (measured,
    docs/benchmarks.md): the positions the model was given are compared exactly instead."""
    want = np.arange(cols.stop - cols.start)
    wrong = np.flatnonzero(fed[cols] != want)
    if not wrong.size:
        return None
    k = int(wrong[0])
    return cols.start + k, int(fed[cols][k]), k


def check_rows(scorer: Scorer, rows: Mapping[str, np.ndarray], labels: Sequence[str], *, dtype: str,
               attention: str, tolerance: float | None = None, packed_layout: LayoutFn = stored_layout,
               progress: Progress | None = None) -> ParityResult:
    """Runs `rows` packed (as `packed_layout` presents them) and each segment alone; compares every
    target's log p, and the positions the model was given. progress: as Scorer.logprobs'."""
    import jax

    from train.step import precision

    started = time.perf_counter()
    sides = rows.get(rowformat.PAIR_SIDE)
    rows = {k: np.asarray(v, np.int32) for k, v in rows.items() if k in rowformat.FIELD_NAMES}
    segments = segments_of(rows)
    batch = rows["input_ids"].shape[0]
    with precision.matmul_precision(dtype):  # float32: float32 matmuls on every backend
        packed, *alone = scorer.logprobs([packed_layout(dict(rows)), *alone_rows(rows, segments, batch)], progress)
    fed = scorer.fed_positions[0]
    alone = np.concatenate(alone) if alone else None
    results = []
    for i, (r, s, cols) in enumerate(segments):
        n = cols.stop - cols.start
        targets = rows["loss_mask"][r, cols].astype(bool)
        targets[0] = False  # a segment's first token is never a target (the row format's rule)
        diff = np.abs(packed[r, cols][targets] - alone[i, :n][targets])
        value, mean, worst = 0.0, 0.0, cols.start
        if diff.size:
            bad = ~np.isfinite(diff)
            k = int(np.argmax(bad)) if bad.any() else int(np.argmax(diff))
            value = float("inf") if bad.any() else float(diff[k])
            mean = float("inf") if bad.any() else float(diff.mean())
            worst = cols.start + int(np.flatnonzero(targets)[k])
        side = "" if sides is None else f"pair {(s + 1) // 2} {'chosen' if sides[r][cols.start] == rowformat.CHOSEN else 'rejected'}"
        first = int(np.argmax(targets)) if targets.any() else 0
        results.append(SegmentParity(labels[r], s, int(diff.size), value, worst, mean, _position_fault(fed[r], cols), side,
                                     diff.astype(np.float32), first))
    measured = True
    if tolerance is None:
        tolerance = tolerance_for(dtype, jax.default_backend())
        measured = tolerance_is_measured(dtype, jax.default_backend())
    return ParityResult(dtype, tolerance, attention, batch, results, time.perf_counter() - started, measured)


class ParityFailed(Exception):
    """`prepack train --verify-first`: the first batch's packed segments do not compute as alone."""


@dataclasses.dataclass(frozen=True)
class ParityConfig:
    model: str
    weights: str | None = None  # as `prepack train --weights`; None: the model's offline default
    rows: int = DEFAULT_ROWS
    dtype: str | None = None  # None: the model's default, as `prepack train`
    attention: str | None = None  # None: the backend's default, as `prepack train`
    attention_tile: int | None = None  # None: the kind's default, as `prepack train`
    seed: int = 0  # random weights' seed, as `prepack train --seed`


def dtype_name(cfg: ParityConfig) -> str:
    import jax.numpy as jnp

    from train.model import models

    spec = models.get_spec(cfg.model)
    return jnp.dtype(models.parse_dtype(cfg.dtype, spec.default_dtype)).name


def build_model(cfg: ParityConfig, tokenizer: Mapping[str, Any], source: str) -> Any:
    """The base model `prepack train` would load for these shards (vocabulary checked first)."""
    from train.model import models
    from train.run_config.vocab import check_vocab

    spec = models.get_spec(cfg.model)
    vocab = int(tokenizer["vocab_size"]) if tokenizer.get("vocab_size") else None
    config = models.resolve_config(cfg.model, vocab_size=vocab, dtype=cfg.dtype)
    check_vocab(tokenizer, cfg.model, spec.family, models.config_vocab_size(config), source)
    return models.build_model(cfg.model, weights=cfg.weights, vocab_size=vocab, dtype=cfg.dtype, seed=cfg.seed)


def train_config(cfg: ParityConfig, shards: str) -> Any:
    from train.run_config.config import TrainConfig

    return TrainConfig(shards=shards, model=cfg.model, attention=cfg.attention, attention_tile=cfg.attention_tile,
                       dtype=cfg.dtype)


def check_view(model: Any, cfg: ParityConfig, view: Any, packed_layout: LayoutFn = stored_layout,
               progress: Progress | None = None) -> ParityResult:
    """`prepack verify SET --model`: cfg.rows rows of a shard set, sampled by the fixed seed.
    progress(done, total): after each model call (the packed batch, then the segments alone)."""
    from train.model import models
    from train.step import memory_path

    tcfg = train_config(cfg, view.path)
    memory_path.check_options(tcfg, view.max_length)
    memory_path.install_attention(model, tcfg, view.max_length)
    kind = memory_path.attention_kind(tcfg)
    dtype = dtype_name(cfg)
    indices = sample_rows(len(view), cfg.rows)
    starts = np.cumsum([0] + [s.num_rows for s in view.manifest.shards])
    labels = []
    for g in indices.tolist():
        k = int(np.searchsorted(starts, g, side="right") - 1)
        labels.append(f"row {g} ({view.shard_paths[k]}, record {g - int(starts[k])})")
    scorer = Scorer(model, kind, models.parse_dtype(cfg.dtype, models.get_spec(cfg.model).default_dtype))
    return check_rows(scorer, view.read(indices), labels, dtype=dtype, attention=kind, packed_layout=packed_layout,
                      progress=progress)


def check_first_batch(setup: Any, batch: Mapping[str, np.ndarray], packed_layout: LayoutFn = stored_layout) -> ParityResult:
    """`prepack train --verify-first`: the run's own model (LoRA applied, attention installed) on its first batch."""
    compute, kind = setup.run.compute_dtype, setup.run.attention  # train/resolved_run.py
    rows = {k: np.asarray(v) for k, v in batch.items() if k in rowformat.FIELD_NAMES + (rowformat.PAIR_SIDE,)}
    labels = [f"first batch row {i}" for i in range(len(rows["input_ids"]))]
    return check_rows(Scorer(setup.built.model, kind, compute), rows, labels, dtype=setup.run.dtype_name,
                      attention=kind, packed_layout=packed_layout)
