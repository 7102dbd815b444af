"""The same preference pairs as packed rows (row format 5) and as Tunix 0.1.7's DPOTrainer batches.

Used by tests/test_train_dpo.py (the packed DPO loss and LoRA gradients against Tunix's own) and
by benchmarks/bench_dpo_packing.py. Nothing here is used by training.

- `pair_rows`: pairs laid out as the job writes them (each pair's two sides adjacent segments of
  one row, `pair_side` 1 then 2), through prepack.format.rowformat's writer.
- `pairs_of_rows`: the pairs back out of packed rows: each side's prompt (the tokens before its
  first target) and completion (its first target to its last; the targets must be contiguous,
  as Tunix's completion mask is also its attention mask).
- `tunix_input`: Tunix's `TrainingInput`: prompts left-padded, completions right-padded.
- `tunix_loss_and_grads`: DPOTrainer's own `_prepare_inputs` (reference log-probs from its
  `ref_model`) and its loss function (`dpo_loss_fn` through its gen_model_input_fn), and the
  LoRA gradients, as its train step differentiates it.
- `packed_step`: our train step (train/step/train_step.py with train/objectives/dpo_loss.py) on packed rows,
  its gradients captured exactly (an optimizer that stores them instead of applying them).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

from prepack.format import rowformat


@dataclasses.dataclass(frozen=True)
class Pair:
    prompt: np.ndarray
    chosen: np.ndarray  # the completions: every token a target
    rejected: np.ndarray

    @property
    def length(self) -> int:
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def random_pairs(n: int, vocab_size: int, seed: int = 0, prompt: tuple[int, int] = (2, 9),
                 completion: tuple[int, int] = (1, 9)) -> list[Pair]:
    """n pairs of random ids (3..vocab-1) with prompt and completion lengths drawn in [lo, hi]."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = rng.integers(3, vocab_size, size=int(rng.integers(prompt[0], prompt[1] + 1)), dtype=np.int32)
        c, r = (rng.integers(3, vocab_size, size=int(rng.integers(completion[0], completion[1] + 1)), dtype=np.int32)
                for _ in range(2))
        out.append(Pair(p, c, r))
    return out


def pair_rows(pairs: Sequence[Pair], plan: Sequence[Sequence[int]], max_length: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Rows holding the pairs `plan` lists per row, each pair's sides adjacent (chosen first), as
    the job writes them (rowformat.encode_rows_flat), decoded to [B, L] fields."""
    layout = [[(i, side) for i in row for side in (rowformat.CHOSEN, rowformat.REJECTED)] for row in plan]
    return side_rows(pairs, layout, max_length, pad_id)


def side_rows(pairs: Sequence[Pair], layout: Sequence[Sequence[tuple[int, int]]], max_length: int,
              pad_id: int = 0) -> dict[str, np.ndarray]:
    """Rows of sides in any order: `layout` lists per row its segments as (pair index, side), so
    tests can also lay out what the job never writes (a pair's sides in two rows)."""
    lens, ids, mask, sides = [], [], [], []
    for row in layout:
        for i, side in row:
            completion = pairs[i].chosen if side == rowformat.CHOSEN else pairs[i].rejected
            lens.append(len(pairs[i].prompt) + len(completion))
            ids.append(np.concatenate([pairs[i].prompt, completion]))
            mask.append(np.concatenate([np.zeros(len(pairs[i].prompt), np.int32), np.ones(len(completion), np.int32)]))
            sides.append(side)
    records = [r for r, _, _ in rowformat.encode_rows_flat(np.array([len(row) for row in layout]), np.array(lens),
                                                             np.concatenate(ids), np.concatenate(mask), max_length, pad_id,
                                                             pair_sides=np.array(sides))]
    return rowformat.decode_rows(records, max_length, rowformat.field_names(rowformat.PAIR_FORMAT_VERSION))


def pairs_of_rows(rows: dict[str, np.ndarray]) -> list[Pair]:
    """The pairs of packed rows, in row order; each side split at its first target."""
    out = []
    for r in range(rows["segment_ids"].shape[0]):
        seg, ids, mask = rows["segment_ids"][r], rows["input_ids"][r], rows["loss_mask"][r]
        for k in range(1, int(seg.max()) // 2 + 1):
            sides = []
            for s in (2 * k - 1, 2 * k):
                cols = np.flatnonzero(seg == s)
                targets = np.flatnonzero(mask[cols])
                first, last = int(targets[0]), int(targets[-1])
                if not mask[cols][first:last + 1].all():
                    raise ValueError(f"row {r}, segment {s}: its targets are not contiguous; Tunix's DPO cannot take it")
                sides.append((ids[cols][:first], ids[cols][first:last + 1]))
            (p1, c), (p2, rj) = sides
            if not np.array_equal(p1, p2):
                raise ValueError(f"row {r}, pair {k}: the sides' prompts differ")
            out.append(Pair(p1.astype(np.int32), c.astype(np.int32), rj.astype(np.int32)))
    return out


def tunix_input(pairs: Sequence[Pair], pad_id: int = 0) -> Any:
    """Tunix's DPO TrainingInput: prompts left-padded to the longest, completions right-padded."""
    from tunix.sft.dpo import dpo_trainer

    width_p = max(len(p.prompt) for p in pairs)
    width_c = max(max(len(p.chosen), len(p.rejected)) for p in pairs)

    def padded(seqs: Sequence[np.ndarray], width: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
        ids = np.full((len(seqs), width), pad_id, np.int32)
        mask = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            at = slice(width - len(s), width) if left else slice(0, len(s))
            ids[i, at], mask[i, at] = s, 1
        return ids, mask

    prompt_ids, prompt_mask = padded([p.prompt for p in pairs], width_p, True)
    chosen_ids, chosen_mask = padded([p.chosen for p in pairs], width_c, False)
    rejected_ids, rejected_mask = padded([p.rejected for p in pairs], width_c, False)
    return dpo_trainer.TrainingInput(prompt_ids=prompt_ids, prompt_mask=prompt_mask, chosen_ids=chosen_ids,
                                     chosen_mask=chosen_mask, rejected_ids=rejected_ids, rejected_mask=rejected_mask)


def lora_arrays(model: Any) -> dict[str, np.ndarray]:
    """{path: value} of a model's LoRA parameters (or of a gradient state of them)."""
    from flax import nnx

    state = model if isinstance(model, nnx.State) else nnx.state(model, nnx.LoRAParam)
    return {".".join(map(str, p)): np.asarray(v.get_value() if hasattr(v, "get_value") else v) for p, v in nnx.to_flat_state(state)}


def tunix_loss_and_grads(policy: Any, reference: Any, pairs: Sequence[Pair], beta: float,
                         pad_id: int = 0) -> tuple[float, dict[str, float], dict[str, np.ndarray]]:
    """Tunix's DPO on the pairs as one padded batch: its loss, its aux (Tunix's names), and the
    LoRA gradients, from DPOTrainer's own input preparation and loss."""
    import optax
    from flax import nnx
    from tunix.sft.dpo import dpo_trainer

    trainer = dpo_trainer.DPOTrainer(policy, reference, optax.sgd(1.0),
                                     dpo_trainer.DPOTrainingConfig(eval_every_n_steps=1, max_steps=1, beta=beta))
    example = trainer._prepare_inputs(tunix_input(pairs, pad_id))  # pylint: disable=protected-access
    inputs = trainer.gen_model_input_fn(example)
    # Jitted, as Tunix runs its own step: eagerly, every op's output (full logits over 262k tokens,
    # their softmax and gradient) stayed alive at once (10.5 GB for Gemma3 270M).
    # Its options (the loss's name, beta) are Python values: bound, not traced.
    options = {k: v for k, v in inputs.items() if v is None or isinstance(v, (str, bool, int, float))}

    arrays = {k: v for k, v in inputs.items() if k not in options}

    def loss_fn(model: Any, traced: dict[str, Any]) -> Any:
        return trainer.loss_fn(model, **traced, **options)

    grad_fn = nnx.jit(nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    (loss, aux), grads = grad_fn(policy, arrays)
    return float(loss), {k: float(v) for k, v in aux.items()}, lora_arrays(grads)


@functools.lru_cache(maxsize=None)
def grad_capture() -> Any:
    """An optax optimizer that applies nothing and keeps the gradients it was given in its state
    (under inject_hyperparams, so the train step can read a learning rate). One object, so that
    the optimizers built on it have one structure and `jitted_step` traces once."""
    import jax
    import jax.numpy as jnp
    import optax

    def capture(learning_rate: float) -> optax.GradientTransformation:
        del learning_rate

        def init(params: Any) -> Any:
            return {"grads": jax.tree.map(jnp.zeros_like, params)}

        def update(updates: Any, state: Any, params: Any = None) -> Any:
            return jax.tree.map(jnp.zeros_like, updates), {"grads": updates}

        return optax.GradientTransformation(init, update)

    return optax.inject_hyperparams(capture)(learning_rate=0.0)


def captured_grads(optimizer: Any) -> dict[str, np.ndarray]:
    from flax import nnx

    state = optimizer.opt_state.inner_state["grads"]
    return {".".join(map(str, p)): np.asarray(v.get_value() if hasattr(v, "get_value") else v)
            for p, v in nnx.to_flat_state(nnx.State(state) if not isinstance(state, nnx.State) else state)}


@functools.lru_cache(maxsize=None)
def jitted_step(beta: float, chunk_tokens: int, attention: str, accumulate: bool, reference: Any = None) -> Any:
    """The jitted train step of `packed_step`, one per configuration: nnx.jit traces again only for
    another model structure, so the tests that share a configuration share one compilation."""
    from flax import nnx

    from train.objectives import dpo_loss
    from train.step import model_inputs, train_step

    kwargs = {} if reference is None else {"reference": reference}
    loss_fn = dpo_loss.make_dpo_loss_fn(beta, chunk_tokens, **kwargs)
    gen = dpo_loss.make_gen_model_input_fn(model_inputs.make_gen_model_input_fn(attention=attention))
    return nnx.jit(train_step.make_train_step(loss_fn, gen, loss_mean="token", accumulate=accumulate,
                                              sums=dpo_loss.step_sums()))


def packed_step(model: Any, batch: dict[str, np.ndarray], beta: float, *, chunk_tokens: int = 64, attention: str = "dense",
                tile: int = 32, accumulate: bool = False, reference: Any = None) -> tuple[dict[str, float], dict[str, np.ndarray]]:
    """One step of train/step/train_step.py with train/objectives/dpo_loss.py on packed pair rows ([B, L], or
    [B, K, L] with accumulate): the step's aux (sums, loss) and the LoRA gradients it applied.
    `attention` other than dense is installed on `model` (pass a clone) with `tile`."""
    from flax import nnx

    from train.attention_kernels import attention as attention_lib
    from train.step import model_inputs

    attention_lib.install(model, attention, tile)
    optimizer = nnx.Optimizer(model, grad_capture(), wrt=nnx.LoRAParam)
    fields = {k: v for k, v in batch.items() if k in model_inputs.DEVICE_FIELDS + model_inputs.OPTIONAL_DEVICE_FIELDS}
    _, aux, _ = jitted_step(beta, chunk_tokens, attention, accumulate, reference)(model, optimizer, fields)
    return {k: float(np.sum(v)) for k, v in aux.items()}, captured_grads(optimizer)
