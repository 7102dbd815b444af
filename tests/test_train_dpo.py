"""`prepack train --objective dpo` (train/objectives/dpo_loss.py): packed DPO equals Tunix's own DPO.

On the same pairs, the packed DPO loss, TRL's metrics and the LoRA gradients equal Tunix 0.1.7's
DPOTrainer (its `_prepare_inputs` with a reference model, its `dpo_loss_fn`, on its padded
batches) to float32 rounding; each way of breaking the pairing (sides swapped, a pair split over
two rows, the reference pass left with LoRA on) fails that comparison; step 1 (LoRA's B at zero)
has every reward 0 and the loss ln 2; --grad-accum-steps is exact over pairs (the tiny model's
tests share one module-scoped model and one compiled step wherever their shapes agree); the flags and sets
each objective refuses; the JSONL's TRL names and the report page; the same equality on pairs
packed by the job with Gemma 3's tokenizer (tiny Gemma3 at its 262k vocabulary, blocked attention).
"""

from __future__ import annotations

import io
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import loaders
from prepack.format import rowformat
from testkit import tunix_dpo as td
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from train import cli, memory_plan, objectives
from train.measurement import metrics
from train.model import models
from train.objectives import dpo_loss
from train.objectives import dpo_metrics

VOCAB = 96
L = 96
BETA = 0.1
PAIRS = td.random_pairs(8, VOCAB, seed=0)
PLAN = ((0, 1), (2, 3, 4), (5, 6, 7))  # three rows of 2-3 pairs
# Tunix's aux names -> TRL's (train/objectives/dpo_metrics.py)
TUNIX_NAMES = {"rewards/chosen": "rewards/chosen", "rewards/rejected": "rewards/rejected",
               "rewards/margin": "rewards/margins", "rewards/accuracy": "rewards/accuracies",
               "log_probs/chosen": "logps/chosen", "log_probs/rejected": "logps/rejected"}
# float32 rounding: measured differences are ~1e-7 relative on the loss and <= 2e-6 of the largest
# gradient entry (tiny Gemma3); the tolerance is 10x that, and each break misses by far more.
LOSS_RTOL = 1e-5
GRAD_TOL = 2e-5  # of the largest |gradient| entry


def lora_policy(name: str = "tiny-gemma3", seed: int = 5) -> tuple[nnx.Module, nnx.Module]:
    """(a LoRA model whose A and B are random, so the policy differs from the reference and both
    factors get gradients; the same base without LoRA: Tunix's reference model)."""
    built = models.build_model(name, vocab_size=VOCAB, seed=1)
    reference = nnx.clone(built.model)
    policy = models.apply_lora(built.model, built.spec, rank=4, seed=3)
    rng = np.random.default_rng(seed)
    state = nnx.state(policy, nnx.LoRAParam)
    nnx.update(policy, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), state))
    return policy, reference


@pytest.fixture(scope="module")
def pair():
    return lora_policy()


@pytest.fixture(scope="module")
def tunix(pair):
    policy, reference = pair
    rows = td.pair_rows(PAIRS, PLAN, L)
    return td.tunix_loss_and_grads(nnx.clone(policy), reference, td.pairs_of_rows(rows), BETA)


def errors(ours: tuple[dict, dict], tunix: tuple[float, dict, dict]) -> tuple[float, float]:
    """(relative loss error, largest gradient error over the largest |gradient|)."""
    (aux, grads), (loss, _, tgrads) = ours, tunix
    scale = max(float(np.abs(g).max()) for g in tgrads.values())
    assert scale > 1e-3 and set(grads) == set(tgrads)
    return abs(aux["loss"] - loss) / abs(loss), max(float(np.abs(grads[k] - tgrads[k]).max()) for k in tgrads) / scale


# Tiny Gemma3, dense attention, the chunked loss; the job-packed pairs' test below runs blocked attention
# with another chunk size, and the attention kinds' equality with dense is SFT's tests'.
CHUNK = 16


@pytest.fixture(scope="module")
def packed(pair):
    """Our step on the rows Tunix's fixture reads: (aux, LoRA gradients)."""
    policy, _ = pair
    return td.packed_step(nnx.clone(policy), td.pair_rows(PAIRS, PLAN, L), BETA, chunk_tokens=CHUNK)


def test_packed_dpo_equals_tunix_dpo_trainer(packed, tunix) -> None:
    aux, grads = packed
    loss_err, grad_err = errors((aux, grads), tunix)
    print(f"\ndense chunk {CHUNK}: loss {aux['loss']:.8f} vs Tunix {tunix[0]:.8f}, gradient error {grad_err:.1e}")
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_TOL
    assert aux["pairs"] == len(PAIRS) and aux["target_tokens"] == sum(len(p.chosen) + len(p.rejected) for p in PAIRS)
    ours = dpo_metrics.trl_metrics(aux)
    for tunix_name, trl_name in TUNIX_NAMES.items():
        assert ours[trl_name] == pytest.approx(tunix[1][tunix_name], rel=1e-4, abs=1e-6), trl_name
    assert 0 < ours["rewards/accuracies"] < 1  # the pairs are random: the comparison covers both outcomes


def swapped_sides(rows: dict) -> tuple[dict, None]:
    rows = {k: v.copy() for k, v in rows.items()}
    real = rows["pair_side"] != 0
    rows["pair_side"][real] = 3 - rows["pair_side"][real]
    return rows, None


def split_pair(rows: dict) -> tuple[dict, None]:
    """Pair 4 (row 2's last) begun at the end of row 1 and ended at the start of row 3: what the job never writes."""
    layout = [[(i, s) for i in row for s in (1, 2)] for row in PLAN]
    layout[1] = layout[1][:-2] + [(4, 1)]
    layout[2] = [(4, 2)] + layout[2]
    return td.side_rows(PAIRS, layout, L), None


def lora_on(model: nnx.Module) -> nnx.Module:
    return model  # the "reference" is the policy itself


def reference_with_lora_on(rows: dict) -> tuple[dict, object]:
    return rows, lora_on


@pytest.mark.parametrize("break_", [swapped_sides, split_pair, reference_with_lora_on], ids=lambda f: f.__name__)
def test_each_break_of_the_pairing_fails_the_comparison(pair, tunix, break_) -> None:
    policy, _ = pair
    rows, reference = break_(td.pair_rows(PAIRS, PLAN, L))
    aux, grads = td.packed_step(nnx.clone(policy), rows, BETA, chunk_tokens=CHUNK, reference=reference)
    loss_err, grad_err = errors((aux, grads), tunix)
    print(f"\n{break_.__name__}: loss {aux['loss']:.6f} vs Tunix {tunix[0]:.6f} (rel {loss_err:.1e}), gradient error {grad_err:.1e}")
    assert loss_err > 100 * LOSS_RTOL or grad_err > 100 * GRAD_TOL
    if break_ is split_pair:  # and the row rules the trainer and verify share refuse such rows
        fault = rowformat.row_fault(rows, rowformat.RowFacts(rowformat.PAIR_FORMAT_VERSION))
        assert fault is not None and fault.rule in (rowformat.RULE_PAIR_WHOLE, rowformat.RULE_PAIR_SIDE)


# At step 1 the policy computes what the reference does, up to XLA's rounding: the policy's pass
# is compiled with a backward and the reference's without, so their fusions may differ (measured
# on tiny Qwen3: rewards of +-1e-7; bitwise 0 on tiny Gemma3). Summed log-probs of ~-30 have an
# ulp of 2e-6, times beta 0.1.
STEP_ONE_REWARD_TOL = 1e-6


def test_step_one_every_reward_is_zero_and_the_loss_ln2(pair) -> None:
    """With LoRA's B at zero (qwix's init; the end-to-end run below starts from it) the policy is
    the reference. The fixture's model with B zeroed: the same structure, so the same compiled step."""
    model = nnx.clone(pair[0])
    state = nnx.state(model, nnx.LoRAParam)
    is_b = lambda path: "lora_b" in jax.tree_util.keystr(path)  # qwix's <kernel>_lora_b
    assert 0 < sum(is_b(p) for p, _ in jax.tree_util.tree_leaves_with_path(state)) < len(jax.tree.leaves(state))
    nnx.update(model, jax.tree_util.tree_map_with_path(lambda path, x: jnp.zeros_like(x) if is_b(path) else x, state))
    aux, grads = td.packed_step(model, td.pair_rows(PAIRS, PLAN, L), BETA, chunk_tokens=CHUNK)
    got = dpo_metrics.trl_metrics(aux)
    print("\nstep 1: loss " + repr(aux["loss"]) + ", " + ", ".join(f"{k} {got[k]!r}" for k in dpo_metrics.TRL_NAMES))
    assert aux["loss"] == pytest.approx(math.log(2), abs=STEP_ONE_REWARD_TOL)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
        assert abs(got[key]) <= STEP_ONE_REWARD_TOL, key
    assert got["logps/chosen"] < -10 and got["logps/rejected"] < -10
    assert max(float(np.abs(g).max()) for g in grads.values()) > 0  # B's gradient is not zero: training can start


def only_row(rows: dict, r: int) -> dict:
    """The batch with every row but r made padding (segment 0, no target): the same shape."""
    keep = (np.arange(rows["segment_ids"].shape[0]) == r)[:, None]
    return {k: np.where(keep, v, 0).astype(v.dtype) for k, v in rows.items()}


def test_accumulation_is_the_mean_over_every_pair_of_the_k_micro_batches(pair, packed) -> None:
    """The three rows (2, 3 and 3 pairs) as three micro-batches of one row: one step over them
    equals the step over the three rows in one batch (`packed`, itself equal to Tunix's); the mean
    of the three micro-batch means would not be."""
    policy, _ = pair
    rows = td.pair_rows(PAIRS, PLAN, L)
    stacked = {k: v[None] for k, v in rows.items()}  # [B=1, K=3, L]
    acc_aux, acc = td.packed_step(nnx.clone(policy), stacked, BETA, chunk_tokens=CHUNK, accumulate=True)
    one_aux, one = packed
    assert acc_aux["pairs"] == one_aux["pairs"] == len(PAIRS)
    assert acc_aux["loss"] == pytest.approx(one_aux["loss"], rel=1e-6)
    scale = max(float(np.abs(g).max()) for g in one.values())
    assert max(float(np.abs(acc[k] - one[k]).max()) for k in one) <= 1e-5 * scale
    means = [td.packed_step(nnx.clone(policy), only_row(rows, r), BETA, chunk_tokens=CHUNK)[0]["loss"] for r in range(len(PLAN))]
    assert abs(np.mean(means) - one_aux["loss"]) > 100 * 1e-6 * one_aux["loss"]


# ----------------------------------------------------------------------------- the sets, the flags


def pair_set(directory, plan=PLAN) -> str:
    rows = td.pair_rows(PAIRS, plan, L)
    build_shard_set(directory, rows=[{k: v[i] for k, v in rows.items()} for i in range(len(plan))], max_length=L,
                    num_shards=1, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": VOCAB})
    return str(directory)


@pytest.fixture(scope="module")
def sets(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("dpo_sets")
    sft = str(root / "sft")
    build_shard_set(sft, num_rows=4, max_length=L, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": VOCAB})
    return {"pairs": pair_set(root / "pairs"), "sft": sft}


@pytest.mark.parametrize(("shards", "extra", "message"), [
    ("sft", ["--objective", "dpo"], r"--objective dpo needs preference pairs, but --shards \S+ holds single examples "
                                    r"\(row format 1\); pack a preference set with `prepack pack --format preference`"),
    ("pairs", [], r"--shards \S+ holds preference pairs \(row format 5\): train it with --objective dpo; SFT on it would "
                  r"train each pair's rejected reply as a target too"),
    ("pairs", ["--objective", "dpo", "--eval-shards", "SFT"], r"--objective dpo needs preference pairs, but --eval-shards"),
    ("sft", ["--beta", "0.2"], r"^prepack train: --beta is --objective dpo's option, but this run's objective is sft; "
                               r"add --objective dpo or drop --beta$"),
    ("pairs", ["--objective", "dpo", "--beta", "0"], r"--beta must be a positive number, got 0\.0"),
    ("pairs", ["--objective", "dpo", "--beta", "nan"], r"--beta must be a positive number, got nan"),
    ("pairs", ["--objective", "dpo", "--loss", "tunix-default"], r"--loss tunix-default is SFT's"),
    ("pairs", ["--objective", "dpo", "--loss-mean", "example"], r"--loss-mean example is SFT's; --objective dpo averages"),
])
def test_each_objective_refuses_the_others_sets_and_flags(sets, capsys, shards, extra, message) -> None:
    import re

    extra = [sets["sft"] if a == "SFT" else a for a in extra]
    assert cli.main(["--shards", sets[shards], "--model", "tiny", "--steps", "1", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert "loading" not in err  # refused before any weights load


def test_the_registry_refuses_an_option_of_an_objective_not_chosen(monkeypatch) -> None:
    """Each objective declares its own options and the registry refuses them for any other, so a third
    objective with an option of its own is refused for SFT and DPO without either naming it."""
    from types import SimpleNamespace

    from train.run_config.config import TrainError

    third = SimpleNamespace(name="orpo", options={"--lambda": "lam"})
    monkeypatch.setitem(objectives.REGISTRY, "orpo", third)
    for chosen in ("sft", "dpo"):
        with pytest.raises(TrainError, match=rf"^--lambda is --objective orpo's option, but this run's objective is "
                                             rf"{chosen}; add --objective orpo or drop --lambda$"):
            objectives.refuse_others_options(SimpleNamespace(beta=None, lam=0.5), objectives.by_name(chosen))
    with pytest.raises(TrainError, match=r"^--beta is --objective dpo's option, but this run's objective is orpo"):
        objectives.refuse_others_options(SimpleNamespace(beta=0.2, lam=0.5), third)
    objectives.refuse_others_options(SimpleNamespace(beta=0.2, lam=None), objectives.by_name("dpo"))  # its own: fine
    assert not objectives.by_name("sft").options and objectives.by_name("dpo").options == {"--beta": "beta"}


def test_the_loader_yields_pair_side(sets) -> None:
    ds = loaders.make_dataset(sets["pairs"], batch_size=3, seed=0)
    batch = next(iter(ds))
    assert "pair_side" in batch and batch["pair_side"].shape == (3, L)
    seg = batch["segment_ids"]
    assert np.array_equal(batch["pair_side"], np.where(seg == 0, 0, 2 - seg % 2))
    assert metrics.batch_counts(batch, objectives.DPO.segments_per_example)["examples"] == len(PAIRS)  # a pair is one example
    from train.step.model_inputs import device_fields

    assert "pair_side" in device_fields(batch)


def test_a_dpo_record_carries_trls_names_at_the_top_level() -> None:
    recorder = metrics.MetricsRecorder(None, static={"loss_mean": "pair"}, out=io.StringIO(), objective=objectives.DPO)
    recorder.batch_arrived({"segment_ids": np.array([[1, 1, 2, 2, 3, 3, 4, 4]]), "loss_mask": np.array([[0, 1, 0, 1, 0, 1, 0, 1]]),
                            "pair_side": np.array([[1, 1, 2, 2, 1, 1, 2, 2]])})
    aux = {"loss": 0.5, "grad_norm": 1.0, "target_tokens": 4.0, dpo_metrics.PAIRS: 2.0, dpo_metrics.LOSS_SUM: 1.0,
           dpo_metrics.CHOSEN_REWARDS_SUM: 0.3, dpo_metrics.REJECTED_REWARDS_SUM: -0.1, dpo_metrics.ACCURACY_SUM: 1.0,
           dpo_metrics.CHOSEN_LOGPS_SUM: -20.0, dpo_metrics.REJECTED_LOGPS_SUM: -30.0}
    recorder.step_done(aux)
    record = recorder.steps[0]
    assert record["examples"] == 2 and record["device_pairs"] == 2 and record["loss"] == 0.5
    assert {k: record[k] for k in dpo_metrics.TRL_NAMES} == pytest.approx({
        "rewards/chosen": 0.15, "rewards/rejected": -0.05, "rewards/accuracies": 0.5, "rewards/margins": 0.2,
        "logps/chosen": -10.0, "logps/rejected": -15.0})
    assert "(DPO)" in recorder.out.getvalue() and "accuracy 0.50  margin +0.2000" in recorder.out.getvalue()


def test_plan_memory_plans_the_reference_pass(sets, capsys) -> None:
    """The loop-free reference step (dense, full logits, no remat): the analytic count, reference
    pass included, within 10% of XLA's; without the reference part it would fall short of it."""
    args = ["--shards", sets["pairs"], "--model", "tiny", "--objective", "dpo", "--lora-rank", "4", "--batch-size", "2",
            "--plan-memory", "--attention", "dense", "--loss-chunk-tokens", "0", "--remat", "none"]
    assert cli.main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert "DPO (policy forward and backward, reference forward with LoRA off)" in out[0]
    parts = result["flops_parts"]
    assert result["flops"] == pytest.approx(result["xla_flops"], rel=0.10)
    assert result["flops"] - parts["reference"] < 0.9 * result["xla_flops"]
    batch = memory_plan.placeholder_batch(2, L, False, pairs=True)  # one pair a row: the sides, the row's halves
    assert np.array_equal(batch["pair_side"][0], np.repeat([1, 2], L // 2)) and batch["positions"][0, L // 2] == 0


def test_verify_model_runs_each_side_alone(sets) -> None:
    """`prepack verify --model` on a preference set: each side packed equals it alone; a plain
    causal mask (a rejected side seeing its chosen side) fails every rejected side, named by its pair."""
    from testkit.layout_bugs import plain_causal
    from train.verification import parity

    cfg = parity.ParityConfig(model="tiny-gemma3")
    view = loaders.open_shards(sets["pairs"])
    model = parity.build_model(cfg, dict(view.manifest.tokenizer), sets["pairs"]).model
    correct = parity.check_view(model, cfg, view)
    assert correct.ok and len(correct.segments) == 2 * len(PAIRS)
    assert correct.max_abs_diff <= parity.TOLERANCES["float32"] / 10
    broken = parity.check_view(model, cfg, view, packed_layout=plain_causal)
    failed = {(s.label, s.segment) for s in broken.failures}
    assert failed == {(s.label, s.segment) for s in broken.segments if s.segment > 1}
    assert all(s.side.endswith("rejected") for s in broken.failures if s.segment % 2 == 0)
    assert any(", segment 2 (pair 1 rejected):" in line for line in broken.failure_lines(len(broken.failures)))


# ----------------------------------------------------------------------------- end to end


@pytest.mark.slow  # trains: see pytest.ini
def test_prepack_train_objective_dpo_end_to_end(sets, tmp_path) -> None:
    out = str(tmp_path / "dpo.jsonl")
    rc = cli.main(["--shards", sets["pairs"], "--eval-shards", sets["pairs"], "--model", "tiny", "--objective", "dpo",
                   "--beta", "0.1", "--lora-rank", "4", "--batch-size", "1", "--grad-accum-steps", "2", "--steps", "6",
                   "--learning-rate", "1e-2", "--metrics-out", out, "--log-every", "0"])
    assert rc == 0
    lines = [json.loads(line) for line in open(out)]
    steps = [l for l in lines if "step" in l and "loss" in l]
    first = steps[0]
    assert first["loss"] == pytest.approx(math.log(2), abs=STEP_ONE_REWARD_TOL)
    assert all(abs(first[k]) <= STEP_ONE_REWARD_TOL for k in ("rewards/chosen", "rewards/rejected", "rewards/margins"))
    for s in steps:
        assert s["objective"] == "dpo" and s["beta"] == 0.1 and s["loss_mean"] == "pair"
        assert s["device_pairs"] == s["examples"] > 0 and s["device_target_tokens"] == s["target_tokens"]
        assert all(isinstance(s[k], float) for k in dpo_metrics.TRL_NAMES)
    assert steps[-1]["rewards/margins"] > 0 and steps[-1]["loss"] < math.log(2)
    evals = [l["eval"] for l in lines if "eval" in l]
    assert evals[0]["loss"] == pytest.approx(math.log(2), abs=STEP_ONE_REWARD_TOL) and evals[-1]["rewards/accuracies"] is not None
    summary = lines[-1]["summary"]
    assert summary["examples"] == sum(s["examples"] for s in steps)

    from apps import report

    page = str(tmp_path / "page.md")
    assert report.main(["--metrics", out, "--output", page]) == 0
    text = open(page).read()
    assert "### Preference optimisation (DPO)" in text and "rewards/accuracies last" in text and "dpo_rewards.png" in text


# ----------------------------------------------------------------------------- pairs the job packed


@pytest.mark.slow  # runs the packing job: see pytest.ini
def test_packed_dpo_equals_tunix_on_pairs_the_job_packed(tmp_path) -> None:
    """The fixture's pairs through `prepack pack --format preference` with Gemma 3's tokenizer and
    chat format: the packed rows' DPO loss and LoRA gradients against Tunix's DPOTrainer on the same
    pairs, padded, with the chunked loss over Gemma 3's 262,144-token vocabulary. The model is tiny
    Gemma3 sized to that vocabulary: the equality is of two ways of computing one loss on one model,
    whichever weights it holds (on Gemma3 270M's real weights it held within 1.7e-6 relative on the
    loss and 1.5e-5 of the largest gradient, at 130 s and 7.7 GB); Gemma3 270M's real-weight path is
    verify's, generate's and the GGUF loader's tests'. Dense attention, as the fixture's: blocked
    attention's equality with dense is SFT's tests' (outputs, loss and gradients), and the end-to-end
    DPO run above trains with the CPU's default, blocked (its compile here cost 30 s more)."""
    from testkit.pipeline import IN_PROCESS, read_shard_set, write_jsonl
    from testkit.published_schemas import SCHEMAS
    from pipelines.options import parse_args
    from pipelines.launch.job import run

    # The fixture's pairs but the tool call (Gemma 3's format has no tool markup), and the ranking file's.
    records = [r for r in SCHEMAS["preference"].records if "tools" not in r] + [
        {"prompt": r["conversations"][0]["value"], "chosen": r["chosen"]["value"], "rejected": r["rejected"]["value"]}
        for r in SCHEMAS["ranking"].records]
    data = write_jsonl(str(tmp_path / "pairs.jsonl"), records)
    config, beam_args = parse_args(["--input", data, "--format", "preference", "--max-length", "256",
                                    "--output", str(tmp_path / "out"), "--no-progress", *IN_PROCESS])
    run(config, beam_args)
    manifest, rows = read_shard_set(str(tmp_path / "out" / "L256"))
    batch = {k: np.stack([r[k] for r in rows]) for k in rows[0]}
    pairs = td.pairs_of_rows(batch)
    assert len(pairs) == len(records) == 4 and len(rows) == 1  # one row of four pairs

    vocab = int(manifest.tokenizer["vocab_size"])
    assert vocab == 262144
    built = models.build_model("tiny-gemma3", vocab_size=vocab, seed=1)
    reference = nnx.clone(built.model)
    policy = models.apply_lora(built.model, built.spec, rank=4, seed=3)
    rng = np.random.default_rng(0)
    state = nnx.state(policy, nnx.LoRAParam)
    nnx.update(policy, jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape) * 0.1, x.dtype), state))
    tunix = td.tunix_loss_and_grads(nnx.clone(policy), reference, pairs, BETA)
    aux, grads = td.packed_step(nnx.clone(policy), batch, BETA, chunk_tokens=256)
    loss_err, grad_err = errors((aux, grads), tunix)
    print(f"\njob-packed pairs: loss {aux['loss']:.8f} vs Tunix {tunix[0]:.8f} (rel {loss_err:.1e}), gradient error {grad_err:.1e}")
    assert loss_err <= LOSS_RTOL and grad_err <= GRAD_TOL
    ours = dpo_metrics.trl_metrics(aux)
    for tunix_name, trl_name in TUNIX_NAMES.items():
        assert ours[trl_name] == pytest.approx(tunix[1][tunix_name], rel=1e-4, abs=1e-5), trl_name
