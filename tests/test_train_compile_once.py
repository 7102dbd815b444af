"""One compile of the train step before step 1: `--remat auto` (the default) plans from the executable
the run then executes, and step 1's time includes that compile.

The compiles are counted from JAX's monitoring events: each compile of `jit(train_step)` lowers
it to MLIR once, whether XLA then compiles it or the persistent cache answers (conftest.py sets
one for the test run), so the lowering events count the compiles asked for.
"""

from __future__ import annotations

import contextlib
import re

import jax
import pytest

from testkit.shard_sets import TEST_TOKENIZER, build_shard_set
from train import memory_plan, run_setup, trainer
from train.measurement import compiled
from train.run_config.config import TrainConfig
from train.step import train_step

LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("compile-once") / "L64")
    build_shard_set(path, num_rows=4, max_length=64, tokenizer={**TEST_TOKENIZER, "name": "tiny-test", "vocab_size": 512})
    return path


def train_counting_compiles(shards: str, **options) -> tuple[dict, int]:
    """The run's summary and how often `jit(train_step)` was lowered (compiled) in it; --remat
    auto, `prepack train`'s default (TrainConfig's is none), unless `options` say otherwise."""
    options = {"remat": "auto", **options}
    lowered: list[str] = []

    def listen(event: str, duration: float, **kwargs) -> None:
        if event == LOWERING and kwargs.get("fun_name") == "jit(train_step)":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        summary = trainer.run(TrainConfig(shards=shards, model="tiny-qwen3", lora_rank=2, batch_size=1, steps=2,
                                          log_every=1, **options), out=open("/dev/null", "w"))
    finally:
        # Tunix's metrics logger clears every JAX listener when the run closes it.
        with contextlib.suppress(AssertionError):
            jax.monitoring.unregister_event_duration_listener(listen)
    return summary, len(lowered)


def test_remat_auto_compiles_the_step_once_and_step_one_carries_it(shards) -> None:
    summary, compiles = train_counting_compiles(shards)
    assert summary["remat"] == "none" and summary["steps"] == 2
    assert compiles == 1  # it was 2 (the plan's, then step 1's)
    assert summary["remat_auto_plan_s"] > 0
    assert summary["first_step_time_s"] >= summary["remat_auto_plan_s"]
    summary, compiles = train_counting_compiles(shards, remat="none")
    assert compiles == 1 and "remat_auto_plan_s" not in summary


def test_remat_auto_that_switches_remat_on_runs_the_step_it_planned(shards) -> None:
    """Planned without remat, then with it (the run's executable): two compiles, none at step 1."""
    summary, compiles = train_counting_compiles(shards, memory_budget_gib=1e-6)
    assert summary["remat"] == "layer"
    assert compiles == 2
    assert summary["first_step_time_s"] >= summary["remat_auto_plan_s"]


def test_scan_layers_trains_to_the_same_loss_with_one_compile(shards) -> None:
    """`--scan-layers` through the whole trainer: one compile, no remat, the loss of Tunix's own loop."""
    loop, _ = train_counting_compiles(shards, remat="none")
    scanned, compiles = train_counting_compiles(shards, remat="none", scan_layers=True)
    assert compiles == 1 and scanned["remat"] == "none" and scanned["steps"] == 2
    assert scanned["final_loss"] == pytest.approx(loop["final_loss"], rel=1e-6)


def _frozen_weight_copies(shards: str, monkeypatch) -> list[tuple[int, int]]:
    """(copies of a model parameter in the trainer's own compiled step, the model's frozen weights):
    with the trainer's donation, then with Tunix's (the optimizer only). One set-up serves both: the
    trainer's step is jitted once with DONATED, so the second is jitted afresh after clearing it."""
    import jax
    from flax import nnx

    # tiny-qwen3 (24 frozen weights in 2 layers; tiny-gemma3 has 6 to compile): the donation is the trainer's, not the model's.
    s = run_setup.setup(TrainConfig(shards=shards, model="tiny-qwen3", lora_rank=2, batch_size=1, steps=1))
    counts = []
    try:
        frozen = len(jax.tree.leaves(nnx.state(s.built.model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam)))))
        for donated in (train_step.DONATED, ("optimizer",)):
            monkeypatch.setattr(train_step, "DONATED", donated)
            s.trainer.clear_jit_cache()
            text = compiled.program_text(memory_plan.lower_step(s.trainer, 1, 64).compile())
            counts.append((len(re.findall(r" copy\(%model_states", text)), frozen))
    finally:
        s.recorder.close(s.recorder.summary())
    return counts


def test_the_step_donates_the_model_so_no_frozen_weight_is_copied(shards, monkeypatch) -> None:
    """nnx.jit returns every Variable of the model, the frozen base included: undonated (Tunix 0.1.7
    donates the optimizer only), each output was a copy of its input, every step (1.4 ms of a 162 ms
    Gemma3 270M step on a TPU v5e). Donated, none is copied; with Tunix's donation they are back."""
    assert train_step.DONATED == ("model", "optimizer")
    (copies, frozen), (tunix_copies, _) = _frozen_weight_copies(shards, monkeypatch)
    assert frozen > 20 and copies == 0
    assert tunix_copies == frozen
