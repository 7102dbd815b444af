"""benchmarks/bench_adapter_init.py: both key sources traced on one model, the same adapters from each."""

from __future__ import annotations

import json

from benchmarks import bench_adapter_init as bench
from train.model import models


def test_both_variants_trace_the_same_adapters(tmp_path, capsys):
    out = tmp_path / "adapter_init.json"
    assert bench.main(["--model", "tiny-gemma3", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["same_adapters"] is True and result["adapters"] > 0
    assert set(result["median_trace_s"]) == set(bench.VARIANTS)
    assert all(len(t) == 1 and t[0] > 0 for t in result["trace_s"].values())
    assert result["machine"]["backend"] == "cpu" and "--model tiny-gemma3" in result["command"]
    assert models.traced_rngs.__name__ == "traced_rngs"  # the patched key source put back
    assert "the same adapters: True" in capsys.readouterr().out
