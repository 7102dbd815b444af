"""`prepack generate`'s bounds, judged before the model loads: the context length and the device's memory.

- Context: a prompt and its completion share one sequence; the longest prompt bucket (a power of
  two, train/generation/generate.py) plus --max-new-tokens must fit the model's context length
  (models.ModelSpec.context_length).
- Memory: what generation holds on the device, counted from the config alone (no weights read):
  the weights (every parameter of the model's abstract trace, in the parameter dtype), Tunix's KV
  cache (batch * (prompt bucket + new tokens) * layers * 2 (K and V) * kv heads * head dim, in the
  compute dtype), and what the forward materialises per sequence (`activation_bytes`): the
  prefill's logits [bucket, vocab] (the models compute every position's) and a step's [vocab] twice
  (the float32 logits and their log-softmax or sorted copy), all in float32, and one layer's
  attention scores [heads, bucket, cache] (float32) and MLP activations [bucket, 2 x hidden] (the
  compute dtype). With a vocabulary of 262,144 the logits are 1 MiB a row per token: `--batch-size
  1000000` passed a bound of the KV cache alone and grew past 6 GB. XLA's other temporaries are not
  counted, so a plan that fits can still run out; one that does not fit cannot run. The budget is the
  device's memory (train/memory_plan.py's budget_bytes: JAX's figure, else 16 GiB). The batch is
  never larger than the prompts (apps/generate.py cuts it), so only real rows are counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from train.generation.generate import GenerateError, next_power_of_2

GIB = 1024**3


@dataclasses.dataclass(frozen=True)
class GenerationPlan:
    weight_bytes: int
    kv_cache_bytes: int
    activation_bytes: int  # the logits and the forward's largest per-sequence tensors, for the whole batch
    budget_bytes: int
    budget_source: str

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.activation_bytes


def weight_bytes(family: Any, config: Any) -> int:
    """The model's parameters in bytes, from an abstract trace (shapes only, nothing allocated)."""
    import jax
    from flax import nnx

    from train.model import models

    cls = family.model_class()
    abstract = nnx.eval_shape(lambda: cls(config, rngs=models.traced_rngs(0)))
    leaves = jax.tree.leaves(nnx.state(abstract, nnx.Param))
    return int(sum(leaf.size * leaf.dtype.itemsize for leaf in leaves))


def check_context(name: str, context_length: int, max_new_tokens: int, prompt_tokens: int) -> None:
    """The longest prompt's bucket plus --max-new-tokens within the model's context length, else one line."""
    bucket = next_power_of_2(prompt_tokens) if prompt_tokens else 0
    if bucket + max_new_tokens > context_length:
        prompts = f"the longest prompt's {bucket:,}-token bucket plus " if prompt_tokens else ""
        raise GenerateError(f"--max-new-tokens {max_new_tokens:,}: {prompts}that many new tokens exceed {name}'s context "
                            f"length of {context_length:,} tokens; give at most {context_length - bucket:,}")


def activation_bytes(config: Any, *, prompt_bucket: int, cache_tokens: int, compute_dtype: Any) -> int:
    """What the forward materialises for one sequence (see the module's note): logits, one layer's
    attention scores and MLP activations."""
    import numpy as np

    from train.model import models

    f32 = 4
    tokens = max(prompt_bucket, 1)
    vocab = int(models.config_vocab_size(config))
    logits = tokens * vocab * f32 + 2 * vocab * f32
    scores = int(config.num_heads) * tokens * cache_tokens * f32
    mlp = tokens * 2 * int(config.hidden_dim) * np.dtype(compute_dtype).itemsize
    return logits + scores + mlp


def plan(family: Any, config: Any, *, batch_size: int, max_new_tokens: int, prompt_tokens: int, compute_dtype: Any,
         budget: tuple[int, str] | None = None) -> GenerationPlan:
    """The weights, KV cache and per-sequence activations of a run (see the module's note on what is counted)."""
    import numpy as np

    from train import memory_plan

    bucket = next_power_of_2(prompt_tokens) if prompt_tokens else 0
    cache_tokens = bucket + max_new_tokens
    layers, kv_heads, head_dim = family.kv_dims(config)
    per_token = layers * 2 * kv_heads * head_dim * np.dtype(compute_dtype).itemsize
    per_row = activation_bytes(config, prompt_bucket=bucket, cache_tokens=cache_tokens, compute_dtype=compute_dtype)
    limit, source = budget if budget is not None else memory_plan.budget_bytes(None)
    return GenerationPlan(weight_bytes(family, config), batch_size * cache_tokens * per_token, batch_size * per_row, limit, source)


def _size(n: int) -> str:
    return f"{n / GIB:,.2f} GiB" if n >= GIB else f"{n / 2**20:,.2f} MiB"


def check_memory(generation: GenerationPlan, batch_size: int) -> None:
    """The plan within the budget, else one line saying what was counted and what would fit."""
    if generation.total_bytes <= generation.budget_bytes:
        return
    spare = generation.budget_bytes - generation.weight_bytes
    per_row = (generation.kv_cache_bytes + generation.activation_bytes) // batch_size
    fits = max(0, spare // per_row) if per_row else 0
    raise GenerateError(f"--batch-size {batch_size:,}: the KV cache ({_size(generation.kv_cache_bytes)}), the logits and "
                        f"activations ({_size(generation.activation_bytes)}) and the weights "
                        f"({_size(generation.weight_bytes)}) need more than the {_size(generation.budget_bytes)} of "
                        f"{generation.budget_source}; "
                        + (f"give --batch-size {fits:,} or less, or fewer --max-new-tokens" if fits else
                           "give fewer --max-new-tokens, or a smaller --model"))
