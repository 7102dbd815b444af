"""--attention blocked|flash|splash equal dense (train/attention_kernels/blocked_attention.py, flash_attention.py, attention.py).

The reference is Tunix's own attention with the project's [B, L, L] block-causal mask. On tiny
random Gemma3 (5 sliding-window layers with window 4, then a global layer) and tiny Qwen3,
with random LoRA B matrices, on packed rows (several segments, padding) and unpacked rows
(one example each): outputs at every real position, loss and LoRA gradients agree in
float32 to ~1e-5; bfloat16 within its noise. Flash and splash run in Pallas interpret mode on
CPU (flash's kernel-level tests, both its GPU and TPU forms: tests/test_train_flash_attention.py).
Negative control: a tile range that drops needed key tiles fails the same comparison.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from loaders import block_causal_mask_jax
from testkit import train_batches as testing
from train.attention_kernels import attention, blocked_attention as ba
from train.model import models
from train.run_config.config import TrainConfig, TrainError
from train.step import loss as loss_lib, memory_path, model_inputs, precision

VOCAB = 96
LENGTHS = (51, 27, 13, 3, 29, 5, 60, 17)
PLAN = ((0, 1, 3, 5), (2, 4, 6), (7,))
L = 128  # splash blocks are multiples of 128


def dense_reference(q, k, v, seg, window=None):
    b, length, n, h = q.shape
    kv = k.shape[2]
    s = jnp.einsum("btkgh,bskh->btkgs", q.reshape(b, length, kv, n // kv, h), k).reshape(b, length, n, length)
    mask = block_causal_mask_jax(seg)
    if window:
        ones = jnp.ones((length, length), bool)
        mask &= (jnp.triu(ones, -window + 1) & jnp.tril(ones, window - 1))[None]
    p = jax.nn.softmax(jnp.where(mask[:, :, None, :], s, ba.NEG_INF), -1)
    return jnp.einsum("btkgs,bskh->btkgh", p.reshape(b, length, kv, n // kv, length), v).reshape(b, length, n, h)


def random_qkv(b=2, length=64, n=4, kv=2, h=8, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((b, length, n, h), (b, length, kv, h), (b, length, kv, h)))


SEGMENTS = np.array([[1] * 10 + [2] * 27 + [3] * 13 + [0] * 14, [1] * 64], np.int32)


@pytest.mark.parametrize("tile,window", [(8, None), (16, None), (64, None), (8, 12), (16, 5)])
def test_blocked_kernel_equals_dense_outputs_and_gradients(tile, window) -> None:
    q, k, v = random_qkv()
    seg = jnp.asarray(SEGMENTS)
    blocked = lambda q, k, v: ba.blocked_attention(q, k, v, seg, tile=tile, window=window)  # noqa: E731
    dense = lambda q, k, v: dense_reference(q, k, v, seg, window)  # noqa: E731
    np.testing.assert_allclose(blocked(q, k, v), dense(q, k, v), atol=1e-5)
    grad = lambda f: jax.grad(lambda *a: jnp.sum(jnp.sin(f(*a))), argnums=(0, 1, 2))(q, k, v)  # noqa: E731
    for got, want in zip(grad(blocked), grad(dense)):
        np.testing.assert_allclose(got, want, atol=2e-5)


def test_tile_ranges_skip_what_no_segment_spans() -> None:
    # One row of eight 16-token segments at tile 16: only the diagonal tiles are needed.
    short = np.repeat(np.arange(1, 9, dtype=np.int32), 16)[None]
    work = ba.tile_work(short, 16)
    assert (work.pairs_computed, work.pairs_dense) == (8, 36)
    # One segment over the whole row: every causal pair.
    assert ba.tile_work(np.ones((1, 128), np.int32), 16).pairs_computed == 36
    # A window of 16 at tile 16: at most the tile and the one before it.
    assert ba.tile_work(np.ones((1, 128), np.int32), 16, window=16).pairs_computed == 15
    # Padding sees itself only: a padded tail costs one tile per tile.
    padded = np.array([[1] * 20 + [0] * 108], np.int32)
    assert ba.tile_work(padded, 16).pairs_computed == 3 + 6


def test_dropping_a_needed_key_tile_fails_the_equality_check(monkeypatch) -> None:
    q, k, v = random_qkv()
    seg = jnp.asarray(SEGMENTS)
    real = ba.key_tile_ranges
    monkeypatch.setattr(ba, "key_tile_ranges", lambda s, t, w=None: (real(s, t, w)[1], real(s, t, w)[1]))
    err = float(jnp.max(jnp.abs(ba.blocked_attention(q, k, v, seg, tile=8) - dense_reference(q, k, v, seg))))
    assert err > 1e-2


def lora_model(name: str, dtype: str = "float32") -> nnx.Module:
    overrides = {"sliding_window_size": 4} if "gemma" in name else None
    built = models.build_model(name, vocab_size=VOCAB, seed=1, dtype=dtype, config_overrides=overrides)
    model = models.apply_lora(built.model, built.spec, rank=4, seed=3)
    rng = np.random.default_rng(5)
    state = nnx.state(model, nnx.LoRAParam)
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), state))
    return model


def batches() -> dict[str, dict]:
    examples = testing.make_examples(LENGTHS, VOCAB, seed=2)
    return {"packed": testing.packed_batch(examples, PLAN, L), "unpacked": testing.unpacked_batch(examples, L)}


def of_one_shape(data: dict[str, dict]) -> dict[str, dict]:
    """The layouts' batches with as many rows each: the shorter ones are followed by rows of padding alone
    (no loss; padding attends to itself), so each program compiles once for every layout."""
    rows = max(len(batch["segment_ids"]) for batch in data.values())
    return {layout: {key: np.concatenate([field, np.zeros((rows - len(field), *field.shape[1:]), field.dtype)])
                     for key, field in batch.items()} for layout, batch in data.items()}


def step(model, data, kind, dtype=jnp.float32) -> dict[str, tuple]:
    """{layout: (logits, loss, LoRA gradients)} with `kind` attention installed on `model`."""
    attention.install(model, kind, tile=128 if kind == attention.SPLASH else 16)  # flash: 8 blocks of 16 per row
    forward = nnx.jit(lambda m, i: m(i["input_tokens"], i["positions"], None, i["attention_mask"])[0])
    fn = precision.in_compute_dtype(loss_lib.masked_loss_fn_with_aux, dtype)
    grad_fn = nnx.jit(nnx.value_and_grad(fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    results = {}
    for layout, batch in data.items():
        inputs = model_inputs.make_gen_model_input_fn(attention=kind)(batch)
        logits = forward(model, inputs)
        (loss, _), grads = grad_fn(model, **inputs)
        results[layout] = (np.asarray(logits, np.float32), float(loss), [np.asarray(g, np.float32) for g in jax.tree.leaves(grads)])
    return results


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-qwen3"])
def dense_case(request):
    """The dense reference of one model, computed once for the kernels' tests; the model is theirs to
    install each kernel on (its weights do not change)."""
    data, model = of_one_shape(batches()), lora_model(request.param)
    return request.param, data, step(model, data, attention.DENSE), model


def assert_equal_in_float32(name: str, kind: str, layout: str, batch: dict, got: tuple, ref: tuple) -> None:
    (logits, loss, grads), (ref_logits, ref_loss, ref_grads) = got, ref
    real = batch["segment_ids"] != 0
    err = float(np.max(np.abs(logits - ref_logits)[real]))
    assert err <= 2e-5 * max(1.0, float(np.max(np.abs(ref_logits)))), f"{name} {kind} {layout}: {err}"
    assert loss == pytest.approx(ref_loss, rel=1e-5), f"{name} {kind} {layout}"
    scale = max(float(np.max(np.abs(g))) for g in ref_grads)
    for g, r in zip(grads, ref_grads):
        np.testing.assert_allclose(g, r, atol=2e-5 * scale, rtol=1e-4, err_msg=f"{name} {kind} {layout}")


@pytest.mark.parametrize("kind", [attention.BLOCKED, attention.FLASH, attention.SPLASH])
def test_float32_outputs_loss_and_gradients_equal_dense(dense_case, kind) -> None:
    name, data, refs, model = dense_case
    results = step(model, data, kind)
    for layout, batch in data.items():
        assert_equal_in_float32(name, kind, layout, batch, results[layout], refs[layout])


def test_llama3_blocked_equals_dense() -> None:
    """A third family's attention pieces (train/families/llama3.py): the kernels are every family's, so blocked checks them."""
    model, data = lora_model("tiny-llama3"), {"packed": batches()["packed"]}
    ref = step(model, data, attention.DENSE)["packed"]  # installing a kernel leaves the weights as they are
    assert_equal_in_float32("tiny-llama3", attention.BLOCKED, "packed", data["packed"], step(model, data, attention.BLOCKED)["packed"], ref)


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3"])
def test_bfloat16_blocked_equals_dense_within_noise(name) -> None:
    data = {"packed": batches()["packed"]}
    batch = data["packed"]
    model = lora_model(name, "bfloat16")  # dense first: installing blocked changes the attention, not the weights
    ref_logits, ref_loss, ref_grads = step(model, data, attention.DENSE, jnp.bfloat16)["packed"]
    logits, loss, grads = step(model, data, attention.BLOCKED, jnp.bfloat16)["packed"]
    real = batch["segment_ids"] != 0
    # blocked keeps scores and softmax in float32, dense rounds them to bfloat16: differences are bfloat16's.
    assert float(np.mean(np.abs(logits - ref_logits)[real])) <= 0.02 * float(np.mean(np.abs(ref_logits)[real]))
    assert loss == pytest.approx(ref_loss, rel=1e-2)
    ref, got = (np.concatenate([g.ravel() for g in x]) for x in (ref_grads, grads))
    assert np.linalg.norm(got - ref) <= 0.05 * np.linalg.norm(ref)


def test_bad_attention_options_are_refused_with_one_line() -> None:
    with pytest.raises(TrainError, match="unknown --attention 'fused'; choose one of dense, blocked, flash, splash"):
        memory_path.check_options(TrainConfig(shards="x", attention="fused"), 128)
    with pytest.raises(TrainError, match="--attention splash needs a max_length that is a multiple of 128; the shards' is 100"):
        memory_path.check_options(TrainConfig(shards="x", attention="splash"), 100)
    with pytest.raises(TrainError, match="--loss-chunk-tokens must be 0 .full logits. or positive, got -1"):
        memory_path.check_options(TrainConfig(shards="x", loss_chunk_tokens=-1), 128)
    with pytest.raises(TrainError, match="unknown --remat 'all'"):
        memory_path.check_options(TrainConfig(shards="x", remat="all"), 128)


def test_bad_attention_tiles_are_refused_with_one_line(monkeypatch) -> None:
    def check(kind, tile, length=1024):
        memory_path.check_options(TrainConfig(shards="x", attention=kind, attention_tile=tile), length)

    with pytest.raises(TrainError, match="^--attention-tile must divide the shards' max_length 1024, got 384$"):
        check("blocked", 384)
    with pytest.raises(TrainError, match="^--attention-tile must divide the shards' max_length 1024, got 0$"):
        check("flash", 0)
    with pytest.raises(TrainError, match="^--attention-tile is for --attention blocked, flash or splash; dense has no tiles$"):
        check("dense", 128)
    with pytest.raises(TrainError, match="^--attention splash needs blocks that are multiples of 128; --attention-tile 64 is not$"):
        check("splash", 64)
    check("flash", 8, 64)  # interpret mode (CPU) cuts any divisor
    assert memory_path.attention_tile(TrainConfig(shards="x", attention="flash"), 1024) == 128
    assert memory_path.attention_tile(TrainConfig(shards="x", attention="blocked"), 1536) == attention.BLOCKED_TILE == 256
    assert memory_path.attention_tile(TrainConfig(shards="x", attention="blocked"), 640) == 128  # the largest that divides L
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with pytest.raises(TrainError, match=r"^--attention flash on a GPU needs blocks that are powers of two, at least 16 \(Triton\); "
                       r"--attention-tile 48 is not$"):
        check("flash", 48, 96)
    with pytest.raises(TrainError, match=r"the default block 8 \(the largest that divides L 200\) is not$"):
        check("flash", None, 200)
    assert memory_path.attention_tile(TrainConfig(shards="x", attention="flash"), 1024) == 64
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(TrainError, match="^--attention flash on a TPU needs a max_length that is a multiple of 128; the shards' is 1000"):
        check("flash", None, 1000)
    with pytest.raises(TrainError, match="^--attention flash on a TPU needs blocks that are multiples of 128; --attention-tile 64 is not$"):
        check("flash", 64)


def test_default_kind_per_backend_is_the_measured_winner() -> None:
    # docs/benchmarks.md, "The attention default per backend": flash on TPU (equal to splash's step at
    # L2048, 0.92x it at L8192 on a v5e), dense on GPU (0.23x-0.35x blocked's time over Gemma3 270M's
    # layers on an H200), blocked on CPU.
    assert attention.default_kind("tpu") == attention.FLASH
    assert attention.default_kind("gpu") == attention.DENSE
    assert attention.default_kind("cpu") == attention.BLOCKED
    assert attention.default_kind() == attention.default_kind(jax.default_backend())
    assert memory_path.attention_kind(TrainConfig(shards="x")) == attention.default_kind()
