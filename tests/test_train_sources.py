"""Per-source loss and target tokens of mixture sets (train/step/loss.py, train/measurement/metrics.py)."""

from __future__ import annotations

import jax.numpy as jnp  # jax is a declared dependency: a broken install fails here, never skips
import numpy as np
import pytest

from train.measurement import metrics
from train.step import loss, model_inputs


def batch(seed: int = 0):
    rng = np.random.default_rng(seed)
    B, L, V = 3, 12, 17
    seg = np.array([[1] * 5 + [2] * 4 + [0] * 3, [1] * 12, [1] * 3 + [2] * 3 + [3] * 3 + [0] * 3], np.int32)
    src = np.where(seg == 0, 0, (np.array([[2], [1], [3]]) + seg - 2) % 3 + 1).astype(np.int32)  # per segment, 1..3
    mask = (rng.random((B, L)) < 0.7).astype(np.int32) * (seg != 0)
    first = np.diff(np.concatenate([np.zeros((B, 1), np.int32), seg], axis=1), axis=1) != 0
    mask[first] = 0
    ids = rng.integers(0, V, (B, L)).astype(np.int32)
    logits = rng.normal(size=(B, L, V)).astype(np.float32)
    return {"input_ids": ids, "loss_mask": mask, "segment_ids": seg, "source_ids": src,
            "positions": np.zeros_like(ids), "valid_mask": (seg != 0).astype(np.int32)}, logits


def test_per_source_sums_add_up_to_the_loss():
    b, logits = batch()
    model = lambda tokens, positions, cache, attention: (jnp.asarray(logits), None)  # noqa: E731
    inputs = model_inputs.make_gen_model_input_fn()(b)
    assert "source_ids" in inputs
    value, aux = loss.masked_loss_fn_with_aux(model, **inputs)
    nll, targets = np.asarray(aux["nll_by_source"]), np.asarray(aux["targets_by_source"])
    assert nll.shape == targets.shape == (loss.MAX_SOURCES + 1,)
    assert targets[0] == 0 and nll[0] == 0  # no target is scored on padding
    assert targets.sum() == pytest.approx(float(aux["target_tokens"]))
    assert nll.sum() / targets.sum() == pytest.approx(float(value), rel=1e-5)
    # by hand: each target token t+1's source
    per, w = loss.per_token_nll(jnp.asarray(logits), jnp.asarray(b["input_ids"]), jnp.asarray(b["loss_mask"]))
    per, w = np.asarray(per), np.asarray(w)
    scored = np.concatenate([b["source_ids"][:, 1:], np.zeros((3, 1), np.int32)], axis=1)
    for s in (1, 2, 3):
        assert nll[s] == pytest.approx(float((per * w)[scored == s].sum()), rel=1e-5)
        assert targets[s] == w[scored == s].sum()
    # the host's count agrees, and the record names the sources
    counts = metrics.batch_counts(b)
    record = metrics.by_source_record(["a", "b", "c"], counts, {k: np.asarray(v) for k, v in aux.items()})
    assert record["target_tokens_by_source"] == {n: int(targets[i]) for i, n in enumerate("abc", start=1)}
    assert record["loss_by_source"]["a"] == pytest.approx(nll[1] / targets[1], rel=1e-5)


def test_the_plain_loss_takes_a_mixture_sets_inputs():
    """Tunix calls the loss with every model input; the README's trainer block uses
    masked_loss_fn, which used to raise TypeError on a mixture set's source_ids."""
    b, logits = batch()
    model = lambda tokens, positions, cache, attention: (jnp.asarray(logits), None)  # noqa: E731
    inputs = model_inputs.make_gen_model_input_fn()(b)
    assert "source_ids" in inputs
    value, _ = loss.masked_loss_fn_with_aux(model, **inputs)
    assert float(loss.masked_loss_fn(model, **inputs)) == pytest.approx(float(value))


def test_sets_without_sources_are_unchanged():
    b, logits = batch()
    del b["source_ids"]
    model = lambda tokens, positions, cache, attention: (jnp.asarray(logits), None)  # noqa: E731
    inputs = model_inputs.make_gen_model_input_fn()(b)
    assert sorted(inputs) == sorted(model_inputs.MODEL_INPUT_KEYS)
    _, aux = loss.masked_loss_fn_with_aux(model, **inputs)
    assert "nll_by_source" not in aux and "target_tokens_by_source" not in metrics.batch_counts(b)
    assert sorted(model_inputs.device_fields(b)) == sorted(model_inputs.DEVICE_FIELDS)
