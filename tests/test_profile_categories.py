"""benchmarks/profile_categories.py: a TPU profile's ops put in categories by their HLO text.

The op names below are the shapes of the ones a v5e profile of `prepack train` (Gemma3 270M,
(8, 2048), LoRA rank 8) holds; the table's seconds add up to the steps' span, a control-flow op
counts only its own time, and the time between steps is host gap.
"""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import profile_categories as pc

DIMS = pc.Dims(rank=8, vocab=262144)
OPS = {
    "%fusion.1 = bf16[1024,262144]{1,0} fusion(bf16[1024,640]{1,0} %a, bf16[262144,640]{1,0} %w), kind=kOutput, calls=%c1": "head and loss",
    '%splash_mqa_fwd_residuals.3 = (f32[512,128]{1,0}) custom-call(bf16[1,1024,640]{2,1,0} %q), custom_call_target="tpu_custom_call"': "head and loss",
    '%flash_dkv.7 = (f32[8,4,2048,256]{3,2,1,0}) custom-call(bf16[8,4,2048,256]{3,2,1,0} %k), custom_call_target="tpu_custom_call"': "attention",
    "%fusion.9 = bf16[8,2048,8]{2,1,0} fusion(f32[2048,8]{1,0} %a, bf16[8,2048,2048]{2,1,0} %x), kind=kOutput, calls=%c9": "LoRA matmuls",
    "%convolution_add_fusion.2 = bf16[8,2048,640]{2,1,0} fusion(bf16[640,2048]{1,0} %w, bf16[8,2048,2048]{2,1,0} %x), kind=kOutput, calls=%c2": "base matmuls",
    "%copy-done.12 = bf16[1024]{0} copy-done((bf16[1024]{0}, u32[]) %copy-start.12)": "copies and transposes",
    "%reduce.4 = bf16[8,2048,256]{2,1,0} reduce(f32[8,4,2048,256]{3,2,1,0} %g, f32[] %z), dimensions={1}": "attention",
    "%multiply_add_fusion.5 = f32[640]{0} fusion(f32[640]{0} %m, f32[640]{0} %v), kind=kLoop, calls=%c5": "norms and elementwise",
}


@pytest.mark.parametrize("name,expected", OPS.items())
def test_each_op_is_put_in_its_category(name: str, expected: str) -> None:
    assert pc.category(name, DIMS) == expected


def test_the_table_adds_up_to_the_steps_and_counts_gaps_and_loop_bodies_once(tmp_path) -> None:
    names = list(OPS)
    ops, modules = [], []
    for step in range(4):  # 4 steps of 100 us, 20 us apart: the first traced one is left out, the last ends the third
        t0 = step * 120_000
        modules.append({"name": "jit_train_step(1)", "start_ns": t0, "duration_ns": 100_000, "stats": {}})
        # a while op spanning two of its body's ops: only its own 10 us count for it
        ops.append({"name": "%while.1 = (s32[]) while((s32[]) %t), condition=%c, body=%b", "start_ns": t0, "duration_ns": 50_000, "stats": {}})
        ops.append({"name": names[0], "start_ns": t0, "duration_ns": 25_000, "stats": {}})
        ops.append({"name": names[3], "start_ns": t0 + 25_000, "duration_ns": 15_000, "stats": {}})
        ops.append({"name": names[4], "start_ns": t0 + 50_000, "duration_ns": 40_000, "stats": {}})
    events = tmp_path / "events.json.gz"
    with gzip.open(events, "wt") as f:
        json.dump({"planes": [{"name": "/device:TPU:0", "lines": [
            {"name": "XLA Modules", "events": modules}, {"name": "XLA Ops", "events": ops}]}]}, f)
    result = pc.table(str(events), DIMS, None)
    assert result["steps"] == 2
    per = result["seconds_per_step"]
    assert per["head and loss"] == pytest.approx(25e-6) and per["LoRA matmuls"] == pytest.approx(15e-6)
    assert per["base matmuls"] == pytest.approx(40e-6) and per["norms and elementwise"] == pytest.approx(10e-6)
    # 120 us from one step's start to the next, of which 90 busy
    assert per["host gaps"] == pytest.approx(30e-6) and result["step_s"] == pytest.approx(120e-6)
    assert sum(per.values()) == pytest.approx(result["step_s"])
