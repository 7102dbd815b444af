"""Packed rows train the same model as unpacked rows: logits, per-token loss, and what breaks it.

On a tiny random Gemma3 (6 layers: 5 sliding-window layers with window 4 < every
segment but one, then a global layer) and a tiny random Qwen3, in float32, the Qwen3 twice:
on random ids, and on real Qwen3 rows (the embedded qwen3 tokenizer and its ChatML with the
think block, full 151,669-id vocabulary):
- every segment's logits in a packed row equal that example's logits run alone
  (one example per row under Tunix's plain causal mask and positions);
- the per-token loss over the packed batch equals the one over the unpacked batch,
  with our loss and with Tunix's default;
- negative controls: the same checks fail with a plain causal mask (segments see
  each other), which shows they can catch cross-contamination;
- positions: both models use RoPE only, which is relative, so with the right mask
  Tunix's cumsum positions change results by float rounding only (they do NOT break
  equality at these lengths); the rounding grows with the offset, and on Gemma3 it
  exceeds the tolerance at offsets a long packed row reaches. Stored per-segment
  positions avoid both.
Each model compiles one forward per shape; the loss checks reuse its logits.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from train.step import loss as loss_lib
from testkit import train_batches as testing
from train.model import models
from train.step import model_inputs

VOCAB = 128
LENGTHS = (11, 7, 13, 3, 9)  # the 3-token example is shorter than the window, the rest longer
PLAN = ((0, 1, 3), (2, 4))  # row 0: 11+7+3 = 21 tokens, row 1: 13+9 = 22 tokens
MAX_LENGTH = 24
ATOL = 1e-5


@dataclasses.dataclass
class Case:
    name: str
    model: nnx.Module
    forward: object  # jitted (model, tokens, positions, mask) -> logits
    examples: list
    packed: dict
    unpacked: dict
    packed_logits: np.ndarray
    unpacked_logits: np.ndarray


def _forward(model, tokens, positions, attention_mask):
    return model(tokens, positions, None, attention_mask)[0]


# Real SFT pairs; each example is the last n tokens of one of them, so the windows cross the
# think block, the reply, <|im_end|> and the newline after it.
REAL_PAIRS = (
    ("Give three tips for staying healthy.", "Eat a balanced diet and exercise."),
    ("Translate to French: good morning", "Bonjour !"),
    ("用一句话介绍北京。", "北京是中国的首都，历史悠久。"),
    ("What is 12 * 12?", "12 * 12 = 144."),
    ("Say hi 🤗", "Hi there! 👋"),
)


def _real_qwen3_examples(lengths: tuple[int, ...]) -> tuple[int, list]:
    from prepack.format import rowformat
    from prepack.text.chat import tokenize_conversations
    from prepack.text.conversation import Conversation, Turn
    from prepack.text.tokenizer import load_tokenizer

    tok = load_tokenizer("qwen3")
    convs = [Conversation((Turn("user", p), Turn("assistant", r))) for p, r in REAL_PAIRS]
    out = []
    for ex, n in zip(tokenize_conversations(convs, tok, "auto"), lengths):
        assert len(ex) >= n
        out.append(rowformat.Segment(ex.input_ids[-n:].astype(np.int32), ex.loss_mask[-n:].astype(np.int32)))
    return tok.vocab_size, out


def _build(name: str) -> Case:
    overrides = {"sliding_window_size": 4} if "gemma" in name else None
    if name == "tiny-qwen3-real-text":
        vocab, examples = _real_qwen3_examples(LENGTHS)
        model = models.build_model("tiny-qwen3", vocab_size=vocab, seed=1).model
    else:
        model = models.build_model(name, vocab_size=VOCAB, seed=1, config_overrides=overrides).model
        examples = testing.make_examples(LENGTHS, VOCAB, seed=2)
    forward = nnx.jit(_forward)
    packed = testing.packed_batch(examples, PLAN, MAX_LENGTH)
    unpacked = testing.unpacked_batch(examples, MAX_LENGTH)
    gen = model_inputs.make_gen_model_input_fn()
    p_in = gen(packed)
    packed_logits = np.asarray(forward(model, p_in["input_tokens"], p_in["positions"], p_in["attention_mask"]))
    # The reference owes nothing to our code: Tunix's own causal mask and positions, one example per row.
    u_in = testing.plain_causal_inputs(unpacked)
    unpacked_logits = np.asarray(forward(model, u_in["input_tokens"], u_in["positions"], u_in["attention_mask"]))
    return Case(name, model, forward, examples, packed, unpacked, packed_logits, unpacked_logits)


@pytest.fixture(scope="module", params=["tiny-gemma3", "tiny-qwen3", "tiny-qwen3-real-text"])
def case(request) -> Case:
    return _build(request.param)


def segment_errors(case: Case, packed_logits: np.ndarray) -> list[float]:
    """Max |packed - alone| over each example's logits, in example order."""
    out = []
    for p in testing.placements(PLAN, case.examples):
        got = packed_logits[p.row, p.start : p.start + p.length]
        want = case.unpacked_logits[p.example, : p.length]
        out.append(float(np.max(np.abs(got - want))))
    return out


def assert_segments_match(case: Case, packed_logits: np.ndarray) -> None:
    errors = segment_errors(case, packed_logits)
    assert max(errors) <= ATOL, f"{case.name}: per-example max |packed - alone| = {errors}"


def run_packed(case: Case, inputs: dict) -> np.ndarray:
    return np.asarray(case.forward(case.model, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"]))


# ----------------------------------------------------------------------------- equality


def test_the_rows_are_what_they_claim(case: Case) -> None:
    for b in (case.packed, case.unpacked):
        for r in range(b["input_ids"].shape[0]):
            from prepack.format import rowformat

            rowformat.check_row({k: v[r] for k, v in b.items()}, MAX_LENGTH)
    assert case.packed["segment_ids"].max(axis=1).tolist() == [3, 2]
    # Gemma3's local layers must actually be windowed below most segment lengths.
    if "gemma" in case.name:
        assert case.model.config.sliding_window_size == 4 < max(LENGTHS)


def test_packed_segment_logits_equal_each_example_alone(case: Case) -> None:
    errors = segment_errors(case, case.packed_logits)
    print(f"\n{case.name}: max |packed - alone| per example: {['%.1e' % e for e in errors]}")
    assert_segments_match(case, case.packed_logits)


def test_one_padded_row_equals_the_unpadded_example(case: Case) -> None:
    """The reference itself: an example in a padded row equals it at its exact length, no padding."""
    ex = case.examples[2]
    n = len(ex)
    tokens = jnp.asarray(ex.input_ids)[None]
    alone = case.forward(case.model, tokens, jnp.arange(n)[None], jnp.tril(jnp.ones((n, n), jnp.bool_))[None])
    np.testing.assert_allclose(np.asarray(alone)[0], case.unpacked_logits[2, :n], atol=ATOL, rtol=0)


def test_gen_model_input_fn_returns_exactly_the_loss_kwargs_and_traces_under_jit(case: Case) -> None:
    gen = model_inputs.make_gen_model_input_fn()
    jitted = jax.jit(gen)(model_inputs.device_fields(case.packed))
    assert tuple(sorted(jitted)) == tuple(sorted(model_inputs.MODEL_INPUT_KEYS))
    np.testing.assert_array_equal(jitted["positions"], case.packed["positions"])  # stored, not recomputed
    np.testing.assert_array_equal(jitted["input_mask"], case.packed["loss_mask"])  # not shifted
    assert jitted["attention_mask"].dtype == jnp.bool_ and jitted["attention_mask"].shape == (2, MAX_LENGTH, MAX_LENGTH)


# ----------------------------------------------------------------------------- loss


def _targets_by_example(case: Case, nll: np.ndarray, weights: np.ndarray, packed: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """(nll, weight) of the positions inside each example (column t scores token t+1)."""
    out = []
    for p in testing.placements(PLAN, case.examples):
        row, start = (p.row, p.start) if packed else (p.example, 0)
        sl = slice(start, start + p.length - 1)  # the last token of an example predicts nothing of it
        out.append((nll[row, sl], weights[row, sl]))
    return out


def test_per_token_loss_packed_equals_unpacked(case: Case) -> None:
    p_nll, p_w = (np.asarray(x) for x in loss_lib.per_token_nll(case.packed_logits, case.packed["input_ids"], case.packed["loss_mask"]))
    u_nll, u_w = (np.asarray(x) for x in loss_lib.per_token_nll(case.unpacked_logits, case.unpacked["input_ids"], case.unpacked["loss_mask"]))
    # The same tokens are targets, and nothing else anywhere carries weight (no cross-boundary target).
    assert p_w.sum() == u_w.sum() == sum(int(ex.loss_mask[1:].sum()) for ex in case.examples)
    for (pn, pw), (un, uw) in zip(_targets_by_example(case, p_nll, p_w, True), _targets_by_example(case, u_nll, u_w, False)):
        np.testing.assert_array_equal(pw, uw)
        np.testing.assert_allclose(pn[pw > 0], un[uw > 0], atol=ATOL, rtol=0)


def test_batch_loss_packed_equals_unpacked_ours_and_tunix_default(case: Case) -> None:
    default = loss_lib.tunix_default_loss_fn()
    values = {}
    for layout, logits, batch in (("packed", case.packed_logits, case.packed), ("unpacked", case.unpacked_logits, case.unpacked)):
        args = (jnp.asarray(batch["input_ids"]), jnp.asarray(batch["loss_mask"]), None, None)
        values[("ours", layout)] = float(loss_lib.masked_loss_fn(testing.FixedLogits(jnp.asarray(logits)), *args))
        values[("tunix", layout)] = float(default(testing.FixedLogits(jnp.asarray(logits)), *args))
    print(f"\n{case.name}: " + ", ".join(f"{k[0]}/{k[1]}={v:.7f}" for k, v in values.items()))
    ref = values[("tunix", "unpacked")]
    for key, value in values.items():
        assert value == pytest.approx(ref, rel=1e-6, abs=1e-6), key


# ----------------------------------------------------------------------------- negative controls


def _plain_causal_mask(segment_ids: jax.Array) -> jax.Array:
    """Tunix's default mask: causal over real tokens, blind to segments."""
    from tunix.sft import utils

    return utils.make_causal_attn_mask((segment_ids != 0).astype(jnp.int32))


def test_plain_causal_mask_fails_the_equality_check(case: Case) -> None:
    gen = model_inputs.make_gen_model_input_fn(mask_fn=_plain_causal_mask)
    logits = run_packed(case, gen(case.packed))
    errors = segment_errors(case, logits)
    print(f"\n{case.name}: plain causal mask, max |packed - alone| per example: {['%.1e' % e for e in errors]}")
    # The first segment of each row sees nothing before it, so it still matches ...
    first = [i for i, p in enumerate(testing.placements(PLAN, case.examples)) if p.start == 0]
    assert all(errors[i] <= ATOL for i in first)
    # ... every later segment is contaminated by the ones before it, far beyond the tolerance,
    assert all(errors[i] > 1e3 * ATOL for i in range(len(errors)) if i not in first)
    # so the very assertion the equality test makes fails.
    with pytest.raises(AssertionError):
        assert_segments_match(case, logits)


def test_plain_causal_mask_changes_the_loss(case: Case) -> None:
    gen = model_inputs.make_gen_model_input_fn(mask_fn=_plain_causal_mask)
    logits = run_packed(case, gen(case.packed))
    args = (jnp.asarray(case.packed["input_ids"]), jnp.asarray(case.packed["loss_mask"]), None, None)
    contaminated = float(loss_lib.masked_loss_fn(testing.FixedLogits(jnp.asarray(logits)), *args))
    clean = float(loss_lib.masked_loss_fn(testing.FixedLogits(jnp.asarray(case.packed_logits)), *args))
    assert abs(contaminated - clean) > 1e-3, (contaminated, clean)


def test_cumsum_positions_are_rounding_close_but_break_at_long_offsets(case: Case) -> None:
    """Tunix's cumsum positions with the right mask: RoPE only sees position differences,
    so the result moves by rounding only, which grows with the absolute offset."""
    gen = model_inputs.make_gen_model_input_fn()
    inputs = dict(gen(case.packed))
    valid = jnp.asarray(case.packed["valid_mask"])
    from tunix.sft import utils

    inputs["positions"] = utils.build_positions_from_mask(valid)
    cumsum_errors = segment_errors(case, run_packed(case, inputs))
    # A segment that starts deep in a long row (as cumsum positions would place it in an 8k-32k row).
    inputs["positions"] = jnp.asarray(case.packed["positions"]) + 30_000
    offset_errors = segment_errors(case, run_packed(case, inputs))
    stored = segment_errors(case, case.packed_logits)
    print(
        f"\n{case.name}: max |packed - alone|: stored positions {max(stored):.1e}, "
        f"cumsum positions {max(cumsum_errors):.1e}, +30000 offset {max(offset_errors):.1e}"
    )
    # Rounding-level at offsets < 24: positions are not what isolates segments, the mask is.
    assert max(cumsum_errors) < 1e-3
    if "gemma" in case.name:
        # In float32, sin/cos of angles near 30000 lose ~1e-3 rad, and this tiny Gemma3's
        # activations are large enough to show it (measured 1.1e-3 here): stored per-segment
        # positions keep every segment at the angles it would have alone. The tiny Qwen3 is
        # less sensitive (measured 1.4e-6), so only Gemma3 carries the assertion.
        assert max(offset_errors) > ATOL


# ----------------------------------------------------------------------------- bfloat16, real Qwen3 rows

# bf16 has 8 mantissa bits: packed and alone may round differently (other shapes, other
# reduction orders), so equality becomes "within bf16 rounding of these logits", far below
# what a segment seeing its neighbours costs (the plain-causal control must exceed it).
BF16_ATOL = 0.05


@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_bf16_packed_segment_logits_equal_each_example_alone_on_real_qwen3_rows() -> None:
    vocab, examples = _real_qwen3_examples(LENGTHS)
    model = models.build_model("tiny-qwen3", vocab_size=vocab, seed=1, dtype="bfloat16").model
    forward = nnx.jit(_forward)
    packed = testing.packed_batch(examples, PLAN, MAX_LENGTH)
    unpacked = testing.unpacked_batch(examples, MAX_LENGTH)
    p_in = model_inputs.make_gen_model_input_fn()(packed)
    u_in = testing.plain_causal_inputs(unpacked)
    c_in = testing.plain_causal_inputs(packed)
    runs = {k: np.asarray(forward(model, i["input_tokens"], i["positions"], i["attention_mask"]), np.float32)
            for k, i in (("packed", p_in), ("alone", u_in), ("plain_causal", c_in))}
    assert model.config.dtype == jnp.bfloat16 and np.isfinite(runs["packed"]).all()
    errors = {k: [] for k in ("packed", "plain_causal")}
    for p in testing.placements(PLAN, examples):
        want = runs["alone"][p.example, : p.length]
        for k in errors:
            errors[k].append(float(np.max(np.abs(runs[k][p.row, p.start : p.start + p.length] - want))))
    print(f"\nbf16 tiny-qwen3 real rows: packed {['%.1e' % e for e in errors['packed']]}, plain causal {['%.1e' % e for e in errors['plain_causal']]}")
    assert max(errors["packed"]) <= BF16_ATOL
    assert max(errors["plain_causal"]) > 10 * BF16_ATOL  # the check can fail


# ----------------------------------------------------------------------------- bfloat16


# bfloat16 keeps 8 mantissa bits (relative step 2**-8 = 0.4%); packed and alone may round
# differently, so "equal" becomes: within 2% of the logits' scale. A segment that sees its
# neighbours (plain causal mask) must still miss by more than 10x that.
BF16_RELATIVE_TOLERANCE = 0.02


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-qwen3"])
@pytest.mark.slow  # trains or loads a real model: see pytest.ini
def test_bfloat16_packed_segment_logits_equal_each_example_alone(name: str) -> None:
    overrides = {"sliding_window_size": 4} if "gemma" in name else None
    model = models.build_model(name, vocab_size=VOCAB, seed=1, dtype="bfloat16", config_overrides=overrides).model
    forward = nnx.jit(_forward)
    examples = testing.make_examples(LENGTHS, VOCAB, seed=2)
    packed = testing.packed_batch(examples, PLAN, MAX_LENGTH)
    inputs = {
        "packed": model_inputs.make_gen_model_input_fn()(packed),
        "alone": testing.plain_causal_inputs(testing.unpacked_batch(examples, MAX_LENGTH)),
        "plain_causal": testing.plain_causal_inputs(packed),
    }
    logits = {k: np.asarray(forward(model, i["input_tokens"], i["positions"], i["attention_mask"]), np.float32)
              for k, i in inputs.items()}
    assert jax.tree.leaves(nnx.state(model, nnx.Param))[0].dtype == jnp.bfloat16
    tolerance = BF16_RELATIVE_TOLERANCE * float(np.abs(logits["alone"]).max())
    errors = {k: [] for k in ("packed", "plain_causal")}
    for p in testing.placements(PLAN, examples):
        want = logits["alone"][p.example, : p.length]
        for k in errors:
            errors[k].append(float(np.max(np.abs(logits[k][p.row, p.start : p.start + p.length] - want))))
    print(f"\nbf16 {name}: tolerance {tolerance:.2e}; packed {['%.1e' % e for e in errors['packed']]}, "
          f"plain causal {['%.1e' % e for e in errors['plain_causal']]}")
    assert max(errors["packed"]) <= tolerance
    assert max(errors["plain_causal"]) > 10 * tolerance  # the check can fail
