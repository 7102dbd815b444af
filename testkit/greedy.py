"""The reference continuation for generation tests: greedy by the training forward pass."""
from __future__ import annotations

from typing import Any

import numpy as np


def training_argmax(model: Any, prompt: np.ndarray, steps: int, length: int = 64, attention: str = "blocked") -> list[int]:
    """Greedy continuation by the training forward pass: the whole sequence each step, one
    example in a [1, L] row with its segment ids and positions (train/step/model_inputs.py, the
    attention kind the model was installed with), no KV cache, the model's logits at the last token."""
    import jax.numpy as jnp
    from flax import nnx

    from train.step.model_inputs import make_gen_model_input_fn

    fn = make_gen_model_input_fn(attention=attention)

    @nnx.jit
    def forward(m: Any, batch: dict[str, Any]) -> Any:  # one compile for the [1, L] row
        inputs = fn(batch)
        return m(inputs["input_tokens"], inputs["positions"], None, inputs["attention_mask"])[0]

    ids = [int(t) for t in prompt]
    for _ in range(steps):
        n = len(ids)
        if n > length:
            raise ValueError(f"the sequence has {n} tokens, more than the row's {length}")
        row = np.zeros((1, length), np.int32)
        row[0, :n] = ids
        seg = (np.arange(length) < n).astype(np.int32)[None]
        pos = np.where(seg[0] > 0, np.arange(length), 0)[None].astype(np.int32)
        logits = forward(model, {"input_ids": row, "loss_mask": np.zeros_like(row), "positions": pos, "segment_ids": seg})
        ids.append(int(jnp.argmax(logits[0, n - 1])))
    return ids[len(prompt):]
