"""--loss-mean token|example (train/step/loss.py, train/step/chunked_loss.py), and the row field that makes
the pieces of a split example count as one (row format 3's example_targets, written by the job).

The reference owes nothing to the code under test: every example (or piece of a split example)
runs alone in its own row with Tunix's own causal mask and positions, and the per-example mean
is computed here in numpy from those rows' per-token NLLs. The packed batch goes through the
trainer's own inputs and losses (full logits and chunked), with example ids only in the rows.

The tiny Gemma3 has one (sliding-window) layer: the means are sums of the per-token NLLs the
model ends with, and the reference runs the same model alone, whatever its depth; each layer
more only adds compile time to the dozen programs here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from prepack.format import rowformat
from prepack.packing.packer import split_pieces
from testkit import train_batches as testing
from train.measurement.metrics import MetricsRecorder
from train.model import models
from train.run_config.config import TrainConfig, TrainError
from train.step import chunked_loss, loss as loss_lib, memory_path, model_inputs

VOCAB = 96
MAX_LENGTH = 32
LENGTHS = (11, 7, 13, 3, 9, 5)
PLAN = ((0, 1, 3), (2, 4, 5))
LONG = 60  # cut by --overlong split at MAX_LENGTH into [0, 32) and [32, 60)


def lora_model() -> nnx.Module:
    built = models.build_model("tiny-gemma3", vocab_size=VOCAB, seed=1, config_overrides={"sliding_window_size": 4, "num_layers": 1})
    model = models.apply_lora(built.model, built.spec, rank=4, seed=3)
    state = nnx.state(model, nnx.LoRAParam)
    rng = np.random.default_rng(5)  # random B too: qwix's zero B would hide gradient errors
    nnx.update(model, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), state))
    return model


@pytest.fixture(scope="module")
def model() -> nnx.Module:
    return lora_model()


@nnx.jit  # one program per shape; run eagerly, each of its ops compiled on its own (hundreds)
def per_token_nll_alone(model: nnx.Module, input_tokens, positions, attention_mask, input_mask):
    logits = model(input_tokens, positions, None, attention_mask)[0]
    return loss_lib.per_token_nll(logits, input_tokens, input_mask)


def alone_nll(model: nnx.Module, segments: list[rowformat.Segment],
              max_length: int = MAX_LENGTH) -> list[tuple[np.ndarray, np.ndarray]]:
    """(NLL, weight) of each segment's scored positions, the segment alone in a row (Tunix's inputs)."""
    batch = testing.unpacked_batch(segments, max_length)
    inputs = testing.plain_causal_inputs(batch)
    out = per_token_nll_alone(model, inputs["input_tokens"], inputs["positions"], inputs["attention_mask"], inputs["input_mask"])
    nll, w = (np.asarray(x, np.float64) for x in out)
    return [(nll[i, : len(s)], w[i, : len(s)]) for i, s in enumerate(segments)]


def reference_means(per_example: list[list[tuple[np.ndarray, np.ndarray]]]) -> tuple[float, float]:
    """(token mean, example mean) over examples, each a list of its pieces' (NLL, weight)."""
    sums = [(sum(float((n * w).sum()) for n, w in pieces), sum(float(w.sum()) for _, w in pieces)) for pieces in per_example]
    token = sum(s for s, _ in sums) / sum(t for _, t in sums)
    example = float(np.mean([s / t for s, t in sums if t > 0]))
    return token, example


LOSS_FNS = {(mean, name): fn for mean in loss_lib.LOSS_MEANS for name, fn in (
    ("full", loss_lib.make_masked_loss_fn(mean)), ("chunked", chunked_loss.make_chunked_loss_fn(37, mean)))}
JITTED = {key: nnx.jit(fn) for key, fn in LOSS_FNS.items()}  # compiled once per batch shape
TODAYS_LOSS = nnx.jit(loss_lib.masked_loss_fn)  # the loss before --loss-mean, as the trainer runs it (jitted)


def losses(model: nnx.Module, batch: dict, loss_mean: str) -> dict[str, tuple[float, dict]]:
    """The trainer's loss on a batch, through its own gen_model_input_fn, full logits and chunked."""
    inputs = model_inputs.make_gen_model_input_fn(loss_mean=loss_mean)(batch)
    out = {}
    for name in ("full", "chunked"):
        loss, aux = JITTED[(loss_mean, name)](model, **inputs)
        out[name] = (float(loss), jax.tree.map(np.asarray, aux))
    return out


def split_case() -> tuple[list[rowformat.Segment], list[list[int]], tuple[tuple[int, ...], ...], np.ndarray]:
    """Whole examples plus one LONG example cut into pieces as --overlong split cuts it: the
    segments, which segments make each example, a packing plan (pieces in different rows, beside
    other examples) and each segment's example_targets (the row format's field: 0 on a whole example)."""
    whole = testing.make_examples(LENGTHS, VOCAB, seed=2)
    long = testing.make_examples((LONG,), VOCAB, seed=4, prompt_fraction=0.2)[0]
    pieces = [rowformat.Segment(long.input_ids[a:b], long.loss_mask[a:b]) for a, b in split_pieces(LONG, MAX_LENGTH)]
    segments = whole + pieces
    n = len(whole)
    examples = [[i] for i in range(n)] + [list(range(n, n + len(pieces)))]
    total = sum(int(p.loss_mask[1:].sum()) for p in pieces)  # the row builder zeroes each first token
    example_targets = np.array([0] * n + [total] * len(pieces), np.int32)
    plan = ((0, 1, 5), (n,), (2, 4), (n + 1, 3))
    return segments, examples, plan, example_targets


def packed_with_field(segments, plan, example_targets) -> dict:
    batch = testing.packed_batch(segments, plan, MAX_LENGTH)
    seg = batch["segment_ids"]
    field = np.zeros_like(seg)
    for r, row in enumerate(plan):
        for k, i in enumerate(row, start=1):
            field[r][seg[r] == k] = example_targets[i]
    batch["example_targets"] = field
    return batch


# ----------------------------------------------------------------------------- whole examples


def test_packed_example_mean_equals_the_unpacked_per_example_mean(model) -> None:
    examples = testing.make_examples(LENGTHS, VOCAB, seed=2)
    token_ref, example_ref = reference_means([[x] for x in alone_nll(model, examples)])
    assert abs(token_ref - example_ref) > 1e-3  # the two means differ here, so the test tells them apart
    packed = testing.packed_batch(examples, PLAN, MAX_LENGTH)
    for name, (loss, aux) in losses(model, packed, "example").items():
        assert loss == pytest.approx(example_ref, rel=1e-5), name
        assert float(aux["examples"]) == pytest.approx(len(LENGTHS), rel=1e-6), name
        # The token sums stay in the aux (eval, the target-count cross-check).
        assert float(aux["nll_sum"]) / float(aux["target_tokens"]) == pytest.approx(token_ref, rel=1e-5)


def test_token_mean_is_todays_loss(model) -> None:
    examples = testing.make_examples(LENGTHS, VOCAB, seed=2)
    token_ref, _ = reference_means([[x] for x in alone_nll(model, examples)])
    packed = testing.packed_batch(examples, PLAN, MAX_LENGTH)
    assert loss_lib.make_masked_loss_fn("token") is loss_lib.masked_loss_fn_with_aux  # the very same function
    inputs = model_inputs.make_gen_model_input_fn()(packed)
    today = float(TODAYS_LOSS(model, **inputs))
    for name, (loss, aux) in losses(model, packed, "token").items():
        assert loss == pytest.approx(today, rel=1e-6) and loss == pytest.approx(token_ref, rel=1e-5), name
        assert "examples" not in aux and "example_nll_sum" not in aux


def test_token_mean_inputs_are_unchanged() -> None:
    batch = testing.packed_batch(testing.make_examples(LENGTHS, VOCAB, seed=2), PLAN, MAX_LENGTH)
    assert set(model_inputs.make_gen_model_input_fn()(batch)) == set(model_inputs.MODEL_INPUT_KEYS)
    assert set(model_inputs.make_gen_model_input_fn(loss_mean="example")(batch)) == {*model_inputs.MODEL_INPUT_KEYS, "segment_ids"}


# ----------------------------------------------------------------------------- split pieces


def test_example_mean_on_split_pieces_equals_the_unpacked_per_example_mean(model) -> None:
    segments, examples, plan, example_targets = split_case()
    alone = alone_nll(model, segments)
    _, example_ref = reference_means([[alone[i] for i in members] for members in examples])
    _, per_piece_ref = reference_means([[x] for x in alone])
    assert abs(example_ref - per_piece_ref) > 1e-3  # counting pieces as examples would be caught
    batch = packed_with_field(segments, plan, example_targets)
    for name, (loss, aux) in losses(model, batch, "example").items():
        assert loss == pytest.approx(example_ref, rel=1e-5), name
        assert float(aux["examples"]) == pytest.approx(len(examples), rel=1e-6), name
    # A set without the field (older sets): every segment is its own example.
    del batch["example_targets"]
    for name, (loss, aux) in losses(model, batch, "example").items():
        assert loss == pytest.approx(per_piece_ref, rel=1e-5), name
        assert float(aux["examples"]) == pytest.approx(len(segments), rel=1e-6), name


def test_batches_that_share_a_split_example_combine_exactly(model) -> None:
    """Pieces in different batches: each batch counts its pieces as the share T_piece / T_example of
    the example; the aux sums of the batches add up to the whole batch's (eval aggregation, and
    what an exact gradient accumulation would divide)."""
    segments, examples, plan, example_targets = split_case()
    whole = packed_with_field(segments, plan, example_targets)
    parts = [{k: v[rows] for k, v in whole.items()} for rows in ([0, 1], [2, 3])]  # the pieces are in both
    for loss_mean, (num, den) in (("example", ("example_nll_sum", "examples")), ("token", ("nll_sum", "target_tokens"))):
        full_loss, _ = losses(model, whole, loss_mean)["full"]
        auxes = [losses(model, p, loss_mean)["full"][1] for p in parts]
        combined = sum(float(a[num]) for a in auxes) / sum(float(a[den]) for a in auxes)
        assert combined == pytest.approx(full_loss, rel=1e-5), loss_mean
    shares = [float(losses(model, p, "example")["full"][1]["examples"]) for p in parts]
    assert all(s != round(s) for s in shares) and sum(shares) == pytest.approx(len(examples), rel=1e-6)


def test_example_mean_gradients_equal_the_unpacked_reference(model) -> None:
    segments, examples, plan, example_targets = split_case()
    batch = packed_with_field(segments, plan, example_targets)
    unpacked = testing.unpacked_batch(segments, MAX_LENGTH)
    u_in = testing.plain_causal_inputs(unpacked)
    owner = np.zeros(len(segments), np.int32)
    for e, members in enumerate(examples):
        owner[members] = e

    def reference(m):  # mean over examples of each one's token mean, from rows of one segment each
        logits = m(u_in["input_tokens"], u_in["positions"], None, u_in["attention_mask"])[0]
        nll, w = loss_lib.per_token_nll(logits, u_in["input_tokens"], u_in["input_mask"])
        sums = jax.ops.segment_sum(jnp.sum(nll * w, axis=1), owner, num_segments=len(examples))
        counts = jax.ops.segment_sum(jnp.sum(w, axis=1), owner, num_segments=len(examples))
        return jnp.mean(sums / counts)

    grad = nnx.DiffState(0, nnx.LoRAParam)
    want = [np.asarray(g) for g in jax.tree.leaves(nnx.jit(nnx.grad(reference, argnums=grad))(model))]
    inputs = model_inputs.make_gen_model_input_fn(loss_mean="example")(batch)
    for name in ("full", "chunked"):
        grads, _ = nnx.jit(nnx.grad(LOSS_FNS[("example", name)], argnums=grad, has_aux=True))(model, **inputs)
        got = [np.asarray(g) for g in jax.tree.leaves(grads)]
        scale = max(float(np.abs(g).max()) for g in want)
        assert len(got) == len(want) > 0 and scale > 0
        for g, r in zip(got, want):
            np.testing.assert_allclose(g, r, atol=1e-5 * scale, rtol=1e-4)


# ----------------------------------------------------------------------------- the real pipeline and loader

PIPE_L = 64  # the packed set's max length: the long examples below are cut into pieces at it
WHOLE_L = 1024  # the reference set's: every example whole, alone in its row


@pytest.fixture(scope="module")
def packed_and_whole(tmp_path_factory) -> tuple[str, str]:
    """One alpaca file packed twice by `prepack pack`: with --overlong split at PIPE_L (pieces of
    the long examples beside whole ones, in rows and batches of their own), and unpacked at
    WHOLE_L (each example whole in its row: the reference's source)."""
    from apps import cli
    from testkit.pipeline import alpaca_records, words, write_jsonl

    root = tmp_path_factory.mktemp("loss-mean-split")
    long = [{"instruction": f"Long {k}: " + words(12 + k, k), "input": "", "output": words(70 + 25 * k, k + 5)} for k in range(4)]
    source = write_jsonl(str(root / "in.jsonl"), alpaca_records(14, seed=3) + long)
    packed, whole = str(root / "packed"), str(root / "whole")
    assert cli.main(["pack", "--input", source, "--format", "alpaca", "--max-length", str(PIPE_L), "--overlong", "split",
                     "--output", packed, "--no-progress"]) == 0
    assert cli.main(["pack", "--input", source, "--format", "alpaca", "--max-length", str(WHOLE_L), "--no-pack",
                     "--output", whole, "--no-progress"]) == 0
    return f"{packed}/L{PIPE_L}", f"{whole}/L{WHOLE_L}"


def loader_batches(path: str, batch_size: int) -> list[dict]:
    """One epoch of the real loader's batches, ids folded into the tiny model's vocabulary (the
    model is the same function of them packed and alone, which is all the comparison needs)."""
    from loaders import make_dataset

    batches = list(make_dataset(path, batch_size, seed=0, shard_index=0, shard_count=1, num_epochs=1,
                                drop_remainder=False, read_threads=0, prefetch=0))
    for batch in batches:
        batch["input_ids"] = batch["input_ids"] % VOCAB
    return batches


def whole_examples_cut_as_split_cuts_them(path: str) -> list[list[rowformat.Segment]]:
    """Each example of the unpacked set, whole, then cut by --overlong split's rule at PIPE_L
    (prepack.packing.packer.split_pieces); a piece with no target after its first token is the
    one the job drops. An example longer than PIPE_L is several pieces, each run alone."""
    [batch] = loader_batches(path, 4096)
    out = []
    for r in range(len(batch["segment_ids"])):
        n = int(batch["valid_mask"][r].sum())
        ids, mask = batch["input_ids"][r][:n], batch["loss_mask"][r][:n]
        pieces = [rowformat.Segment(ids[a:b], np.concatenate([[0], mask[a + 1:b]])) for a, b in split_pieces(n, PIPE_L)]
        out.append([p for p in pieces if p.loss_mask[1:].any()])
    return [pieces for pieces in out if pieces]


def test_example_mean_on_a_split_set_from_the_job_equals_the_unpacked_per_example_mean(model, packed_and_whole) -> None:
    """`prepack pack --overlong split` writes example_targets; through the real loader,
    --loss-mean example on its packed batches (pieces of one example in different rows and
    batches) equals the mean over examples of each one's token-mean NLL, its pieces run alone
    and taken together; --loss-mean token equals today's loss."""
    packed, whole = packed_and_whole
    reference = whole_examples_cut_as_split_cuts_them(whole)
    assert sum(len(p) > 1 for p in reference) >= 3  # several examples are split
    alone = alone_nll(model, [piece for pieces in reference for piece in pieces], PIPE_L)
    per_example, k = [], 0
    for pieces in reference:
        per_example.append(alone[k:k + len(pieces)])
        k += len(pieces)
    token_ref, example_ref = reference_means(per_example)
    _, per_piece_ref = reference_means([[x] for x in alone])
    assert abs(example_ref - per_piece_ref) > 1e-3  # counting each piece as an example would be caught

    [one] = loader_batches(packed, 4096)  # every row in one batch
    assert "example_targets" in one and len(one["segment_ids"]) > 4
    for name, (loss, aux) in losses(model, one, "example").items():
        assert loss == pytest.approx(example_ref, rel=1e-5), name
        assert float(aux["examples"]) == pytest.approx(len(reference), rel=1e-5), name  # float32 sums of shares
    for name, (loss, _) in losses(model, one, "token").items():
        inputs = model_inputs.make_gen_model_input_fn()(one)
        assert loss == pytest.approx(float(TODAYS_LOSS(model, **inputs)), rel=1e-6), name
        assert loss == pytest.approx(token_ref, rel=1e-5), name

    # Batches of 3 rows: pieces of one example land in different batches; the sums combine exactly.
    auxes = [losses(model, b, "example")["full"][1] for b in loader_batches(packed, 3)]
    combined = sum(float(a["example_nll_sum"]) for a in auxes) / sum(float(a["examples"]) for a in auxes)
    assert combined == pytest.approx(example_ref, rel=1e-5)
    assert sum(float(a["examples"]) for a in auxes) == pytest.approx(len(reference), rel=1e-5)
    assert any(float(a["examples"]) != round(float(a["examples"])) for a in auxes)  # some batch holds part of an example


# ----------------------------------------------------------------------------- options and metrics


def test_example_mean_refuses_the_tunix_default_loss() -> None:
    cfg = TrainConfig(shards="unused", loss="tunix-default", loss_mean="example")
    with pytest.raises(TrainError, match=r"^--loss-mean example needs --loss masked \(tunix-default is a token mean only\)$"):
        memory_path.check_options(cfg, MAX_LENGTH)
    with pytest.raises(TrainError, match=r"^unknown --loss-mean 'batch'; choose one of token, example$"):
        memory_path.check_options(TrainConfig(shards="unused", loss_mean="batch"), MAX_LENGTH)


def test_metrics_name_the_mean_and_eval_uses_it(tmp_path) -> None:
    rec = MetricsRecorder(str(tmp_path / "m.jsonl"), static={"loss_mean": "example"}, log_every=0)
    rec.batch_arrived({"segment_ids": np.array([[1, 1, 2, 2]]), "loss_mask": np.array([[0, 1, 0, 1]])})
    rec.step_done({"loss": 2.0, "nll_sum": 6.0, "target_tokens": 2.0, "example_nll_sum": 4.0, "examples": 2.0})
    step = rec.steps[-1]
    assert (step["loss_mean"], step["loss"], step["token_loss"], step["device_examples"]) == ("example", 2.0, 3.0, 2.0)
    # Eval over two batches: the example mean over the whole set, not the mean of batch means.
    rec.eval_batch_done({"loss": 1.0, "nll_sum": 9.0, "target_tokens": 9.0, "example_nll_sum": 1.0, "examples": 1.0})
    rec.eval_batch_done({"loss": 3.0, "nll_sum": 3.0, "target_tokens": 1.0, "example_nll_sum": 9.0, "examples": 3.0})
    rec.eval_done(0.1)
    assert (rec.evals[-1]["loss"], rec.evals[-1]["loss_mean"], rec.evals[-1]["mean_batch_loss"]) == (2.5, "example", 2.0)
    assert rec.summary()["loss_mean"] == "example"


def test_a_checkpoint_from_before_the_option_resumes_only_with_the_token_mean() -> None:
    from train.checkpointing.checkpoints import identity_differences

    saved = {"model": "tiny", "loss": "masked"}  # run.json written before --loss-mean existed
    assert identity_differences(saved, {"model": "tiny", "loss": "masked", "loss_mean": "token"}) == []
    assert identity_differences(saved, {"model": "tiny", "loss": "masked", "loss_mean": "example"}) == [
        "--loss-mean: checkpoint 'token', now 'example'"]
    assert identity_differences({**saved, "loss_mean": "example"}, {**saved, "loss_mean": "token"}) == [
        "--loss-mean: checkpoint 'example', now 'token'"]
