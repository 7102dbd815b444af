"""`prepack train --plan-memory`, `--remat none|layer|auto` and the planned memory of the memory path.

Tiny configs only (the real-model plans are benchmarks/bench_memory_path.py's): the plan's last
line is the JSON the issue names, the budget decides "fits", auto switches remat on exactly when
the step without it does not fit, remat changes neither loss nor gradients, and the chunked loss
and blocked attention plan less than full logits and the dense mask.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest
from flax import nnx

from testkit import train_batches as testing
from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from train import cli, memory_plan
from train.measurement import compiled
from train.model import models
from train.run_config.config import TrainConfig
from train.run_setup import setup
from train.step import memory_path, model_inputs

VOCAB = 4096
MAX_LENGTH = 256


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("plan") / "L256")
    build_shard_set(path, num_rows=8, max_length=MAX_LENGTH, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": VOCAB})
    return path


def plan_json(capsys, *args) -> tuple[dict, str]:
    assert cli.main(["--model", "tiny-qwen3", "--lora-rank", "4", "--plan-memory", *args]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    return json.loads(out[-1]), "\n".join(out)


def test_plan_memory_prints_the_plan_and_ends_with_its_json(shards, capsys) -> None:
    result, text = plan_json(capsys, "--shards", shards, "--batch-size", "2", "--memory-budget-gib", "64")
    assert {"argument_bytes", "temp_bytes", "peak_bytes", "flops"} <= set(result)
    assert result["argument_bytes"] > 0 and result["temp_bytes"] > 0 and result["flops"] > 0
    assert result["peak_bytes"] >= result["temp_bytes"]
    assert result["fits"] is True and "fits" in text and "B=2 L=256" in text
    small, text = plan_json(capsys, "--shards", shards, "--batch-size", "2", "--memory-budget-gib", "0.001", "--remat", "none")
    assert small["fits"] is False and "does NOT fit" in text


def test_bad_budget_is_refused_with_one_line(shards, capsys) -> None:
    assert cli.main(["--shards", shards, "--model", "tiny-qwen3", "--plan-memory", "--memory-budget-gib", "0"]) == 2
    assert capsys.readouterr().err == "prepack train: --memory-budget-gib must be a finite number of GiB above 0, got 0.0\n"


def test_remat_auto_rematerialises_only_when_the_step_does_not_fit(shards) -> None:
    out = open("/dev/null", "w")
    base = dict(shards=shards, model="tiny-qwen3", lora_rank=4, batch_size=2, steps=1, remat="auto")
    roomy = setup(TrainConfig(**base, memory_budget_gib=64.0), out=out)
    assert memory_plan.choose_remat(roomy, out) is not None and not memory_path.remat_is_on(roomy.built.model)
    tight = setup(TrainConfig(**base, memory_budget_gib=0.001), out=out)
    memory_plan.choose_remat(tight, out)
    assert memory_path.remat_is_on(tight.built.model)


def test_remat_auto_takes_a_compile_that_ran_out_of_memory_as_does_not_fit(shards, monkeypatch) -> None:
    """A TPU's compiler refuses a program that does not fit (RESOURCE_EXHAUSTED while compiling):
    --remat auto then remats, planning the step again with it, instead of ending the run."""
    import io

    out = io.StringIO()
    run = setup(TrainConfig(shards=shards, model="tiny-qwen3", lora_rank=4, batch_size=2, steps=1, remat="auto",
                            memory_budget_gib=64.0), out=out)
    real, calls = memory_plan.plan_run_step, []

    def compile_fails_without_remat(s, lowered=None):
        calls.append(memory_path.remat_is_on(s.built.model))
        if not calls[-1]:
            raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 19.2G of 15.75G hbm.")
        return real(s, lowered)

    monkeypatch.setattr(memory_plan, "plan_run_step", compile_fails_without_remat)
    choice = memory_plan.choose_remat(run, out)
    assert calls == [False, True] and choice.remat_on and memory_path.remat_is_on(run.built.model)
    assert ("--remat auto: the step plans more than the device holds (its compiler ran out of memory) without remat"
            in out.getvalue())

    def other_failure(s, lowered=None):
        raise jax.errors.JaxRuntimeError("INTERNAL: Mosaic failed to compile")

    monkeypatch.setattr(memory_plan, "plan_run_step", other_failure)
    again = setup(TrainConfig(shards=shards, model="tiny-qwen3", lora_rank=4, batch_size=2, steps=1, remat="auto"), out=out)
    with pytest.raises(jax.errors.JaxRuntimeError, match="Mosaic"):
        memory_plan.choose_remat(again, out)


@dataclasses.dataclass(frozen=True)
class StepResult:
    loss: float
    grads: list[np.ndarray]
    temp_bytes: int
    program_chars: int


def _compiled_step(model, batch, kind) -> StepResult:
    """The LoRA loss and gradients' program for `model` as it is now: its size as lowered, XLA's CPU plan, its results."""
    from train.step import loss as loss_lib

    inputs = model_inputs.make_gen_model_input_fn(attention=kind)(batch)
    fn = nnx.jit(nnx.value_and_grad(loss_lib.masked_loss_fn_with_aux, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    lowered = fn.lower(model, **inputs)
    temp = lowered.compile().memory_analysis().temp_size_in_bytes
    (loss, _), grads = fn(model, **inputs)
    return StepResult(float(loss), [np.asarray(g) for g in jax.tree.leaves(grads)], temp, len(lowered.as_text()))


LOOP, REMAT, SCAN = "Tunix's loop", "--remat layer", "--scan-layers"

# (attention, layers, layers more for the program-size test) per model. Gemma3 at 14 layers: 2 periods of
# 5 local + 1 global, then 2 local layers after the scan's loop (fewer than 12 is one period: no scan at all);
# Qwen3's period is one layer, and 4 of them are enough for remat to plan clearly less than the loop.
LAYER_CASES = {"tiny-gemma3": ("dense", 14, 6), "tiny-qwen3": ("blocked", 4, 2)}


class LayerVariants:
    """One LoRA model and batch, its step compiled once per way of running its layers (Tunix's loop,
    --remat layer, --scan-layers), shared by the remat and scan tests below: the loop is their common
    reference, so it compiles once, not once per test."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.kind, self.layers, self.more = LAYER_CASES[name]
        self.model = _lora_model(name, self.kind, self.layers)
        self.batch = _scan_batch()
        self._results: dict[str, StepResult] = {}

    def of(self, mode: str) -> StepResult:
        if mode not in self._results:
            memory_path.set_remat(self.model, mode == REMAT, scan_layers=mode == SCAN)
            assert memory_path.remat_is_on(self.model) == (mode == REMAT)  # --scan-layers alone is no remat
            self._results[mode] = _compiled_step(self.model, self.batch, self.kind)
        return self._results[mode]


@pytest.fixture(scope="module")
def layer_variants():
    made: dict[str, LayerVariants] = {}

    def of(name: str) -> LayerVariants:
        if name not in made:
            made[name] = LayerVariants(name)
        return made[name]

    return of


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_layer_remat_keeps_loss_and_gradients_and_plans_less(layer_variants, name) -> None:
    """--remat layer scans the layers with a checkpointed body: the same loss and gradients, and
    XLA's CPU plan holds less (Tunix's per-layer nnx.remat planned the same bytes as none)."""
    variants = layer_variants(name)
    loop, remat = variants.of(LOOP), variants.of(REMAT)
    print(f"\n{name} {variants.kind}: temp without remat {compiled.fmt_bytes(loop.temp_bytes)}, "
          f"with {compiled.fmt_bytes(remat.temp_bytes)}")
    assert remat.temp_bytes < 0.75 * loop.temp_bytes
    assert remat.loss == pytest.approx(loop.loss, rel=1e-6)
    for a, b in zip(remat.grads, loop.grads):
        np.testing.assert_allclose(a, b, atol=1e-6)


def test_layer_scan_refuses_layers_of_different_structure() -> None:
    from train.step import layer_scan

    gemma = models.apply_lora(models.build_model("tiny-gemma3", vocab_size=256).model, models.get_spec("tiny-gemma3"), rank=4)
    qwen = models.apply_lora(models.build_model("tiny-qwen3", vocab_size=256).model, models.get_spec("tiny-qwen3"), rank=4)
    x = np.zeros((1, 8, 64), np.float32)
    with pytest.raises(ValueError, match="do not share one state structure"):
        layer_scan.scan_layers([gemma.layers[0], qwen.layers[0]], x, None, None, None)


def test_chunked_loss_and_blocked_attention_plan_less_than_full_logits_and_the_dense_mask(shards) -> None:
    out = open("/dev/null", "w")
    # Tiny Qwen3 (2 layers) rather than Gemma3 (6): what is planned away is the [B, L, vocab] logits and
    # [B, L, L] mask, which no layer count changes; fewer layers compile faster.
    base = dict(shards=shards, model="tiny-qwen3", lora_rank=4, batch_size=4, steps=1)
    reference = setup(TrainConfig(**base, loss_chunk_tokens=0, attention="dense"), out=out)
    path = setup(TrainConfig(**base, loss_chunk_tokens=256, attention="blocked"), out=out)
    ref_plan = memory_plan.plan_step(reference.trainer, 4, MAX_LENGTH)
    new_plan = memory_plan.plan_step(path.trainer, 4, MAX_LENGTH)
    logits_bytes = 4 * MAX_LENGTH * VOCAB * 4
    print(f"\ntemp: full logits + dense {compiled.fmt_bytes(ref_plan.temp_bytes)}, "
          f"chunked + blocked {compiled.fmt_bytes(new_plan.temp_bytes)}")
    assert ref_plan.temp_bytes - new_plan.temp_bytes >= logits_bytes


def test_remat_auto_remembers_a_step_that_did_not_fit_and_skips_its_compile_next_time(shards, tmp_path, monkeypatch) -> None:
    """The refused (or over-budget) compile without remat is paid once per step, cache folder and budget:
    a later run lowers the step, finds the verdict beside the cache and compiles only the step with remat."""
    import io

    real, compiles = memory_plan.plan_without_remat, []

    def counted(*args):
        compiles.append(args)
        return real(*args)

    monkeypatch.setattr(memory_plan, "plan_without_remat", counted)
    # What is counted is which compiles the runs ask for (plan_without_remat), not XLA's work: each of the
    # two programs (without remat, with it) is compiled once here and its plan given to every later run
    # that asks (the eight runs below would otherwise compile six times; the cache folder changes, and off).
    real_plan, plans = memory_plan.plan_run_step, {}

    def plan_once(run, lowered=None):
        remat_on = memory_path.remat_is_on(run.built.model)
        if remat_on not in plans:
            plans[remat_on] = real_plan(run, lowered)
        return plans[remat_on]

    monkeypatch.setattr(memory_plan, "plan_run_step", plan_once)
    from train.compilation import unfit_steps

    real_key, keys = unfit_steps.step_key, []  # the key prints the whole lowered step: computed only when needed
    monkeypatch.setattr(unfit_steps, "step_key", lambda lowered: keys.append(lowered) or real_key(lowered))
    base = dict(shards=shards, model="tiny-qwen3", lora_rank=4, batch_size=2, steps=1, remat="auto",
                compile_cache=str(tmp_path / "xla"))

    def choose(budget_gib: float, **options) -> tuple[bool, str]:
        out = io.StringIO()
        run = setup(TrainConfig(**{**base, "memory_budget_gib": budget_gib, **options}), out=out)
        return memory_plan.choose_remat(run, out).remat_on, out.getvalue()

    on, first = choose(0.001)
    assert on and len(compiles) == 1 and "remembered" not in first
    assert len(keys) == 1  # to write the verdict down; no verdict was there to look up
    (verdict,) = (tmp_path / "xla" / "prepack-unfit-steps").iterdir()
    on, second = choose(0.001)
    assert on and len(compiles) == 1 and len(keys) == 2  # looked up, and no compile without remat this time
    assert f"(remembered from an earlier run: {verdict}; delete it to plan again)" in second
    assert "rematerialising each layer" in second
    on, _ = choose(0.0005)  # a smaller budget: the verdict covers it
    assert on and len(compiles) == 1
    on, roomy = choose(64.0)  # a larger one: planned again, and it fits
    assert not on and len(compiles) == 2 and "remembered" not in roomy
    verdict.write_text(verdict.read_text().replace('"budget_bytes": ', '"budget_bytes": "'))  # a stranger's edit
    on, _ = choose(0.001)
    assert on and len(compiles) == 3  # an invalid verdict is ignored: planned again (and written anew)
    choose(0.001, compile_cache="off")
    assert len(compiles) == 4  # off: nothing remembered, nothing read
    blocked = tmp_path / "blocked"
    blocked.mkdir()
    (blocked / "prepack-unfit-steps").write_text("a file where the folder goes")
    on, said = choose(0.001, compile_cache=str(blocked))
    assert on and len(compiles) == 5  # the run goes on with remat; only the memory is lost
    assert "--remat auto: could not remember that the step does not fit without remat (" in said


def _lora_model(name: str, kind: str, layers: int):
    from train.attention_kernels import attention

    built = models.build_model(name, vocab_size=256, seed=1, config_overrides={"num_layers": layers})
    model = models.apply_lora(built.model, built.spec, rank=4)
    attention.install(model, kind, 64)
    rng = np.random.default_rng(0)
    nnx.update(model, jax.tree.map(lambda x: x + 0.1 * rng.normal(size=x.shape).astype(x.dtype), nnx.state(model, nnx.LoRAParam)))
    return model


def _program_chars(model, batch, kind) -> int:
    from train.step import loss as loss_lib

    inputs = model_inputs.make_gen_model_input_fn(attention=kind)(batch)
    fn = nnx.jit(nnx.value_and_grad(loss_lib.masked_loss_fn_with_aux, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True))
    return len(fn.lower(model, **inputs).as_text())


SCAN_BATCH = dict(examples=([100, 60, 90], 256), rows=((0, 1), (2,)), length=192)


def _scan_batch():
    return testing.packed_batch(testing.make_examples(*SCAN_BATCH["examples"], seed=1), SCAN_BATCH["rows"], SCAN_BATCH["length"])


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_scan_layers_keeps_loss_and_gradients(layer_variants, name) -> None:
    """--scan-layers: the layers' period as one scan's body, no remat (Gemma3 at 14 layers: 2 periods of
    5 local + 1 global, then 2 local layers after the loop): the same loss and gradients as Tunix's loop."""
    variants = layer_variants(name)
    loop, scanned = variants.of(LOOP), variants.of(SCAN)
    assert scanned.loss == pytest.approx(loop.loss, rel=1e-6)
    for a, b in zip(scanned.grads, loop.grads):
        np.testing.assert_allclose(a, b, atol=1e-6)
    memory_path.set_remat(variants.model, True, scan_layers=True)  # remat wins: --remat layer always scans, with remat
    assert memory_path.remat_is_on(variants.model)


@pytest.mark.parametrize("name", list(LAYER_CASES))
def test_scan_layers_program_grows_by_a_fraction_of_a_period_per_period(layer_variants, name) -> None:
    """What makes the scanned program compile and load faster: a period more adds its layers to the
    unrolled program, and to the scanned one only the stacking of their weights."""
    variants = layer_variants(name)
    batch, kind, more = variants.batch, variants.kind, variants.more

    larger = _lora_model(name, kind, variants.layers + more)

    def chars(scanned: bool) -> int:  # the larger model's program, lowered only (its size is the question)
        memory_path.set_remat(larger, False, scan_layers=scanned)
        return _program_chars(larger, batch, kind)

    unrolled = chars(False) - variants.of(LOOP).program_chars
    scanned = chars(True) - variants.of(SCAN).program_chars
    print(f"\n{name}: {more} layers more add {unrolled:,} characters unrolled, {scanned:,} scanned")
    assert 0 < scanned < 0.3 * unrolled


def test_the_layers_period_is_the_shortest_repeating_one() -> None:
    from train.step import layer_scan

    local, glob = "local", "global"
    assert layer_scan.period([local] * 5 + [glob]) == 6
    assert layer_scan.period(([local] * 5 + [glob]) * 4 + [local] * 2) == 6  # Gemma3 1B: 26 layers
    assert layer_scan.period([None] * 28) == 1  # Qwen3
    assert layer_scan.period([local, glob, glob]) == 3


def test_a_run_resolves_its_choices_once(shards, tmp_path, monkeypatch) -> None:
    """train/resolved_run.py: the objective is looked up once a run, and the model, attention kind, compute
    dtype and cache folder setup carries are what the run records and the cache JAX was given."""
    import io

    from train import objectives

    real, lookups = objectives.of, []
    monkeypatch.setattr(objectives, "of", lambda cfg: lookups.append(cfg) or real(cfg))
    cache = tmp_path / "xla"
    base = dict(shards=shards, model="tiny-qwen3", lora_rank=4, batch_size=2, steps=1, attention="dense", dtype="bfloat16")
    s = setup(TrainConfig(**base, compile_cache=str(cache)), out=io.StringIO())
    assert len(lookups) == 1
    assert s.run.objective is objectives.DEFAULT and s.run.spec is models.get_spec("tiny-qwen3") and s.run.family.name == "qwen3"
    assert (s.run.attention, s.run.dtype_name) == ("dense", "bfloat16") == (s.static["attention"], s.static["dtype"])
    assert s.run.cache_folder == str(cache) == jax.config.jax_compilation_cache_dir
    assert setup(TrainConfig(**base, compile_cache="off"), out=io.StringIO()).run.cache_folder is None
