"""Train/serve parity of generation, on tiny Gemma3 and tiny Qwen3 (random weights, float32):

- greedy generation (Tunix's KV-cached Sampler, fed the prompt ids: train/generation/generate.py) equals the
  step-by-step argmax of the training forward pass (the same model and LoRA, the attention a CPU
  run trains with, no cache), over prompts longer than Gemma3's sliding window, in batches with
  left padding;
- the check fails when the LoRA is not applied at generation (the same generator, its LoRA zeroed);
- a zero adapter (qwix's B = 0 at the start) changes no output, a non-zero one does;
- an adapter saved by --save-lora (a PEFT folder, Gemma3's fused k/v included, or the prepack
  file) loads back by --lora into exactly the trained LoRA parameters;
- sampling is reproducible by seed, and refresh() follows a training model's LoRA.

Each Generator compiles Tunix's sampler (seconds on a CPU), so the tests build few: a
generator is refreshed with other LoRA values (refresh compiles nothing) wherever the check
allows, and the prompts share one length bucket.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train.attention_kernels import attention
from train.generation import generate
from train.model import models
from testkit.greedy import training_argmax

VOCAB = 300
PAD = 0
# 20, 18 and 17 tokens: past tiny Gemma3's window of 8, left-padded to one length bucket (32), so
# each generator compiles once.
PROMPTS = [np.arange(5, 25, dtype=np.int32),
           np.array([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57], np.int32),
           np.array([7, 70, 170, 270, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20], np.int32)]
NEW = 10


@functools.cache
def _lora_base(name: str):
    """One LoRA model per family for the whole file (qwix's LoRA build compiles); tests get copies."""
    built = models.build_model(name, vocab_size=VOCAB, seed=0)
    return built, models.apply_lora(built.model, built.spec, rank=4, seed=1)


def lora_model(name: str, scale: float = 0.3):
    """(the base build, a fresh copy of its LoRA model: qwix's initial adapters (B = 0) at scale 0,
    else random factors of `scale`)."""
    built, model = _lora_base(name)
    model = nnx.merge(*nnx.split(model), copy=True)
    if scale:
        set_lora(model, scale, seed=5)
    return built, model


def set_lora(model, scale: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * scale, x.dtype), state))


def generator(model, stop_ids=(1,), batch_size: int = 2, **sampling):
    options = generate.SamplingOptions(max_new_tokens=sampling.pop("max_new_tokens", NEW), batch_size=batch_size, **sampling)
    return generate.Generator(model, pad_id=PAD, stop_ids=stop_ids, max_prompt_tokens=max(map(len, PROMPTS)),
                              sampling=options, compute_dtype=jnp.float32)


def tokens(completions) -> list[list[int]]:
    return [c.tokens.tolist() for c in completions]


def unapplied(model):
    """A copy of `model` with its LoRA zeroed: the adapter as if never applied."""
    copy = nnx.merge(*nnx.split(model), copy=True)
    set_lora(copy, 0.0, seed=0)
    return copy


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3"])
def test_greedy_generation_is_the_training_forwards_argmax(name):
    _, model = lora_model(name)
    attention.install(model, attention.BLOCKED, 16)  # as a CPU training run has it
    want = [training_argmax(model, p, NEW) for p in PROMPTS]
    gen = generator(model, stop_ids=(VOCAB - 1,))  # an id these random models never pick here
    got = gen.generate(PROMPTS)
    assert tokens(got) == want
    assert [c.stop_reason for c in got] == [generate.LENGTH] * 3
    # The sampler was fed the prompt ids themselves: no re-encoding, no BOS added.
    fed = gen.last_prompt_tokens
    assert fed.shape[1] == 32  # the last batch: prompt 2 and its fill copy, left-padded to a power of two
    assert [row[row != PAD].tolist() for row in fed] == [PROMPTS[2].tolist()] * 2
    # The model the run trains is untouched: its attention, and its float32 LoRA.
    assert type(model.layers[0].attn).__name__ == "SegmentIdsAttention"
    # The check can fail: the same generator with the LoRA not applied (zeroed; refresh compiles
    # nothing) does not reproduce the LoRA model's argmax.
    gen.refresh(unapplied(model))
    assert tokens(gen.generate(PROMPTS)) != want
    if name == "tiny-gemma3":  # A stop id ends a completion there, the stop token left off.
        stop = want[0][3]
        first = want[0].index(stop)
        stopped = generator(model, stop_ids=(stop,)).generate(PROMPTS[:1])[0]
        assert stopped.tokens.tolist() == want[0][:first] and stopped.stop_reason == generate.STOP


def test_a_zero_adapter_changes_nothing_and_a_trained_one_does():
    base = models.build_model("tiny-qwen3", vocab_size=VOCAB, seed=0)
    plain = tokens(generator(base.model).generate(PROMPTS))
    _, zero = lora_model("tiny-qwen3", scale=0.0)  # qwix's initial adapters: B = 0
    gen = generator(zero)
    assert tokens(gen.generate(PROMPTS)) == plain
    set_lora(zero, 0.3, seed=5)  # trained: the adapter moved
    gen.refresh(zero)
    assert tokens(gen.generate(PROMPTS)) != plain


@pytest.mark.parametrize("kind, name", [("peft", "tiny-gemma3"), ("peft", "tiny-qwen3"), ("prepack", "tiny-gemma3")])
def test_an_exported_adapter_loads_as_the_trained_lora(tmp_path, name, kind):
    """--lora reads both --lora-format outputs back into exactly the trained LoRA parameters (a PEFT
    folder's Hugging Face factors mapped back to qwix's, Gemma3's fused k/v included)."""
    from train.adapter_files import adapters, lora_file, peft_export
    from train.model.fingerprint import base_fingerprint

    built, model = lora_model(name)
    meta = {"base_weights": "random", "base_fingerprint": base_fingerprint(model), "vocab_size": VOCAB, "seed": 0}
    path = str(tmp_path / "adapter")
    if kind == "peft":
        peft_export.save_peft(model, built.spec.family, built.config, path, model_name=name, rank=4, alpha=8.0, metadata=meta)
    else:
        lora_file.save_lora(model, path, {"model": name, "lora_alpha": 8.0, **meta})
    adapter = adapters.read_adapter(path)
    assert (adapter.kind, adapter.model, adapter.rank, adapter.alpha, adapter.vocab_size) == (kind, name, 4, 8.0, VOCAB)
    fresh = models.build_model(name, vocab_size=VOCAB, seed=0)
    loaded = adapters.apply_adapter(fresh.model, fresh.spec, adapter)
    want = nnx.to_flat_state(nnx.state(model, nnx.LoRAParam))
    got = dict(nnx.to_flat_state(nnx.state(loaded, nnx.LoRAParam)))
    assert len(got) == len(want) > 0
    for path_, var in want:
        np.testing.assert_array_equal(np.asarray(got[path_].get_value()), np.asarray(var.get_value()))
    other = models.build_model(name, vocab_size=VOCAB, seed=1)  # other base weights: refused
    with pytest.raises(lora_file.LoraFileError, match="trained on other base weights"):
        adapters.apply_adapter(other.model, other.spec, adapter)


def test_a_peft_adapter_from_elsewhere_is_refused_in_one_line(tmp_path):
    """A PEFT folder whose k and v factors do not share one A (as any other trainer writes them)
    cannot be Gemma3's fused kv LoRA: refused, naming the modules."""
    from safetensors.numpy import load_file, save_file

    from train.adapter_files import adapters, lora_file, peft_export
    from train.model.fingerprint import base_fingerprint

    built, model = lora_model("tiny-gemma3")
    path = tmp_path / "adapter"
    peft_export.save_peft(model, built.spec.family, built.config, str(path), model_name="tiny-gemma3", rank=4, alpha=8.0,
                          metadata={"base_fingerprint": base_fingerprint(model), "vocab_size": VOCAB, "seed": 0})
    weights = path / peft_export.ADAPTER_WEIGHTS
    from train.adapter_files.lora_file import _parse_safetensors_metadata

    meta = _parse_safetensors_metadata(weights.read_bytes(), str(weights))
    tensors = load_file(str(weights))
    name = "base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight"
    tensors[name] = tensors[name] + 1.0
    save_file(tensors, str(weights), metadata=meta)
    fresh = models.build_model("tiny-gemma3", vocab_size=VOCAB, seed=0)
    with pytest.raises(lora_file.LoraFileError, match="k_proj, .*v_proj have different lora_A"):
        adapters.apply_adapter(fresh.model, fresh.spec, adapters.read_adapter(str(path)))


def test_sampling_is_reproducible_by_seed_and_refresh_follows_the_model():
    _, model = lora_model("tiny-qwen3")
    sample = dict(temperature=1.0, top_k=50)
    seeded = generator(model, seed=3, **sample)
    a = tokens(seeded.generate(PROMPTS))
    assert tokens(seeded.generate(PROMPTS)) == a  # each batch's key comes from the seed, not from the calls before
    assert tokens(generator(model, seed=4, **sample).generate(PROMPTS)) != a
    gen = generator(model)
    before = tokens(gen.generate(PROMPTS))
    set_lora(model, 0.3, seed=9)  # training moved the adapters
    gen.refresh(model)
    after = tokens(gen.generate(PROMPTS))
    assert after != before
    # the refreshed generator is the moved model's greedy argmax (Tunix's own attention, dense mask)
    assert after == [training_argmax(model, p, len(t), attention="dense") for p, t in zip(PROMPTS, after)]


def test_the_view_casts_lora_to_the_compute_dtype_and_leaves_the_model():
    _, model = lora_model("tiny-gemma3")
    view = generate.generation_view(model, jnp.bfloat16)
    dtypes = lambda m: {x.dtype for x in jax.tree.leaves(nnx.state(m, nnx.LoRAParam))}  # noqa: E731
    assert dtypes(view) == {jnp.dtype(jnp.bfloat16)} and dtypes(model) == {jnp.dtype(jnp.float32)}


@pytest.mark.parametrize("options, message", [
    (dict(top_p=0.9), "--top-p and --top-k narrow sampling, but greedy decoding"),
    (dict(temperature=-1.0), "--temperature must be 0 (greedy) or positive"),
    (dict(temperature=1.0, top_p=1.5), "--top-p must be in (0, 1]"),
    (dict(max_new_tokens=0), "--max-new-tokens must be at least 1"),
    (dict(batch_size=0), "--batch-size must be at least 1"),
])
def test_bad_sampling_options_say_what_to_change(options, message):
    with pytest.raises(generate.GenerateError) as info:
        generate.SamplingOptions(**options).check()
    assert message in str(info.value)
