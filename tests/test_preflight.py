"""prepack preflight: figures checked against cases worked out by hand, outputs, and bad input.

The hand cases use loss masks directly (no tokenizer), so every number below
can be recomputed on paper. Target tokens count from each example's second
token, because the row builder zeroes the first token's loss.
"""

from __future__ import annotations

import csv
import json
import re
import struct
from collections import Counter

import numpy as np
import pytest

from apps import preflight
from prepack.packing.packer import OverlongPolicy
from apps.preflight import DatasetSpec, ExampleSet, PreflightConfig
from pipelines.configs import RowSpec

# Four examples, lengths [3, 5, 2, 6]; targets counted from token 1: [2, 3, 1, 3] -> 9.
MASKS = [
    [0, 1, 1],  # len 3, targets 2
    [0, 0, 1, 1, 1],  # len 5, targets 3
    [0, 1],  # len 2, targets 1
    [0, 0, 0, 1, 1, 1],  # len 6, targets 3
]


def example_set(masks=MASKS, name="hand") -> ExampleSet:
    return ExampleSet.from_masks(name, masks, input="hand.jsonl", format="alpaca", records_read=len(masks))


def config(max_lengths, batch_sizes, overlong=OverlongPolicy.DROP, output="unused") -> PreflightConfig:
    return PreflightConfig(datasets=(), output=output, rows=RowSpec(inputs=(), format="", max_lengths=tuple(max_lengths),
                                                                    overlong=overlong), batch_sizes=tuple(batch_sizes))


def rows_by_b(rows):
    return {r["batch_size"]: r for r in rows}


def test_lengths_3_5_2_6_at_L8_by_hand():
    # BFD at L=8, longest first: 6 -> row A (2 free); 5 -> new row B (3 free); 3 -> B (full); 2 -> A (full).
    # 2 rows, 16 tokens: packed density 16/(2*8) = 1.0; unpacked 16/(4*8) = 0.5.
    # Targets 9: packed target density 9/16 = 0.5625; unpacked 9/32 = 0.28125. Row reduction 4/2 = 2.
    rows = rows_by_b(preflight.evaluate(example_set(), config([8], [1, 2, 3, 4])))
    r = rows[1]
    assert (r["examples_kept"], r["examples_dropped"], r["tokens"], r["target_tokens"]) == (4, 0, 16, 9)
    assert (r["unpacked_rows"], r["packed_rows"], r["lower_bound_rows"]) == (4, 2, 2)
    assert r["packed_density"] == 1.0 and r["unpacked_density"] == 0.5
    assert r["packed_target_density"] == 0.5625 and r["unpacked_target_density"] == 0.28125
    assert r["row_reduction"] == 2.0
    # Kept lengths [2,3,5,6]: mean 4, median 4, p95 by linear interpolation 5 + 0.85 * (6 - 5) = 5.85.
    assert (r["mean_tokens"], r["median_tokens"], r["max_tokens"]) == (4.0, 4.0, 6)
    assert r["p95_tokens"] == pytest.approx(5.85)
    # B=1: 4 steps unpacked vs 2 packed -> gain 2.
    assert (r["unpacked_steps"], r["packed_steps"], r["throughput_gain"]) == (4, 2, 2.0)
    # B=2: 2 steps vs 1. Per-step density unpacked 16/(2*2*8) = 0.5, packed 16/(1*2*8) = 1.0; targets
    # 9/32 = 0.28125 vs 9/16 = 0.5625; gain 2.
    r = rows[2]
    assert (r["unpacked_steps"], r["packed_steps"]) == (2, 1)
    assert (r["unpacked_step_density"], r["packed_step_density"]) == (0.5, 1.0)
    assert (r["unpacked_step_target_density"], r["packed_step_target_density"]) == (0.28125, 0.5625)
    assert r["throughput_gain"] == 2.0
    # B=3: unpacked ceil(4/3) = 2 steps, 16/(2*3*8) = 1/3; packed 1 step (one empty padding row), 16/24 = 2/3; gain 2.
    r = rows[3]
    assert (r["unpacked_steps"], r["packed_steps"]) == (2, 1)
    assert r["unpacked_step_density"] == pytest.approx(1 / 3) and r["packed_step_density"] == pytest.approx(2 / 3)
    assert r["throughput_gain"] == 2.0
    # B=4: both fit one step, so packing halves the rows but saves no step: gain 1, both 16/32 = 0.5 per step.
    r = rows[4]
    assert (r["unpacked_steps"], r["packed_steps"], r["throughput_gain"]) == (1, 1, 1.0)
    assert r["packed_step_density"] == r["unpacked_step_density"] == 0.5
    assert r["packed_density"] == 1.0  # row density does not see the padding row


def test_drop_policy_at_L5_by_hand():
    # The 6-token example is too long. Kept [3,5,2]: 10 tokens, targets 2+3+1 = 6.
    # BFD: 5 -> row A (full); 3 -> row B (2 free); 2 -> B (full). 2 rows, bound ceil(10/5) = 2.
    # packed 10/10 = 1.0, unpacked 10/15; targets 6/10 = 0.6 packed, 6/15 = 0.4 unpacked.
    (r,) = preflight.evaluate(example_set(), config([5], [1]))
    assert (r["examples"], r["examples_kept"], r["examples_dropped"], r["dropped_too_long"]) == (4, 3, 1, 1)
    assert r["examples_truncated"] == 0
    assert (r["tokens"], r["target_tokens"], r["packed_rows"], r["lower_bound_rows"]) == (10, 6, 2, 2)
    assert r["packed_density"] == 1.0 and r["unpacked_density"] == pytest.approx(10 / 15)
    assert r["packed_target_density"] == 0.6 and r["unpacked_target_density"] == pytest.approx(0.4)
    assert r["max_tokens"] == 5


def test_truncate_policy_at_L5_by_hand():
    # The 6-token example [0,0,0,1,1,1] becomes [0,0,0,1,1]: 5 tokens, 2 targets.
    # Kept [3,5,2,5]: 15 tokens, targets 2+3+1+2 = 8. BFD: 5 | 5 | 3+2 -> 3 rows, bound 3.
    # packed 15/15 = 1.0, unpacked 15/20 = 0.75; targets 8/15 packed, 8/20 = 0.4 unpacked.
    (r,) = preflight.evaluate(example_set(), config([5], [1], OverlongPolicy.TRUNCATE))
    assert (r["examples_kept"], r["examples_dropped"], r["examples_truncated"]) == (4, 0, 1)
    assert (r["tokens"], r["target_tokens"], r["packed_rows"], r["lower_bound_rows"]) == (15, 8, 3, 3)
    assert r["packed_density"] == 1.0 and r["unpacked_density"] == 0.75
    assert r["packed_target_density"] == pytest.approx(8 / 15) and r["unpacked_target_density"] == 0.4


def test_truncation_that_leaves_no_target_drops_by_reason():
    # L=4, truncate. [0,0,1,1,1] -> [0,0,1,1]: kept, 2 targets. [0,0,0,0,1,1] -> [0,0,0,0]: no target left, dropped.
    # Kept [3,4,2]: 9 tokens, targets 2+2+1 = 5. BFD: 4 | 3 (1 free) | 2 -> 3 rows = bound ceil(9/4).
    # With one example per row either way: density 9/12 = 0.75 both, row reduction 1, gain 1.
    masks = [MASKS[0], MASKS[1], MASKS[2], [0, 0, 0, 0, 1, 1]]
    (r,) = preflight.evaluate(example_set(masks), config([4], [1], OverlongPolicy.TRUNCATE))
    assert (r["examples_kept"], r["examples_truncated"], r["dropped_no_targets_after_truncation"]) == (3, 1, 1)
    assert r["dropped_too_long"] == 0 and r["examples_dropped"] == 1
    assert (r["tokens"], r["target_tokens"], r["packed_rows"]) == (9, 5, 3)
    assert r["packed_density"] == r["unpacked_density"] == 0.75
    assert r["row_reduction"] == 1.0 and r["throughput_gain"] == 1.0


def test_every_example_dropped_gives_zeros_not_errors():
    (r,) = preflight.evaluate(example_set(), config([1], [4]))
    assert r["examples_kept"] == 0 and r["examples_dropped"] == 4
    assert r["packed_rows"] == 0 and r["packed_density"] == 0.0 and r["throughput_gain"] == 0.0


def test_run_writes_csv_json_and_plots(tmp_path):
    cfg = config([4, 8], [1, 2], output=str(tmp_path))
    cfg = PreflightConfig(**{**cfg.__dict__, "datasets": (DatasetSpec("hand", "hand.jsonl", "alpaca"),)})
    result = preflight.run(cfg, lambda spec: example_set(name=spec.name), "fake-tok", "gemma")
    written = preflight.write_outputs(result, str(tmp_path))
    names = sorted(p.rsplit("/", 1)[-1] for p in written)
    assert names == ["density_vs_max_length.png", "length_histogram.png", "preflight.csv", "preflight.json",
                     "row_reduction.png"]
    with open(tmp_path / "preflight.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == 4  # 1 dataset x 2 lengths x 2 batch sizes
    assert set(preflight.CSV_COLUMNS) <= set(table[0])
    at8 = [r for r in table if r["max_length"] == "8" and r["batch_size"] == "2"][0]
    assert (at8["packed_rows"], at8["unpacked_rows"], float(at8["packed_density"]), float(at8["unpacked_density"])) == (
        "2", "4", 1.0, 0.5)
    data = json.loads((tmp_path / "preflight.json").read_text())
    assert data["datasets"][0]["length_histogram"] == {"2": 1, "3": 1, "5": 1, "6": 1}
    assert "ceil(rows / B)" in data["throughput_model"]
    assert len(data["rows"]) == 4
    for name in names:
        if name.endswith(".png"):
            assert_readable_png(tmp_path / name)


def assert_readable_png(path, min_side=400, min_bytes=15_000):
    """A real PNG of a decent size whose pixels are not all one colour."""
    raw = path.read_bytes()
    assert raw[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    width, height = struct.unpack(">II", raw[16:24])
    assert width >= min_side and height >= min_side * 0.6, (width, height)
    assert len(raw) >= min_bytes, f"{path} is only {len(raw)} bytes"
    import matplotlib.image

    pixels = (matplotlib.image.imread(str(path)) * 255).astype(np.uint8)
    rgba = np.ascontiguousarray(pixels[..., :3]).view(np.dtype((np.void, 3)))  # one value per pixel colour
    assert len(np.unique(rgba)) > 50  # lines, text, fills: many colours, not a blank canvas


def test_text_table_is_readable():
    rows = preflight.evaluate(example_set(), config([8], [2]))
    text = preflight.render_text_table(rows)
    assert "hand: hand.jsonl" in text
    header, line = text.splitlines()[1:3]
    assert header.split()[:2] == ["L", "B"]
    assert "100.0%" in line and "50.0%" in line and "2.00x" in line


def test_reservoir_sample_is_seeded_and_in_order():
    def sample(seed):
        r = preflight._Reservoir(5, seed)
        for i in range(100):
            r.add(i)
        return r.items(), r.seen

    items, seen = sample(1)
    assert seen == 100 and len(items) == 5 and items == sorted(items)
    assert sample(1) == sample(1) and sample(1) != sample(2)


def test_only_masks_of_examples_over_the_smallest_length_are_kept():
    ex = ExampleSet.from_masks("hand", MASKS, keep_over=4)
    assert sorted(ex.overlong_masks) == [1, 3]  # lengths 5 and 6
    assert ex.lengths.tolist() == [3, 5, 2, 6] and ex.targets.tolist() == [2, 3, 1, 3]
    with pytest.raises(ValueError, match="loss mask was not kept"):
        preflight.evaluate(ex, config([2], [1], OverlongPolicy.TRUNCATE))  # length 3 > 2, but 3 <= 4


# ----------------------------------------------------------------------------- command line, real tokenizer

ALPACA_LINES = [
    '{"instruction": "Say hi", "input": "", "output": "Hi there!"}',
    '{"instruction": "Add", "input": "2 and 3", "output": "2 + 3 = 5"}',
    "{not json",
    '{"instruction": "No output here"}',
    '{"instruction": "Name a colour", "input": "", "output": "Blue."}',
]


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("preflight")
    data = root / "tiny_alpaca.jsonl"
    data.write_text("\n".join(ALPACA_LINES) + "\n")
    pr = root / "pr.jsonl"
    pr.write_text('{"prompt": "Why?", "response": "' + "Because. " * 40 + '"}\n')
    out = root / "out"
    code = preflight.main(["--input", str(data), f"qa={pr}", "--format", "alpaca", "prompt_response",
                           "--max-length", "32", "64", "--batch-size", "1", "2", "--output", str(out),
                           "--max-bad-fraction", "0.5"])  # ALPACA_LINES holds two bad records on purpose
    return code, out


def test_cli_end_to_end_with_gemma3(cli_run, capsys):
    code, out = cli_run
    assert code == 0
    data = json.loads((out / "preflight.json").read_text())
    tiny = data["datasets"][0]
    assert (tiny["name"], tiny["records_read"], tiny["examples"]) == ("tiny_alpaca", 5, 3)
    assert tiny["bad_records"] == {"malformed_json": 1, "missing_field": 1}
    assert data["datasets"][1]["name"] == "qa"
    rows = data["rows"]
    assert [(r["dataset"], r["max_length"], r["batch_size"]) for r in rows] == [
        (d, L, B) for d in ("tiny_alpaca", "qa") for L in (32, 64) for B in (1, 2)]
    for r in rows:
        assert r["chat_format"] == "gemma" and r["tokenizer"] == "gemma3"
        assert r["examples_kept"] + r["examples_dropped"] == r["examples"]
        assert r["packed_rows"] >= r["lower_bound_rows"]
        assert r["tokens"] == pytest.approx(r["packed_density"] * r["packed_rows"] * r["max_length"])
    # The 40-sentence response is longer than 64 tokens: dropped at both lengths.
    assert all(r["dropped_too_long"] == 1 and r["examples_kept"] == 0 for r in rows if r["dataset"] == "qa")
    # Three short alpaca examples (each under 32 tokens with Gemma markup) share rows at L=64.
    at64 = [r for r in rows if r["dataset"] == "tiny_alpaca" and r["max_length"] == 64][0]
    assert at64["examples_kept"] == 3 and at64["packed_rows"] < 3
    for png in ("density_vs_max_length.png", "row_reduction.png", "length_histogram.png"):
        assert_readable_png(out / png)


def test_cli_sample_of_max_examples(tmp_path, capsys):
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(ALPACA_LINES) + "\n")
    out = tmp_path / "out"
    argv = ["--input", str(data), "--format", "alpaca", "--max-length", "64", "--max-examples", "2", "--output", str(out), "--max-bad-fraction", "0.5",
            "--no-plots"]
    assert preflight.main(argv) == 0
    ds = json.loads((out / "preflight.json").read_text())["datasets"][0]
    assert (ds["examples"], ds["examples_seen"], ds["sampled"], ds["records_read"]) == (2, 3, True, 5)
    assert "estimated from a sample of 2 of 3 examples" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["preflight.csv", "preflight.json"]


def test_pack_spellings_are_accepted():
    # `prepack pack` spells the template --format/--template and its options --source-lang etc.
    args = preflight._parser().parse_args(["--input", "a.jsonl", "b.jsonl", "--template", "translation", "alpaca",
                                           "--source-lang", "de", "--template-option", "target_lang=en",
                                           "--output", "o"])
    cfg = preflight.config_from_args(args)
    assert [(d.name, d.format) for d in cfg.datasets] == [("a", "translation"), ("b", "alpaca")]
    assert cfg.rows.template_kwargs == {"source_lang": "de", "target_lang": "en"}
    assert preflight.make_template("translation", cfg.rows.template_kwargs).source_lang == "de"
    assert preflight.make_template("alpaca", cfg.rows.template_kwargs).name == "alpaca"  # options it does not take are left out


def test_other_specs_go_through_the_pipeline_readers(tmp_path):
    # A gzipped JSONL is read by the pipeline's read stage, with the same reasons.
    import gzip

    data = tmp_path / "a.jsonl.gz"
    data.write_bytes(gzip.compress(("\n".join(ALPACA_LINES) + "\n").encode()))
    out = tmp_path / "out"
    assert preflight.main(["--input", str(data), "--template", "alpaca", "--max-length", "64", "--output", str(out),
                           "--no-plots", "--max-bad-fraction", "0.5"]) == 0
    ds = json.loads((out / "preflight.json").read_text())["datasets"][0]
    assert (ds["records_read"], ds["examples"], ds["bad_records"]) == (5, 3, {"malformed_json": 1, "missing_field": 1})


@pytest.mark.parametrize("text, records", [
    ('{"instruction": "Name a colour", "input": "", "output": "Blue."}', 1),  # one object: the job packs it
    ('[{"instruction": "a", "output": "b"}, {"instruction": "c", "output": "d"}]', 2),
    ('{"data": [{"instruction": "a", "output": "b"}]}', 1),
])
def test_a_json_file_reads_as_the_job_reads_it(tmp_path, text, records):
    """preflight and `prepack pack` share one reader: a .json file holding one object used to be
    refused here ("expected a JSON array") while the job packed it."""
    from pipelines.inputs import sources
    from pipelines.inputs import readers

    data = tmp_path / "one.json"
    data.write_text(text)
    _, tasks = sources.resolve_inputs([str(data)])
    job_records = [r for t in tasks for r in readers.iter_task(t, readers.FileDigest(), 8)]
    out = tmp_path / "out"
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--max-length", "64", "--output", str(out),
                           "--no-plots"]) == 0
    ds = json.loads((out / "preflight.json").read_text())["datasets"][0]
    assert (ds["records_read"], ds["examples"], ds["bad_records"]) == (len(job_records), records, {}) == (records, records, {})


def test_oasst1_messages_left_out_by_design_are_not_bad_records(tmp_path):
    """Preflight runs the job's table-level prepare: a non-English tree is filtered, as in the job."""
    def msg(mid, parent, role, text, lang="en"):
        return {"message_id": mid, "parent_id": parent, "message_tree_id": "t" + mid[0], "role": role, "text": text,
                "lang": lang, "review_result": True, "deleted": False}

    rows = [msg("a1", None, "prompter", "Hi?"), msg("a2", "a1", "assistant", "Hello."),
            msg("b1", None, "prompter", "Salut?", "fr"), msg("b2", "b1", "assistant", "Bonjour.", "fr")]
    data = tmp_path / "oasst.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    assert preflight.main(["--input", str(data), "--format", "oasst1", "--max-length", "64", "--output", str(out),
                           "--no-plots"]) == 0
    ds = json.loads((out / "preflight.json").read_text())["datasets"][0]
    assert (ds["records_read"], ds["examples"], ds["bad_records"]) == (4, 1, {})


def test_pipeline_mode_matches_in_process(tmp_path):
    # --pack-output runs the Beam job and reads its manifests: same rows and densities as the in-process estimate.
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(ALPACA_LINES) + "\n")
    common = ["--input", str(data), "--format", "alpaca", "--max-length", "32", "64", "--batch-size", "2", "--no-plots",
              "--max-bad-fraction", "0.5"]
    assert preflight.main(common + ["--output", str(tmp_path / "here")]) == 0
    assert preflight.main(common + ["--output", str(tmp_path / "beam"), "--pack-output", str(tmp_path / "shards"),
                                    "--direct_num_workers=1", "--no-progress"]) == 0
    assert (tmp_path / "shards" / "a" / "L64" / "manifest.json").exists()
    here = json.loads((tmp_path / "here" / "preflight.json").read_text())["rows"]
    beam = json.loads((tmp_path / "beam" / "preflight.json").read_text())["rows"]
    keys = ["max_length", "batch_size", "examples_kept", "examples_dropped", "tokens", "target_tokens", "packed_rows",
            "unpacked_rows", "packed_density", "unpacked_density", "packed_target_density", "throughput_gain"]
    assert [[r[k] for k in keys] for r in beam] == [[r[k] for k in keys] for r in here]
    assert beam[0]["records_read"] == 5 and beam[0]["bad_records"] == 2


# Every row option `prepack pack` takes, with a value other than its default.
ROW_FLAGS = ["--max-length", "32", "64", "--overlong", "window", "--window-context-tokens", "4", "--planner", "bfd",
             "--max-segments-per-row", "3", "--sub-buckets", "2", "--num-shards", "2", "--max-bad-fraction", "0.5",
             "--max-record-bytes", "4096", "--max-decompressed-bytes", "1000000", "--max-whole-file-bytes", "900000",
             "--max-compression-ratio", "50", "--tfds-data-dir", "/nonexistent/tfds", "--tokenizer", "gemma3",
             "--chat-format", "gemma", "--train-reasoning", "no", "--expand-turns", "--source-lang", "de",
             "--target-lang", "en"]


def test_preflight_evaluates_the_rowspec_pack_runs():
    """One definition of the row options: the RowSpec preflight evaluates for a dataset is the one
    `prepack pack` makes from the same flags, field for field (limits, shards, sub-buckets, tfds
    folder included)."""
    from pipelines.options import parse_args

    args = preflight._parser().parse_args(["--input", "a.jsonl", "--format", "translation", "--output", "o", *ROW_FLAGS])
    cfg = preflight.config_from_args(args)
    pack, _ = parse_args(["--input", "a.jsonl", "--format", "translation", "--output", "out", *ROW_FLAGS])
    assert preflight.dataset_rows(cfg, cfg.datasets[0]) == pack.rows
    assert pack.rows.num_shards == 2 and pack.rows.limits.max_record_bytes == 4096 and pack.rows.sub_buckets == 2


def test_pack_output_runs_the_rowspec_preflight_evaluated(tmp_path, monkeypatch):
    """--pack-output hands the job the RowSpec preflight evaluated, with no command line rebuilt:
    every row option arrives (the limits, --num-shards, --target-shard-mb, --sub-buckets and
    --tfds-data-dir were dropped when preflight rebuilt pack's argv), and the run options and
    Beam's options it does not know go to the job."""
    from pipelines.launch import cli as pack_cli

    ran = []
    monkeypatch.setattr(pack_cli, "run_config", lambda config, beam_args: ran.append((config, beam_args)) or 1)
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(ALPACA_LINES) + "\n")
    flags = ["--target-shard-mb", "0.5", "--max-record-bytes", "4096", "--max-whole-file-bytes", "900000",
             "--sub-buckets", "3", "--tfds-data-dir", str(tmp_path / "tfds"), "--max-length", "64", "--max-bad-fraction", "0.5"]
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--no-plots", "--output", str(tmp_path / "pre"),
                           "--pack-output", str(tmp_path / "shards"), *flags,
                           "--no-progress", "--lock-expiry-s", "30", "--direct_num_workers=1"]) == 2
    (config, beam_args), = ran
    args = preflight._parser().parse_args(["--input", str(data), "--format", "alpaca", "--output", "o", *flags])
    assert config.rows == preflight.dataset_rows(preflight.config_from_args(args), DatasetSpec("a", str(data), "alpaca"))
    assert (config.rows.target_shard_mb, config.rows.limits.max_record_bytes, config.rows.sub_buckets) == (0.5, 4096, 3)
    assert config.rows.tfds_data_dir == str(tmp_path / "tfds") and config.rows.limits.max_whole_file_bytes == 900000
    assert (config.run.output, config.run.progress, config.run.lock_expiry_s) == (str(tmp_path / "shards" / "a"), False, 30.0)
    assert "--direct_num_workers=1" in beam_args


def test_in_process_preflight_reads_under_the_rowspec_limits(tmp_path):
    """The limits are row options too: a line over --max-record-bytes is a too_large bad record in
    preflight, as in the job (preflight refused the flag before it shared pack's definitions)."""
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join([ALPACA_LINES[0], json.dumps({"instruction": "x" * 300, "input": "", "output": "y"})]) + "\n")
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--max-length", "64", "--no-plots",
                           "--max-record-bytes", "100", "--max-bad-fraction", "1", "--output", str(tmp_path / "out")]) == 0
    ds = json.loads((tmp_path / "out" / "preflight.json").read_text())["datasets"][0]
    assert (ds["records_read"], ds["bad_records"]) == (2, {"too_large": 1})


def test_pack_output_refuses_an_unknown_option_before_any_work(tmp_path, capsys):
    data = tmp_path / "a.jsonl"
    data.write_text(ALPACA_LINES[0] + "\n")
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--no-plots", "--output", str(tmp_path / "pre"),
                           "--pack-output", str(tmp_path / "shards"), "--num-shard", "3"]) == 2
    assert capsys.readouterr().err == ("prepack preflight: error: --pack-output: unknown option --num-shard (neither prepack "
                                       "pack nor Beam knows it); did you mean --num-shards?\n")
    assert not (tmp_path / "shards").exists() and not (tmp_path / "pre").exists()


@pytest.mark.parametrize("extra", [
    ["--max-segments-per-row", "2"],
    ["--overlong", "split", "--max-segments-per-row", "3"],
    ["--planner", "bfd", "--overlong", "split"],
])
def test_forecast_rows_equal_the_published_rows(tmp_path, extra):
    """Preflight plans as the job does (same planner, cap and split): its packed_rows and
    bfd_rows are the rows a real `prepack pack` run publishes (stats.rows, stats.bfd_rows).
    Fails when preflight plans with plain BFD, without the cap, or drops what the job splits."""
    from pipelines.launch.job import run as pack_run
    from pipelines.options import parse_args
    from prepack.format.manifest import Manifest

    from testkit.pipeline import alpaca_records

    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(ALPACA_LINES + [json.dumps(r) for r in alpaca_records(40, seed=4)]) + "\n")
    lengths = ["--max-length", "64", "128", "256"]
    assert preflight.main(["--input", str(data), "--format", "alpaca", *lengths, "--batch-size", "2", "--no-plots",
                           "--max-bad-fraction", "1", "--output", str(tmp_path / "pre"), *extra]) == 0
    config, beam = parse_args(["--input", str(data), "--format", "alpaca", *lengths, "--max-bad-fraction", "1",
                               "--output", str(tmp_path / "out"), "--no-progress", "--direct_running_mode=in_memory",
                               *extra])
    pack_run(config, beam)
    rows = json.loads((tmp_path / "pre" / "preflight.json").read_text())["rows"]
    for r in rows:
        manifest = Manifest.from_json((tmp_path / "out" / f"L{r['max_length']}" / "manifest.json").read_text())
        assert r["packed_rows"] == manifest.stats["rows"] == manifest.num_rows
        assert r["bfd_rows"] == manifest.stats["bfd_rows"]
        assert r["examples_kept"] == manifest.stats["examples_written"]
        assert r["examples_split"] == manifest.stats["examples_split"]
        assert r["split_pieces"] == manifest.stats["split_pieces"]


def _long_prompt_chat(tmp_path) -> str:
    """Chat records whose prompt (60 words) is longer than L 48: at --window-context-tokens 48
    their later pieces have no room for a target (window_context_too_long)."""
    long_prompt = " ".join(f"word{i}" for i in range(60))
    records = [{"messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "Yes. " * 20}]},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there. " * 9}]},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there."}]}]
    path = tmp_path / "long_prompt.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("data, extra", [
    ("sample", ["--max-length", "64", "128"]),
    ("sample", ["--max-length", "64", "128", "--window-context-tokens", "8"]),
    ("long_prompt", ["--max-length", "48", "--window-context-tokens", "48"]),
])
def test_window_forecast_equals_the_published_stats(tmp_path, data, extra):
    """--overlong window: preflight's rows, pieces, replayed context and drops by reason are the
    stats a real `prepack pack --overlong window` run publishes, on the shipped chat sample (158
    of its 200 examples are longer than 64) and on prompts too long for their context (pieces
    dropped as window_context_too_long). `prepack report` reads the same figures back from the
    manifests. Fails when preflight cuts by another rule, drops what the job windows (it raised
    before window was forecast), or counts context the job does not."""
    import os

    import prepack
    from apps.report import manifest_rows
    from pipelines.launch.job import run as pack_run
    from pipelines.options import parse_args
    from prepack.format.manifest import Manifest

    path = (os.path.join(os.path.dirname(prepack.__file__), "sample_data", "sample_chat.jsonl") if data == "sample"
            else _long_prompt_chat(tmp_path))
    common = ["--input", path, "--format", "chat", "--overlong", "window", *extra]
    assert preflight.main(common + ["--no-plots", "--output", str(tmp_path / "pre")]) == 0
    config, beam = parse_args(common + ["--output", str(tmp_path / "out"), "--no-progress", "--no-tokens",
                                        "--direct_running_mode=in_memory"])
    pack_run(config, beam)
    rows = json.loads((tmp_path / "pre" / "preflight.json").read_text())["rows"]
    assert rows and all(r["overlong"] == "window" for r in rows)
    for r in rows:
        folder = tmp_path / "out" / f"L{r['max_length']}"
        manifest = Manifest.from_json((folder / "manifest.json").read_text())
        stats = manifest.stats
        assert r["packed_rows"] == stats["rows"] == manifest.num_rows
        assert r["bfd_rows"] == stats["bfd_rows"]
        assert r["examples_kept"] == stats["examples_written"]
        assert (r["tokens"], r["target_tokens"]) == (stats["tokens"], stats["target_tokens"])
        assert (r["examples_windowed"], r["window_pieces"], r["context_tokens_replayed"]) == (
            stats["examples_windowed"], stats["window_pieces"], stats["context_tokens_replayed"])
        assert r["dropped_window_context_too_long"] == stats["examples_dropped"].get("window_context_too_long", 0)
        assert r["examples_dropped"] == sum(stats["examples_dropped"].values())
        assert r["examples_windowed"] > 0
        (published,) = manifest_rows("x", str(folder), manifest, [r["batch_size"]])[0]
        for key in ("examples", "examples_kept", "examples_dropped", "examples_windowed", "window_pieces",
                    "context_tokens_replayed", "dropped_window_context_too_long", "packed_rows", "target_tokens"):
            assert published[key] == r[key], key
    if data == "long_prompt":
        assert rows[0]["dropped_window_context_too_long"] == 1 and rows[0]["examples"] == 3


@pytest.mark.parametrize("argv, message", [
    (["--overlong", "window", "--window-context-tokens", "0"],
     "--window-context-tokens must be a whole number of at least 1, got '0'"),
    (["--overlong", "window", "--window-context-tokens", "a quarter"],
     "--window-context-tokens must be a whole number of at least 1, got 'a quarter'"),
    (["--overlong", "split", "--window-context-tokens", "8"],
     "--window-context-tokens applies to --overlong window only (got --overlong split); add --overlong window or leave it out"),
])
def test_a_bad_window_context_is_refused_in_one_line(tmp_path, capsys, argv, message):
    """The same check and the same words as `prepack pack` (pipelines.options.window_context_option),
    before anything is read."""
    data = tmp_path / "d.jsonl"
    data.write_text(ALPACA_LINES[0] + "\n")
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--output", str(tmp_path / "out"), *argv]) == 2
    assert capsys.readouterr().err.splitlines() == [f"prepack preflight: error: {message}"]
    assert not (tmp_path / "out").exists()


def test_unknown_options_only_pass_through_in_pipeline_mode(tmp_path, capsys):
    assert preflight.main(["--input", "a.jsonl", "--format", "alpaca", "--output", str(tmp_path), "--runner=DataflowRunner"]) == 2
    assert capsys.readouterr().err == ("prepack preflight: error: unknown option --runner (Beam's options are taken only with "
                                       "--pack-output); did you mean --planner?\n")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--input", "{data}", "--format", "nope"], "unknown format 'nope'; expected one of alpaca"),
        (["--input", "{missing}", "--format", "alpaca"], "no such file"),
        (["--input", "{data}", "{data}", "--format", "alpaca", "chat", "chat"], "got 2 inputs and 3 formats"),
        (["--input", "{data}", "--format", "alpaca", "--max-length", "0"], "--max-length must be at least 2, got 0"),
        (["--input", "{folder}/*.parquet", "--format", "alpaca"], "matches no file"),
        (["--input", "{folder}/notes.txt", "--format", "alpaca"], "cannot tell the file format"),
        (["--input", "{data}", "--format", "translation", "--template-option", "source_lang"], "expected KEY=VALUE"),
        # The wrong --format: refused from the first records, in `prepack pack`'s words (pipelines/launch/format_check.py).
        (["--input", "{data}", "--format", "oasst1"],
         "d: {data}: records have keys instruction, input, output, not the message_id, message_tree_id, role, text of "
         "format 'oasst1': try --format alpaca"),
        (["--input", "{data}", "--format", "alpaca", "--max-bad-fraction", "2"], "--max-bad-fraction must be within 0..1"),
    ],
)
def test_bad_input_fails_with_a_clear_message(tmp_path, capsys, argv, message):
    data = tmp_path / "d.jsonl"
    data.write_text(ALPACA_LINES[0] + "\n")
    (tmp_path / "notes.txt").write_text("hello\n")
    subs = {"data": str(data), "missing": str(tmp_path / "missing.jsonl"), "folder": str(tmp_path)}
    argv = [a.format(**subs) for a in argv] + ["--output", str(tmp_path / "out")]
    assert preflight.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("prepack preflight: error: ") and message.format(**subs) in err, err
    assert not (tmp_path / "out").exists()  # nothing written on bad input


def test_bad_records_fail_by_default_as_in_pack(tmp_path, capsys):
    # Pack's default (any bad record fails) and pack's sentence (prepack.packing.bad_records).
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(ALPACA_LINES) + "\n")
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--output", str(tmp_path / "out"), "--no-plots"]) == 2
    assert capsys.readouterr().err == (
        "prepack preflight: error: d: 2 of 5 examples read are bad records (40.00%, more than --max-bad-fraction 0): "
        "malformed_json 1, missing_field 1. Fix the inputs (is --format alpaca right?), or raise --max-bad-fraction "
        "to skip them\n")


@pytest.mark.parametrize("command", ["preflight", "report"])
def test_an_existing_output_is_replaced_only_with_overwrite(tmp_path, capsys, command):
    # One rule for every subcommand that writes, as `prepack pack` refuses an existing shard set.
    from apps import report

    data = tmp_path / "d.jsonl"
    data.write_text(ALPACA_LINES[0] + "\n")
    if command == "preflight":
        target = tmp_path / "out"
        target.mkdir()
        (target / "preflight.json").write_text("{}")
        argv = ["--input", str(data), "--format", "alpaca", "--output", str(target), "--no-plots"]
        main, existing = preflight.main, target / "preflight.json"
    else:
        existing = target = tmp_path / "report.html"
        target.write_text("old")
        argv = ["--preflight", str(tmp_path / "none.json"), "--output", str(target)]
        main = report.main
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"prepack {command}: error: {existing} already exists: refusing to replace "
        f"{'an earlier preflight' if command == 'preflight' else 'an existing report'}. "
        "Pass --overwrite to replace it, or choose another --output\n")
    assert existing.read_text() in ("{}", "old")
    if command == "preflight":
        assert main(argv + ["--overwrite"]) == 0 and json.loads(existing.read_text())["rows"]


def test_counter_of_bad_records_survives_json():
    # bad_records is a Counter internally; the JSON holds a plain sorted dict.
    ex = example_set()
    ex.bad_records = Counter({"wrong_type": 2, "empty_response": 1})
    cfg = PreflightConfig(datasets=(DatasetSpec("hand", "x", "alpaca"),), output="x",
                          rows=RowSpec(inputs=(), format="", max_lengths=(8,)), batch_sizes=(1,))
    result = preflight.run(cfg, lambda spec: ex)
    assert result["datasets"][0]["bad_records"] == {"empty_response": 1, "wrong_type": 2}
    assert result["rows"][0]["bad_records"] == 3


def test_preflight_with_the_embedded_qwen3_tokenizer(tmp_path):
    """--tokenizer qwen3: auto picks Qwen3's ChatML, and the lengths are the qwen3 examples' lengths."""
    from prepack.text.chat import tokenize_conversations
    from prepack.text.formats import get_template
    from prepack.text.tokenizer import load_tokenizer

    records = [{"instruction": f"Count to {i}.", "input": "", "output": " ".join(str(k) for k in range(i))} for i in range(1, 30)]
    data = tmp_path / "alpaca.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out"
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--tokenizer", "qwen3", "--max-length", "64", "128",
                           "--batch-size", "4", "--output", str(out), "--no-plots"]) == 0
    result = json.loads((out / "preflight.json").read_text())
    rows = [r for r in result["rows"] if r["max_length"] == 128]
    assert rows and all(r["tokenizer"] == "qwen3" and r["chat_format"] == "qwen3" for r in rows)
    tok = load_tokenizer("qwen3")
    template = get_template("alpaca")
    lengths = [len(e) for e in tokenize_conversations([c for r in records for c in template.to_conversations(r)], tok, "auto")]
    assert rows[0]["examples_kept"] == sum(n <= 128 for n in lengths) == 29
    assert rows[0]["tokens"] == sum(lengths)
    assert rows[0]["mean_tokens"] == pytest.approx(np.mean(lengths), abs=0.05)


def test_long_reads_report_progress(tmp_path, capsys, monkeypatch):
    # With --max-examples the whole file is read before tokenizing starts: the read reports itself too.
    monkeypatch.setattr(preflight, "PROGRESS_EVERY_S", 0.0)  # report at every chance
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(ALPACA_LINES) + "\n")
    assert preflight.main(["--input", str(data), "--format", "alpaca", "--max-length", "64", "--max-examples", "2",
                           "--no-plots", "--output", str(tmp_path / "out"), "--max-bad-fraction", "0.5"]) == 0
    err = capsys.readouterr().err
    lines = err.splitlines()  # tqdm's counters (pipelines/progress.py), one line per update
    assert any(re.fullmatch(r"preflight: a: read: 5 records in 00:00 \([0-9.]+ records/s\)", line) for line in lines), err
    assert any(re.fullmatch(r"preflight: a: tokenized: 2 examples in 00:00 \([0-9.]+ examples/s\)", line) for line in lines), err
    assert "\r" not in err


def test_plots_without_matplotlib_fail_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    # The README's first install is the pipeline extra only; matplotlib comes with the report extra.
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a))
    data = tmp_path / "a.jsonl"
    data.write_text("\n".join(ALPACA_LINES) + "\n")
    argv = ["--input", str(data), "--format", "alpaca", "--output", str(tmp_path / "out")]
    assert preflight.main(argv) == 2
    assert capsys.readouterr().err == ("prepack preflight: error: plots need matplotlib: pip install 'tunix-prepack[report]' "
                                       "(or -e '.[pipeline,report]' in a checkout), or pass --no-plots\n")
    assert not (tmp_path / "out").exists()


def test_drop_flag_says_what_truncate_would_really_keep(tmp_path, capsys):
    # At L=8 every sample example is dropped and truncating keeps none (no target in the first 8 tokens);
    # at L=64 truncate keeps exactly what a --overlong truncate run reports as truncated.
    from pipelines.options import sample_path

    common = ["--input", sample_path(), "--format", "alpaca", "--max-length", "8", "64", "--no-plots"]
    assert preflight.main(common + ["--output", str(tmp_path / "drop")]) == 0
    flags = [line for line in capsys.readouterr().out.splitlines() if line.startswith("!")]
    assert preflight.main(common + ["--output", str(tmp_path / "truncate"), "--overlong", "truncate"]) == 0
    truncated = {r["max_length"]: r["examples_truncated"]
                 for r in json.loads((tmp_path / "truncate" / "preflight.json").read_text())["rows"]}
    assert truncated[8] == 0 and truncated[64] > 0
    assert flags == [
        "! L=8 drops 400 of 400 examples (100.0%, more than 5%): a longer max length keeps them; "
        "--overlong truncate would keep none (no target within the first L tokens)",
        f"! L=64 drops 173 of 400 examples (43.2%, more than 5%): a longer max length keeps them; "
        f"--overlong truncate would keep {truncated[64]:,} of them",
    ]
