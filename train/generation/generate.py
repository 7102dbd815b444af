"""Sampling from a (LoRA-)model with Tunix's KV-cached Sampler, fed the training rendering's ids.

Tunix's `Sampler.__call__` takes strings, encodes them with its tokenizer and puts a BOS in
front (`tunix/generate/sampler.py`, `Sampler.tokenize`): a second rendering, which would differ
from the training one wherever a chat format inserts tokens by id, trims text or has no BOS. Here
the Sampler is handed the ids themselves (`_IdsSampler.tokenize` returns them), so its prefill
sees exactly the prompt `prepack pack` trained on (prepack/text/chat/prompts.py); everything
else is Tunix's: left padding, positions from the pad mask, the KV cache, greedy or top-p/top-k
sampling, stopping at the given end tokens.

The model is a generation view of the one given (`generation_view`): the same parameters, with
Tunix's own attention (a run's `--attention blocked|flash|splash` layers read segment ids and
have no cache), no layer scan, and the LoRA parameters in the compute dtype, as the training
step computes with them (train/step/precision.py). `reference_nll` scores reference replies through
the training loss's pieces (train/verification/parity.py's Scorer: final hidden states, the output projection).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

import numpy as np

__all__ = ["SamplingOptions", "Completion", "GenerateError", "Generator", "generation_view", "reference_nll",
           "STOP", "LENGTH"]

# stop_reason: a stop token ended the completion, or --max-new-tokens did (OpenAI's names).
STOP, LENGTH = "stop", "length"


class GenerateError(ValueError):
    """Generation options or inputs that cannot work; the message says what to change."""


def seed_problem(flag: str, value: int) -> str | None:
    """A seed within train's range (train/run_config/options.py: 0 to 2^32 - 1, what jax's PRNGKey and numpy take), else
    the refusal: one line, never jax's OverflowError."""
    from train.run_config.options import MAX_SEED, Count

    return Count(flag, "seed", 0, MAX_SEED).problem(value)


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How to sample. Greedy unless a temperature is given; top-p and top-k then narrow it."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0
    batch_size: int = 8

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise GenerateError(f"--max-new-tokens must be at least 1, got {self.max_new_tokens}")
        if self.batch_size < 1:
            raise GenerateError(f"--batch-size must be at least 1, got {self.batch_size}")
        seed = seed_problem("--seed", self.seed)
        if seed:
            raise GenerateError(seed)
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise GenerateError(f"--temperature must be 0 (greedy) or positive, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise GenerateError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise GenerateError(f"--top-k must be at least 1, got {self.top_k}")
        if self.greedy and (self.top_p is not None or self.top_k is not None):
            raise GenerateError("--top-p and --top-k narrow sampling, but greedy decoding (--temperature 0, the default) "
                                "does not sample: give --temperature too")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampler_kwargs(self) -> dict[str, Any]:
        """Tunix's Sampler samples (top-p mode) only when top_p is given; temperature alone is top_p 1."""
        if self.greedy:
            return {}
        return {"temperature": float(self.temperature), "top_p": 1.0 if self.top_p is None else float(self.top_p),
                "top_k": self.top_k}

    def describe(self) -> dict[str, Any]:
        return {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": self.seed, "batch_size": self.batch_size,
                "mode": "greedy" if self.greedy else "sample"}


@dataclasses.dataclass(frozen=True)
class Completion:
    tokens: np.ndarray  # the generated ids, the stop token left off
    stop_reason: str  # STOP or LENGTH


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def generation_view(model: Any, compute_dtype: Any) -> Any:
    """The model as the Sampler runs it: its parameters (the arrays are shared, not copied), Tunix's
    own attention, no layer scan, LoRA cast to the compute dtype. The model itself is unchanged."""
    import jax
    from flax import nnx

    from train.attention_kernels import attention

    graphdef, state = nnx.split(model)
    view = nnx.merge(graphdef, state, copy=True)  # new Variables: casting the view's LoRA leaves the model's
    attention.restore_tunix(view)
    if getattr(view, "layer_scan", False):
        view.layer_scan = False
    lora = nnx.state(view, nnx.LoRAParam)
    nnx.update(view, jax.tree.map(lambda x: x.astype(compute_dtype), lora))
    return view


@dataclasses.dataclass
class _SamplerTokenizer:
    """What Tunix's TokenizerAdapter asks of a tokenizer; the ids come in already encoded."""

    pad: int
    eos: int

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        raise TypeError("prompts reach the sampler as token ids; nothing is encoded here")

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str:
        return ""  # completions are decoded by the chat format (special tokens written out)

    def bos_id(self) -> None:
        return None

    def eos_id(self) -> int:
        return self.eos

    def pad_id(self) -> int:
        return self.pad


def _ids_sampler_class() -> type:
    from tunix.generate import sampler as tunix_sampler

    class IdsSampler(tunix_sampler.Sampler):
        """Tunix's Sampler, each prompt given as its token ids (no re-encoding, no BOS added)."""

        def tokenize(self, input_string: Any) -> np.ndarray:
            return np.asarray(input_string, dtype=np.int32)

    return IdsSampler


def _model_dims(model: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of the model, for the KV cache (its family's `kv_dims`)."""
    from train import families

    return families.of(model).kv_dims(model.config)


class Generator:
    """Batched, KV-cached generation from token-id prompts.

    Prompts are sorted by length and cut into batches of `batch_size` (a short last batch is
    filled with copies, so every batch has one shape); each batch is left-padded to a power of
    two at least its longest prompt, so a run compiles a prefill per length bucket and
    generates in input order whatever the batching. `refresh(model)` takes a training model's
    current LoRA values (eval during training) without compiling again.
    """

    def __init__(self, model: Any, *, pad_id: int, stop_ids: Sequence[int], max_prompt_tokens: int,
                 sampling: SamplingOptions, compute_dtype: Any, out: TextIO | None = None):
        from tunix.generate import sampler as tunix_sampler

        sampling.check()
        if not stop_ids:
            raise GenerateError("no stop token: the chat format's tokenizer has neither an end-of-turn token nor eos")
        self.sampling = sampling
        self.pad_id = int(pad_id)
        self.stop_ids = sorted({int(i) for i in stop_ids})
        self.compute_dtype = compute_dtype
        self.out = out if out is not None else sys.stderr
        self.view = generation_view(model, compute_dtype)
        self.cache_size = next_power_of_2(max_prompt_tokens) + sampling.max_new_tokens
        layers, kv_heads, head_dim = _model_dims(self.view)
        config = tunix_sampler.CacheConfig(cache_size=self.cache_size, num_layers=layers, num_kv_heads=kv_heads,
                                           head_dim=head_dim)
        self.sampler = _ids_sampler_class()(self.view, _SamplerTokenizer(self.pad_id, self.stop_ids[0]), config)
        self.max_prompt_tokens = int(max_prompt_tokens)
        self.tokens_generated = 0
        self.seconds = 0.0
        # (completion tokens, seconds) of the batches whose prompt-length bucket was compiled before:
        # the rate without compiling, which a longer run approaches.
        self.steady = [0, 0.0]
        self._compiled: set[int] = set()
        self.last_prompt_tokens: np.ndarray | None = None

    def refresh(self, model: Any) -> None:
        """The view (and so the sampler) takes `model`'s current arrays, its LoRA in the compute dtype.
        The frozen weights too: the train step donates the whole model (train/step/train_step.py
        DONATED), so after a step the arrays the view was made with are deleted, and the model holds
        new ones over the same buffers (no copy)."""
        import jax
        from flax import nnx

        nnx.update(self.view, nnx.state(model, nnx.Not(nnx.LoRAParam)))
        lora = jax.tree.map(lambda x: x.astype(self.compute_dtype), nnx.state(model, nnx.LoRAParam))
        nnx.update(self.view, lora)
        self.sampler.transformer_state = nnx.state(self.view)

    def generate(self, prompts: Sequence[np.ndarray], progress: Callable[[int, int, float], None] | None = None) -> list[Completion]:
        """One completion per prompt, in the prompts' order."""
        import jax

        for k, p in enumerate(prompts):
            if len(p) > self.max_prompt_tokens:
                raise GenerateError(f"prompt {k} has {len(p)} tokens, more than the {self.max_prompt_tokens} "
                                    "this generator was built for")
            if not len(p):
                raise GenerateError(f"prompt {k} is empty")
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), i))
        out: list[Completion | None] = [None] * len(prompts)
        size = self.sampling.batch_size
        batches = [order[i:i + size] for i in range(0, len(order), size)]
        done = 0
        for b, members in enumerate(batches):
            chunk = [np.asarray(prompts[i], np.int32) for i in members]
            chunk += [chunk[0]] * (size - len(chunk))  # one batch shape for every batch
            started = time.perf_counter()
            bucket = next_power_of_2(max(len(p) for p in chunk))
            result = self.sampler(
                chunk,
                max_generation_steps=self.sampling.max_new_tokens,
                max_prompt_length=bucket,
                eos_tokens=self.stop_ids,
                seed=jax.random.fold_in(jax.random.PRNGKey(self.sampling.seed), b),
                **self.sampling.sampler_kwargs(),
            )
            elapsed = time.perf_counter() - started
            self.last_prompt_tokens = np.asarray(result.padded_prompt_tokens)  # what the prefill saw (tests)
            made = 0
            for i, tokens in zip(members, result.tokens):
                tokens = np.asarray(tokens, np.int32)[:self.sampling.max_new_tokens]
                reason = LENGTH if len(tokens) >= self.sampling.max_new_tokens else STOP
                out[i] = Completion(tokens, reason)
                made += len(tokens)
            self.tokens_generated += made
            self.seconds += elapsed
            if bucket in self._compiled:
                self.steady[0] += made
                self.steady[1] += elapsed
            self._compiled.add(bucket)
            done += len(members)
            if progress is not None:
                progress(done, len(prompts), elapsed)
        return [c for c in out if c is not None]

    def figures(self) -> dict[str, Any]:
        """Tokens and seconds so far: every batch's, and (steady_) those of the batches whose prompt-length
        bucket had compiled before, the rate without compiling; a rate is None where no second was timed."""
        rate = lambda tokens, seconds: tokens / seconds if seconds else None  # noqa: E731
        return {"batch_size": self.sampling.batch_size, "tokens": self.tokens_generated, "seconds": self.seconds,
                "tokens_per_s": rate(self.tokens_generated, self.seconds), "steady_tokens": self.steady[0],
                "steady_seconds": self.steady[1], "steady_tokens_per_s": rate(*self.steady)}

    def throughput(self) -> str:
        """Tokens and tokens/s so far, and without the batches that compiled, for the console."""
        f = self.figures()
        steady = f", {f['steady_tokens_per_s']:,.1f} tokens/s without compiling" if f["steady_tokens_per_s"] is not None else ""
        return f"{f['tokens']:,} tokens in {f['seconds']:.1f} s ({f['tokens_per_s'] or 0.0:,.1f} tokens/s{steady})"


def reference_nll(model: Any, items: Sequence[tuple[np.ndarray, np.ndarray]], *, compute_dtype: Any,
                  attention: str = "dense", batch_size: int = 8, scorer: Any = None,
                  progress: Callable[[int, int], None] | None = None) -> list[tuple[float, int]]:
    """(sum of NLLs, tokens) of each reference given its prompt, teacher-forced: the prompt and
    reference as one example in a row of its own, the reference's tokens the targets, scored by
    train/verification/parity.py's Scorer (the training loss's final hidden states and output projection).
    A caller scoring the same model again (--eval-generate) passes its `scorer` of `model`: a
    new Scorer jits new functions, so it would compile again each time. progress(done, total): after
    each batch's model call (Scorer.logprobs)."""
    from prepack.format import rowformat
    from train.verification.parity import Scorer, fixed_batches

    if not items:
        return []
    longest = max(len(p) + len(r) for p, r in items)
    length = -(-longest // 64) * 64  # few row lengths across runs: few compiles
    rows = []
    for prompt, ref in items:
        ids = np.concatenate([np.asarray(prompt, np.int32), np.asarray(ref, np.int32)])
        mask = np.concatenate([np.zeros(len(prompt), np.int32), np.ones(len(ref), np.int32)])
        rows.append(rowformat.build_row([rowformat.Segment(ids, mask)], length))
    batches = fixed_batches(rows, length, batch_size)
    scorer = scorer if scorer is not None else Scorer(model, attention, compute_dtype)
    logps = scorer.logprobs(batches, progress)
    out = []
    for k in range(len(items)):
        logp = logps[k // batch_size][k % batch_size]
        targets = logp[~np.isnan(logp)]
        out.append((float(-targets.sum()), int(targets.size)))
    return out
