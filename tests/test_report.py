"""prepack report: manifest figures and the useful-token budget checked by hand, pages, and bad input."""

from __future__ import annotations

import base64
import json
import math
import re
import struct

import numpy as np
import pytest

from apps import report
from prepack.format.manifest import Manifest, ShardInfo
from apps.report import ReportError


def write_manifest(folder, max_length, examples_written, tokens, target_tokens, num_rows, dropped=None, packing="bfd",
                   read=None, **extra_stats):
    dropped = dropped or {}
    stats = {
        "examples_read": read if read is not None else examples_written + sum(dropped.values()),
        "examples_written": examples_written,
        "examples_dropped": dropped,
        "examples_truncated": 0,
        "tokens": tokens,
        "target_tokens": target_tokens,
        "lower_bound_rows": math.ceil(tokens / max_length),
        "packed_density": tokens / (num_rows * max_length),
        "unpacked_density": tokens / (examples_written * max_length),
        **extra_stats,
    }
    m = Manifest(max_length=max_length, num_rows=num_rows,
                 shards=[ShardInfo("rows-00000-of-00001.array_record", num_rows, 1, "0" * 64)],
                 tokenizer={"name": "test-vocab"}, stats=stats, packing=packing, template={"name": "alpaca"})
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(m.to_json())
    return m


def write_metrics(path, target_per_step, step_times, losses=None, summary=None, cumulative=False):
    losses = losses or [3.0 - 0.1 * i for i in range(len(target_per_step))]
    lines, total = [], 0
    for i, (t, s) in enumerate(zip(target_per_step, step_times)):
        total += t
        lines.append(json.dumps({"step": i + 1, "loss": losses[i], "step_time_s": s, "tokens": 2 * t,
                                 "target_tokens": total if cumulative else t, "target_tokens_per_s": t / s,
                                 "density": 0.5}))
    if summary is not None:
        lines.append(json.dumps(summary))
    path.write_text("\n".join(lines) + "\n")
    return path


# ----------------------------------------------------------------------------- manifests


def test_manifest_figures_by_hand(tmp_path):
    # L=8, 4 examples written (lengths 3,5,2,6 as in the preflight test) in 2 rows, 16 tokens, 9 targets;
    # dropped: 1 too long, 2 with a missing field, so 7 read.
    # packed 16/16 = 1.0, unpacked 16/32 = 0.5, targets 9/16 and 9/32, row reduction 2.
    # B=2: 2 unpacked steps vs 1 packed, gain 2. Mean tokens 16/4 = 4.
    m = write_manifest(tmp_path / "out" / "L8", 8, 4, 16, 9, 2, dropped={"too_long": 1, "missing_field": 2})
    (r,), warnings = report.manifest_rows("out", str(tmp_path / "out" / "L8"), m, [2])
    assert warnings == []
    # Bad records are not examples: 4 kept + 1 too long = 5 examples, 1 dropped for length.
    assert (r["records_read"], r["examples"], r["examples_kept"], r["examples_dropped"]) == (7, 5, 4, 1)
    assert (r["bad_records"], r["dropped_too_long"]) == (2, 1)
    assert (r["packed_rows"], r["unpacked_rows"], r["lower_bound_rows"]) == (2, 4, 2)
    assert (r["packed_density"], r["unpacked_density"]) == (1.0, 0.5)
    assert (r["packed_target_density"], r["unpacked_target_density"]) == (0.5625, 0.28125)
    assert (r["row_reduction"], r["unpacked_steps"], r["packed_steps"], r["throughput_gain"]) == (2.0, 2, 1, 2.0)
    assert r["mean_tokens"] == 4.0 and r["median_tokens"] is None  # no histogram in this manifest


def test_job_manifest_counts_are_used_when_present(tmp_path):
    # The job records records_read (source lines: oasst1 has fewer than examples) and bad_records itself.
    m = write_manifest(tmp_path / "L8", 8, 4, 16, 9, 2, dropped={"missing_field": 2}, records_read=5, bad_records=2)
    m.template["chat_format_resolved"] = "gemma"
    (r,), _ = report.manifest_rows("x", str(tmp_path / "L8"), m, [1])
    assert (r["records_read"], r["bad_records"], r["examples"], r["chat_format"]) == (5, 2, 4, "gemma")


def test_manifest_length_histogram_gives_quantiles(tmp_path):
    # Lengths [2,3,5,6]: median 4, p95 5 + 0.85 = 5.85, max 6.
    m = write_manifest(tmp_path / "L8", 8, 4, 16, 9, 2, length_histogram={"2": 1, "3": 1, "5": 1, "6": 1})
    (r,), _ = report.manifest_rows("x", str(tmp_path / "L8"), m, [1])
    assert (r["median_tokens"], r["max_tokens"]) == (4.0, 6) and r["p95_tokens"] == pytest.approx(5.85)


def test_inconsistent_manifest_stats_are_flagged(tmp_path):
    m = write_manifest(tmp_path / "L8", 8, 4, 16, 9, 2)
    m.stats["packed_density"] = 0.9
    _, warnings = report.manifest_rows("x", str(tmp_path / "L8"), m, [1])
    assert len(warnings) == 1 and "stats.packed_density is 0.9, but its counts give 1" in warnings[0]


def test_find_manifests_root_and_single_folder(tmp_path):
    write_manifest(tmp_path / "out" / "L16", 16, 4, 16, 9, 1)
    write_manifest(tmp_path / "out" / "L8", 8, 4, 16, 9, 2)
    (tmp_path / "out" / "L32").mkdir()  # an unfinished length: no manifest, so not a shard set
    found = report.find_manifests(str(tmp_path / "out"))
    assert [m.max_length for _, m in found] == [8, 16]
    assert [m.max_length for _, m in report.find_manifests(str(tmp_path / "out" / "L16"))] == [16]
    assert report._shard_label(str(tmp_path / "out" / "L16")) == "out"
    assert report._shard_label(str(tmp_path / "out")) == "out"
    with pytest.raises(ReportError, match="no manifest.json in it or in an L"):
        report.find_manifests(str(tmp_path / "out" / "L32"))
    with pytest.raises(ReportError, match="no such folder"):
        report.find_manifests(str(tmp_path / "nope"))


# ----------------------------------------------------------------------------- metrics and the budget view


def test_budget_view_by_hand(tmp_path):
    # packed:   3 steps of 1 s, 100 target tokens each -> cumulative 100, 200, 300 at 1, 2, 3 s.
    # unpacked: 4 steps of 1 s,  40 target tokens each -> cumulative 40 .. 160 at 1 .. 4 s.
    # Budget = the most both reached = 160. Packed crosses it in step 2: 1 + (160-100)/100 = 1.6 s.
    # Unpacked needs all 4 steps: 4.0 s. Speed-up against the unpacked run: 4.0 / 1.6 = 2.5.
    packed = report.load_run(str(write_metrics(tmp_path / "a.jsonl", [100] * 3, [1.0] * 3, summary={"packing": "packed"})))
    unpacked = report.load_run(str(write_metrics(tmp_path / "b.jsonl", [40] * 4, [1.0] * 4, summary={"packing": "unpacked"})))
    budget, (a, b) = report.budget_rows([packed, unpacked])
    assert budget == 160
    assert (a["time_to_budget_s"], a["steps_to_budget"]) == (pytest.approx(1.6), 2)
    assert (b["time_to_budget_s"], b["steps_to_budget"]) == (pytest.approx(4.0), 4)
    assert a["speedup"] == pytest.approx(2.5) and b["speedup"] == pytest.approx(1.0) and a["reference"] == "b"
    assert (a["target_tokens_per_s"], b["target_tokens_per_s"]) == (100.0, 40.0)
    assert (a["packing"], b["packing"]) == ("packed", "unpacked")
    # A budget beyond what a run reached leaves that run without a time.
    _, (a, b) = report.budget_rows([packed, unpacked], budget=250)
    assert a["time_to_budget_s"] == pytest.approx(2.5) and math.isnan(b["time_to_budget_s"])


def test_running_totals_are_turned_into_per_step_counts(tmp_path):
    # Same unpacked run, logged as running totals 40, 80, 120, 160; target_tokens_per_s (40/s) says which it is.
    run = report.load_run(str(write_metrics(tmp_path / "c.jsonl", [40] * 4, [1.0] * 4, cumulative=True)))
    assert run.target_tokens.tolist() == [40, 40, 40, 40] and run.cum_target_tokens[-1] == 160


def test_warmup_steps_are_timed_as_the_median_step(tmp_path):
    # A 10 s first step (compilation), then steps of 1 s and 2 s. Default --warmup-steps 1: step 1 counts as
    # the median of the others, 1.5 s, so the clock reads 1.5, 2.5, 4.5; with 0 it reads 10, 11, 13.
    path = write_metrics(tmp_path / "w.jsonl", [100] * 3, [10.0, 1.0, 2.0])
    assert report.load_run(str(path)).cum_time.tolist() == [1.5, 2.5, 4.5]
    assert report.load_run(str(path), warmup_steps=0).cum_time.tolist() == [10.0, 11.0, 13.0]
    assert report.load_run(str(path)).cum_target_tokens[-1] == 300  # its tokens still count


def test_trainer_metrics_lines(tmp_path):
    # What train/trainer.py writes: step lines carrying "packing", {"eval": {...}} lines, a nested summary.
    lines = [
        {"step": 1, "loss": 3.0, "step_time_s": 9.0, "tokens": 100, "target_tokens": 60, "target_tokens_per_s": 60 / 9,
         "density": 0.5, "packing": "unpacked", "batch_size": 2, "seq_len": 100},
        {"step": 2, "loss": 2.5, "step_time_s": 1.0, "tokens": 100, "target_tokens": 60, "target_tokens_per_s": 60.0,
         "density": 0.5, "packing": "unpacked", "batch_size": 2, "seq_len": 100},
        {"eval": {"step": 2, "loss": 2.7, "target_tokens": 500, "batches": 3, "time_s": 0.5}},
        {"summary": {"steps": 2, "eval_loss": 2.7, "packing": "unpacked", "target_tokens_per_s": 60.0}},
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = report.load_run(str(path))
    assert (run.packing, run.evals, run.eval_loss, run.summary["steps"]) == ("unpacked", [(2.0, 2.7)], 2.7, 2)
    assert run.cum_time.tolist() == [1.0, 2.0] and run.cum_target_tokens.tolist() == [60, 120]
    _, (row,) = report.budget_rows([run])
    assert (row["eval_loss"], row["final_loss"], row["time_to_budget_s"]) == (2.7, 2.5, 2.0)


def test_labels_and_packing_from_names(tmp_path):
    path = write_metrics(tmp_path / "run_unpacked_L512.jsonl", [10] * 3, [1.0] * 3)
    assert report.load_run(str(path)).packing == "unpacked"
    label, p = report._split_label(f"baseline={path}")
    assert (label, p) == ("baseline", str(path))
    assert report.load_run(p, label).label == "baseline"


# ----------------------------------------------------------------------------- whole pages


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    for L, rows in ((256, 40), (512, 20), (1024, 10)):
        write_manifest(root / "packed" / f"L{L}", L, 120, 10_000, 6_000, rows, dropped={"too_long": 3})
    write_manifest(root / "unpacked" / "L512", 512, 120, 10_000, 6_000, 120, packing="unpacked")
    rng = np.random.default_rng(0)
    a = write_metrics(root / "packed.jsonl", [3000] * 40, (0.5 + 0.01 * rng.random(40)).tolist(),
                      losses=(2 + np.exp(-np.arange(40) / 8) + 0.05 * rng.random(40)).tolist(), summary={"packing": "packed"})
    b = write_metrics(root / "unpacked.jsonl", [600] * 120, (0.5 + 0.01 * rng.random(120)).tolist(),
                      losses=(2 + np.exp(-np.arange(120) / 40) + 0.05 * rng.random(120)).tolist(),
                      summary={"packing": "unpacked"})
    return root, a, b


def test_html_page_is_self_contained(inputs, tmp_path):
    root, a, b = inputs
    out = tmp_path / "page.html"
    assert report.main(["--shards", str(root / "packed"), str(root / "unpacked" / "L512"), "--metrics", str(a), str(b),
                        "--output", str(out)]) == 0
    text = out.read_text()
    assert list(tmp_path.iterdir()) == [out]  # one file, nothing beside it
    images = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", text)
    assert len(images) == 4  # shard density, row reduction, loss curves, budget
    assert "src='http" not in text and "<link" not in text
    for i, data in enumerate(images):
        png = tmp_path / f"img{i}.png"
        png.write_bytes(base64.b64decode(data))
        assert_readable_png(png)
    assert "Useful-token budget: 72,000 target tokens" in text  # unpacked reached 120 x 600
    assert "<td>bfd</td><td>512</td>" in text and "<td>unpacked</td><td>512</td>" in text


def test_markdown_page_with_pngs_beside(inputs, tmp_path):
    root, a, b = inputs
    out = tmp_path / "page.md"
    assert report.main(["--shards", str(root / "packed"), "--metrics", f"pk={a}", f"unp={b}", "--batch-size", "4", "16",
                        "--output", str(out)]) == 0
    text = out.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == sorted(f"page_figures/{n}" for n in (
        "shards_density_vs_max_length.png", "shards_row_reduction.png", "loss_curves.png", "budget.png"))
    for link in links:
        assert_readable_png(tmp_path / link)
    # L x B table: 3 lengths x 2 batch sizes for the packed set; budget rows for both labels.
    assert len(re.findall(r"^\| bfd \| ", text, flags=re.M)) == 6
    assert re.search(r"^\| pk \| packed \|", text, flags=re.M) and re.search(r"^\| unp \| unpacked \|", text, flags=re.M)
    assert "Dropped by reason: L256 too_long 3" in text


def test_preflight_json_on_the_page(tmp_path):
    # The hand case of test_preflight (lengths 3,5,2,6 at L=8) rendered from its preflight.json.
    from apps import preflight

    masks = [np.array(m, dtype=np.uint8) for m in ([0, 1, 1], [0, 0, 1, 1, 1], [0, 1], [0, 0, 0, 1, 1, 1])]
    cfg = preflight.PreflightConfig(datasets=(preflight.DatasetSpec("hand", "hand.jsonl", "alpaca"),),
                                    output=str(tmp_path / "pf"), batch_sizes=(2,),
                                    rows=preflight.RowSpec(inputs=(), format="", max_lengths=(8,)))
    result = preflight.run(cfg, lambda spec: preflight.ExampleSet.from_masks("hand", masks, input="hand.jsonl"))
    preflight.write_outputs(result, str(tmp_path / "pf"), plots=False)
    out = tmp_path / "page.md"
    assert report.main(["--preflight", str(tmp_path / "pf"), "--output", str(out)]) == 0
    text = out.read_text()
    # L, B, kept, dropped, mean, median, p95, densities..., rows 4 -> 2, bound 2, 2x, steps 2 -> 1, gain 2x.
    assert "| 8 | 2 | 4 | 0 | 4.0 | 4.0 | 5.8 | 50.0% | 100.0% | 28.1% | 56.2% | 4 | 2 | 2 | 2.00x | 2 | 1 | 2.00x |" in text
    assert_readable_png(tmp_path / "page_figures" / "preflight1_length_histogram.png")


def assert_readable_png(path, min_side=400, min_bytes=15_000):
    """A real PNG of a decent size whose pixels are not all one colour."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", raw[16:24])
    assert width >= min_side and height >= 150, (width, height)
    assert len(raw) >= min_bytes, f"{path} is only {len(raw)} bytes"
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(path)) * 255).astype(np.uint8)
    rgba = np.ascontiguousarray(pixels[..., :3]).view(np.dtype((np.void, 3)))
    assert len(np.unique(rgba)) > 50


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--metrics", "{missing}"], "no such file"),
        (["--metrics", "{bad_json}"], "bad.jsonl:2: not valid JSON"),
        (["--metrics", "{no_time}"], "no_time.jsonl:1: step record lacks step_time_s"),
        (["--metrics", "{summary_only}"], "no step records"),
        (["--shards", "{missing}"], "no such folder"),
        (["--shards", "{broken}"], "not valid JSON"),
        (["--metrics", "{good}", "--output", "{tmp}/page.pdf"], "expected a .html or .md file"),
        ([], "nothing to report"),
        (["--metrics", "{good}", "--batch-size", "0"], "--batch-size must be positive"),
    ],
)
def test_bad_input_fails_with_a_clear_message(tmp_path, capsys, argv, message):
    (tmp_path / "bad.jsonl").write_text('{"step": 1, "loss": 2, "step_time_s": 1, "target_tokens": 5}\n{oops\n')
    (tmp_path / "no_time.jsonl").write_text('{"step": 1, "loss": 2, "target_tokens": 5}\n')
    (tmp_path / "summary_only.jsonl").write_text('{"summary": true}\n')
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "manifest.json").write_text("{not json")
    good = write_metrics(tmp_path / "good.jsonl", [10] * 3, [1.0] * 3)
    subs = {"missing": str(tmp_path / "missing"), "bad_json": str(tmp_path / "bad.jsonl"),
            "no_time": str(tmp_path / "no_time.jsonl"), "summary_only": str(tmp_path / "summary_only.jsonl"),
            "broken": str(tmp_path / "broken"), "good": str(good), "tmp": str(tmp_path)}
    argv = [a.format(**subs) for a in argv]
    if "--output" not in argv:
        argv += ["--output", str(tmp_path / "out" / "page.md")]
    assert report.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepack report: error: ") and message in err, err
    assert not (tmp_path / "out").exists()  # nothing written on bad input


def test_heading_does_not_repeat_a_dataset_named_after_its_path():
    from apps.packing_table import dataset_heading

    assert dataset_heading({"dataset": "OUT", "input": "OUT/", "format": "alpaca"}) == "OUT: (format alpaca)"
    assert dataset_heading({"dataset": "a", "input": "data/a.jsonl"}) == "a: data/a.jsonl"


def test_page_opens_with_a_verdict_from_the_measured_runs(inputs, tmp_path):
    root, a, b = inputs
    out = tmp_path / "page.md"
    assert report.main(["--shards", str(root / "packed"), "--metrics", str(a), str(b), "--output", str(out)]) == 0
    text = out.read_text()
    verdict = next(line for line in text.splitlines() if line.startswith("Verdict: "))
    assert text.index(verdict) < text.index("## ")  # before the first section
    # packed trains 3,000 target tokens a step, unpacked 600, at the same step time: 5x to the same budget.
    assert re.fullmatch(r"Verdict: Packing was worth it here: the packed run trained on 72,000 target tokens in "
                        r"[\d.]+ s, against [\d.]+ s for unpacked, (4\.9\d|5\.0\d)x faster\.", verdict), verdict


def test_verdict_wording_follows_the_speedup():
    def table(speed):
        return [{"run": "u", "reference": "u", "speedup": 1.0, "time_to_budget_s": 10.0},
                {"run": "p", "reference": "u", "speedup": speed, "time_to_budget_s": 10.0 / speed}]

    assert report.training_verdict(table(2.0), 100).startswith("Packing was worth it here: the p run trained on 100 ")
    assert report.training_verdict(table(1.01), 100).startswith("Packing made no real difference here")
    assert report.training_verdict(table(0.5), 100).startswith("Packing was not worth it here")
    rows = [{"dataset": "d", "max_length": 512, "batch_size": 8, "throughput_gain": 3.5, "packed_density": 0.97,
             "unpacked_density": 0.25, "packing": "bfd"}]
    assert report.estimate_verdict(rows, "from the shard sets; no training measured") == (
        "Packing should be worth it here (from the shard sets; no training measured): d at L=512, B=8 needs 3.50x "
        "fewer steps for the same examples (97% of row slots hold tokens packed, 25% unpacked).")


def test_a_dpo_run_alone_is_the_verdict_and_packing_is_said_unmeasured(inputs, tmp_path):
    """One DPO run beside its shard set compares no packing: the verdict says what the run measured
    (its loss and reward accuracy), and the shard-set estimate does not claim no training was measured."""
    root, _, _ = inputs
    rows = [{"step": i + 1, "loss": loss, "step_time_s": 1.0, "tokens": 800, "target_tokens": 300, "examples": 4,
             "objective": "dpo", "rewards/chosen": 0.01 * i, "rewards/rejected": -0.01 * i, "rewards/accuracies": acc,
             "rewards/margins": 0.02 * i, "logps/chosen": -40.0, "logps/rejected": -41.0}
            for i, (loss, acc) in enumerate([(0.6931, 0.0), (0.68, 0.5), (0.64, 0.75), (0.6396, 0.8)])]
    metrics = tmp_path / "dpo-metrics.jsonl"
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "page.md"
    assert report.main(["--shards", str(root / "packed"), "--metrics", str(metrics), "--output", str(out)]) == 0
    verdict = next(line for line in out.read_text().splitlines() if line.startswith("Verdict: "))
    assert verdict.startswith("Verdict: Trained: dpo-metrics (DPO, 4 steps) took its loss from 0.693 to 0.640, reward "
                              "accuracy 0.80 at the end. Packing should be worth it here (from the shard sets; no "
                              "unpacked run beside the training measured above to compare it with): "), verdict
    assert "no training measured" not in verdict


# ----------------------------------------------------------------------------- diverged runs


def test_a_diverged_run_gets_no_speedup_and_a_warning_at_the_top(tmp_path):
    # The packed run would be 2.5x faster (test_budget_view_by_hand), but its loss went NaN at step 3:
    # `prepack train` wrote the loss as null and the summary says why it stopped.
    packed = write_metrics(tmp_path / "packed.jsonl", [100] * 3, [1.0] * 3, losses=[3.0, 2.9, None],
                           summary={"summary": {"packing": "packed", "final_loss": None,
                                                "stopped": {"step": 3, "reason": "loss is nan, gradient norm is nan"}}})
    unpacked = write_metrics(tmp_path / "unpacked.jsonl", [40] * 4, [1.0] * 4, summary={"packing": "unpacked"})
    runs = [report.load_run(str(packed)), report.load_run(str(unpacked))]
    assert runs[0].diverged == "stopped at step 3: loss is nan, gradient norm is nan" and runs[1].diverged is None
    _, (a, b) = report.budget_rows(runs)
    assert math.isnan(a["speedup"]) and math.isnan(a["time_to_budget_s"]) and a["status"].startswith("diverged: stopped at step 3")
    assert b["status"] == "ok"
    page, _ = report.build_page(report.ReportConfig(output=str(tmp_path / "r.html"), metrics=(str(packed), str(unpacked))), str(tmp_path))
    warning = "Warning: training run packed diverged (stopped at step 3: loss is nan, gradient norm is nan)"
    # at the top: within the first blocks after the title and date
    assert any(b[0] == "p" and b[1].startswith(warning) for b in page.blocks[:4]), page.blocks[:4]
    (table,) = [blk for blk in page.blocks if blk[0] == "table"]
    row = next(r for r in table[2] if r[0] == "packed")
    assert row[table[1].index("speed-up")] == "-" and row[table[1].index("time to budget")] == "-"


def test_a_run_whose_last_loss_is_not_finite_is_diverged_without_a_stop_record(tmp_path):
    # What the trainer wrote before --nan-policy: NaN losses to the end, a normal exit.
    path = tmp_path / "old.jsonl"
    path.write_text("\n".join(json.dumps({"step": i, "loss": float("nan") if i > 1 else 2.5, "step_time_s": 1.0,
                                           "target_tokens": 10}) for i in (1, 2, 3)) + "\n")
    assert report.load_run(str(path)).diverged == "final loss is missing or NaN (step 3)"


def test_shard_tables_use_the_runs_own_batch_size():
    # The tables' gain must be the one the runs measured: B from their metrics unless --batch-size is given.
    from apps.report import DEFAULT_BATCH_SIZES, Run, table_batch_sizes

    def run(summary):
        empty = np.array([])
        return Run("r", "r.jsonl", empty, empty, empty, empty, empty, summary)

    assert table_batch_sizes((), [run({"batch_size": 2}), run({"batch_size": 2})]) == (2,)
    assert table_batch_sizes((), [run({"batch_size": 2}), run({"batch_size": 8})]) == (2, 8)
    assert table_batch_sizes((16,), [run({"batch_size": 2})]) == (16,)
    assert table_batch_sizes((), [run({})]) == table_batch_sizes((), []) == DEFAULT_BATCH_SIZES == (16,)


def test_the_budget_table_says_which_loss_mean_each_run_used(tmp_path):
    # A JSONL from before --loss-mean logged the token mean; a run with --loss-mean example names it.
    old = report.load_run(str(write_metrics(tmp_path / "old.jsonl", [100] * 3, [1.0] * 3)))
    lines = [json.dumps({"step": i + 1, "loss": 2.0, "step_time_s": 1.0, "tokens": 200, "target_tokens": 100,
                         "target_tokens_per_s": 100.0, "density": 0.5, "loss_mean": "example"}) for i in range(3)]
    (tmp_path / "ex.jsonl").write_text("\n".join(lines) + "\n")
    new = report.load_run(str(tmp_path / "ex.jsonl"))
    _, (a, b) = report.budget_rows([old, new])
    assert (a["loss_mean"], b["loss_mean"]) == ("token", "example")
    page = report.Page()
    report._training_section(page, lambda *args, **kwargs: None, report.ReportConfig(output="unused"), [old, new])
    tables = [b for b in page.blocks if b[0] == "table"]
    assert tables[0][1][-2] == "loss mean" and [row[-2] for row in tables[0][2]] == ["token", "example"]
    assert ("p", "Warning: these runs use different loss means (old: token, ex: example); their loss values "
                 "measure different things.") in page.blocks
