"""--grad-accum-steps K (train/step/train_step.py): one step of K micro-batches equals one step of the same rows in one batch.

The gradient is read off one SGD step (learning rate 1: params move by exactly -grad), so the
comparison sees the gradient itself; Adam's first step (about lr * sign(grad)) would hide a wrong
scale. The micro-batches hold very different numbers of targets, so a mean of the K per-batch
means (Tunix 0.1.7's optax.MultiSteps) differs from the exact loss by far more than the
tolerance: the test fails when the step divides by each micro-batch's own denominator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from prepack.format import rowformat
from testkit import train_batches as testing
from train import data
from train.model import models
from train.step import chunked_loss, loss as loss_lib, model_inputs, train_step

VOCAB = 96
MAX_LENGTH = 32
K, B = 3, 2
# Micro-batch 0: two rows of mostly targets; 1: short examples, few targets; 2: one long example.
PLAN = (((0, 1), (2,)), ((3, 4, 5), (6,)), ((7,), (8, 9)))
LENGTHS = (14, 16, 28, 3, 4, 5, 6, 30, 9, 12)
PROMPT = (0.1, 0.1, 0.1, 0.8, 0.8, 0.8, 0.8, 0.05, 0.5, 0.5)


_MODEL: list[nnx.Module] = []


def lora_model() -> nnx.Module:
    """A fresh copy of one LoRA model (built once: qwix's discovery run compiles).

    One layer: how the step sums micro-batches' gradients and divides them does not depend on
    the depth, and each layer more only adds compile time to the three programs per case."""
    if not _MODEL:
        built = models.build_model("tiny-qwen3", vocab_size=VOCAB, seed=1, config_overrides={"num_layers": 1})
        model = models.apply_lora(built.model, built.spec, rank=4, seed=3)
        rng = np.random.default_rng(5)  # random B too: qwix's zero B would hide gradient errors
        state = nnx.state(model, nnx.LoRAParam)
        nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), state))
        _MODEL.append(model)
    return nnx.clone(_MODEL[0])


def micro_batches() -> list[dict[str, np.ndarray]]:
    examples = [testing.make_examples([n], VOCAB, seed=i, prompt_fraction=p)[0] for i, (n, p) in enumerate(zip(LENGTHS, PROMPT))]
    return [testing.stack_rows([rowformat.build_row([examples[i] for i in row], MAX_LENGTH) for row in rows])
            for rows in PLAN]


def one_step(stacked: bool, loss_mean: str, loss_fn) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """LoRA params after one SGD step, and the step's record, on the K micro-batches stacked or as one batch."""
    model = lora_model()
    optimizer = nnx.Optimizer(model, optax.inject_hyperparams(optax.sgd)(learning_rate=1.0), wrt=nnx.LoRAParam)
    micro = micro_batches()
    if stacked:
        batch = {k: np.stack([m[k] for m in micro], axis=1) for k in micro[0]}  # [B, K, L], as data.MicroBatches
    else:
        batch = {k: np.concatenate([m[k] for m in micro]) for k in micro[0]}  # [K * B, L]
    batch = {k: v for k, v in batch.items() if k != "valid_mask"}
    step = train_step.make_train_step(loss_fn, model_inputs.make_gen_model_input_fn(loss_mean=loss_mean),
                                      loss_mean=loss_mean, accumulate=stacked)
    loss, aux, grad_norm = nnx.jit(step)(model, optimizer, batch)
    params = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))}
    return params, {"loss": float(loss), "grad_norm": float(grad_norm), **{k: float(np.sum(v)) for k, v in aux.items()}}


LOSSES = {"full": loss_lib.make_masked_loss_fn, "chunked": lambda mean: chunked_loss.make_chunked_loss_fn(37, mean)}


@pytest.mark.slow  # trains a model one step, both ways: see pytest.ini
@pytest.mark.parametrize(("loss_mean", "loss_kind"), [("token", "chunked"), ("example", "full")])
def test_k_micro_batches_step_equals_one_batch_of_their_rows(loss_mean, loss_kind) -> None:
    loss_fn = LOSSES[loss_kind](loss_mean)
    one, one_rec = one_step(False, loss_mean, loss_fn)
    acc, acc_rec = one_step(True, loss_mean, loss_fn)
    before = lora_model()
    initial = {".".join(map(str, p)): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(before, nnx.LoRAParam))}
    moved = max(float(np.abs(one[k] - initial[k]).max()) for k in one)
    assert moved > 1e-3  # the step moved the params: the comparison below is about a real gradient
    for name in one:
        np.testing.assert_allclose(acc[name], one[name], rtol=2e-5, atol=2e-6, err_msg=name)
    assert acc_rec["loss"] == pytest.approx(one_rec["loss"], rel=1e-5)
    assert acc_rec["grad_norm"] == pytest.approx(one_rec["grad_norm"], rel=1e-5)
    denominator = loss_lib.DENOMINATOR[loss_mean]
    assert acc_rec[denominator] == pytest.approx(one_rec[denominator])

    # The data tells the exact loss from a mean of the K micro-batches' means by far more than the tolerance.
    per_micro, jitted, model = [], nnx.jit(loss_fn), lora_model()
    for m in micro_batches():
        inputs = model_inputs.make_gen_model_input_fn(loss_mean=loss_mean)({k: v for k, v in m.items() if k != "valid_mask"})
        per_micro.append(float(jitted(model, **inputs)[0]))
    assert abs(np.mean(per_micro) - one_rec["loss"]) > 100 * 1e-5 * one_rec["loss"]


def test_loss_denominator_over_micro_batches_is_the_sum_of_theirs() -> None:
    micro = micro_batches()
    stacked = {k: np.stack([m[k] for m in micro], axis=1) for k in micro[0]}
    for mean in loss_lib.LOSS_MEANS:
        whole = float(loss_lib.loss_denominator(jnp.asarray(stacked["loss_mask"]), jnp.asarray(stacked["segment_ids"]), None, mean))
        parts = sum(float(loss_lib.loss_denominator(jnp.asarray(m["loss_mask"]), jnp.asarray(m["segment_ids"]), None, mean)) for m in micro)
        assert whole == pytest.approx(parts, rel=1e-5)
    targets = sum(int(np.count_nonzero(m["loss_mask"][:, 1:])) for m in micro)
    assert float(loss_lib.loss_denominator(jnp.asarray(stacked["loss_mask"]), None, None, "token")) == targets
    examples = sum(len(rows) for plan in PLAN for rows in plan)
    assert float(loss_lib.loss_denominator(jnp.asarray(stacked["loss_mask"]), jnp.asarray(stacked["segment_ids"]), None,
                                           "example")) == pytest.approx(examples, rel=1e-5)


class _Loader:
    """A loader iterator stand-in: batches numbered 0.., with get_state/set_state."""

    def __init__(self) -> None:
        self.n = 0

    def __iter__(self) -> "_Loader":
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        self.n += 1
        return {"input_ids": np.full((2, 4), self.n - 1, np.int32)}

    def get_state(self) -> dict[str, int]:
        return {"n": self.n}

    def set_state(self, state: dict[str, int]) -> None:
        self.n = state["n"]


def test_micro_batches_stack_k_loader_batches_and_keep_the_loaders_state() -> None:
    it = iter(data.MicroBatches(_Loader(), 3))
    first = next(it)
    assert first["input_ids"].shape == (2, 3, 4) and first["input_ids"][0].tolist() == [[0] * 4, [1] * 4, [2] * 4]
    assert it.get_state() == {"n": 3}  # after one step: the loader's state after K batches
    it.set_state({"n": 6})
    assert next(it)["input_ids"][0, :, 0].tolist() == [6, 7, 8]
    assert data.first_micro_batch(first, 3)["input_ids"].tolist() == [[0] * 4, [0] * 4]
