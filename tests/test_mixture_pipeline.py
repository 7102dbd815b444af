"""`prepack pack --mixture`: three real formats mixed, checked per source against a reference
count; provenance in every row; one-line refusals; 1 vs 2 workers byte-identical."""

from __future__ import annotations

import json
import os
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from pipelines.launch.job import run
from pipelines.options import OptionsError, parse_args
from pipelines.launch.errors import JobError
from prepack.format import rowformat
from prepack.packing.mixture import budgets
from prepack.text.formats import get_template
from testkit.pipeline import (IN_PROCESS, TWO_PROCESSES, alpaca_records, chat_records, read_shard_set, segment_key,
                              shard_bytes, tokenized, translation_records, write_jsonl)

LENGTHS = (64, 256)
SOURCES = [  # name, file, format, options, weight, records
    ("alpaca", "alpaca.jsonl", "alpaca", {}, 2, alpaca_records(60)),
    ("chat", "chat.jsonl", "chat", {}, 1, chat_records(30)),
    ("fr", "tr.jsonl", "translation", {"source_lang": "en", "target_lang": "de"}, 1, translation_records()),
]


def mixture_yaml(weights=(2, 1, 1), weight_of="examples", max_repeats=2) -> str:
    lines = [f"weight_of: {weight_of}", f"max_repeats: {max_repeats}", "sources:"]
    for (name, file, fmt, options, _, _), weight in zip(SOURCES, weights):
        lines += [f"  - name: {name}", f"    input: data/{file}", f"    format: {fmt}", f"    weight: {weight}"]
        lines += [f"    {k}: {v}" for k, v in options.items()]
    return "\n".join(lines) + "\n"


def make_inputs(folder) -> str:
    os.makedirs(folder / "data", exist_ok=True)
    for _, file, _, _, _, records in SOURCES:
        write_jsonl(str(folder / "data" / file), records)
    (folder / "mix.yaml").write_text(mixture_yaml())
    return str(folder / "mix.yaml")


def pack(args: list[str], runner=IN_PROCESS):
    config, beam_args = parse_args(args + ["--no-progress"] + runner)
    return run(config, beam_args)


def reference(L: int, weight_of: str = "examples") -> dict[str, list]:
    """Each source's examples kept at L (drop policy), tokenized without the job."""
    out = {}
    for name, _, fmt, options, _, records in SOURCES:
        template = get_template(fmt, **options)
        examples = tokenized([c for r in records for c in template.to_conversations(r)])
        out[name] = [e for e in examples if len(e.input_ids) <= L and np.asarray(e.loss_mask)[1:].any()]
    return out


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mix")
    path = make_inputs(folder)
    out = str(folder / "out")
    pack(["--mixture", path, "--max-length", *map(str, LENGTHS), "--output", out])
    return folder, path, out


@pytest.mark.parametrize("L", LENGTHS)
def test_each_source_matches_a_reference_count(mixed, L):
    _, _, out = mixed
    manifest, rows = read_shard_set(f"{out}/L{L}")
    assert manifest.format_version == rowformat.MIXTURE_FORMAT_VERSION
    assert manifest.field_order == list(rowformat.MIXTURE_FIELD_NAMES)
    mix = manifest.mixture
    assert mix["weight_of"] == "examples" and mix["max_repeats"] == 2 and len(mix["sha256"]) == 64
    ref = reference(L)
    kept = [len(ref[name]) for name, *_ in SOURCES]
    expected = budgets(kept, [Fraction(s[4]) for s in SOURCES], 2)
    by_source = {f["name"]: f for f in mix["sources"]}
    segments: dict[int, Counter] = {i: Counter() for i in (1, 2, 3)}
    for row in rows:
        rowformat.check_row(row, L)
        for k in range(1, int(row["segment_ids"].max()) + 1):
            at = row["segment_ids"] == k
            segments[int(row["source_ids"][at][0])][segment_key(row["input_ids"][at], row["loss_mask"][at])] += 1
    for index, ((name, *_, records), budget) in enumerate(zip(SOURCES, expected), start=1):
        f = by_source[name]
        assert f["kept_weight"] == len(ref[name])
        # examples weighting: the budget is met exactly to within one example
        written = budget.copies * budget.kept + int(budget.rest)
        assert f["examples_written"] == written == sum(segments[index].values())
        assert f["examples_unique"] == min(len(ref[name]), written) if budget.copies <= 1 else len(ref[name])
        assert f["examples_read"] == len(records) == f["examples_unique"] + sum(f["examples_dropped"].values())
        assert abs(f["realized_share"] - f["requested_share"]) <= 0.005
        # every segment of the source is one of its examples, none more often than its copies
        allowed = Counter(segment_key(np.asarray(e.input_ids), np.asarray(e.loss_mask)) for e in ref[name])
        for key, count in segments[index].items():
            assert key in allowed and count <= (budget.copies + 1) * allowed[key]
    assert manifest.stats["examples_written"] == sum(f["examples_written"] for f in mix["sources"])
    assert manifest.stats["examples_dropped"].get("not_sampled", 0) == sum(
        f["examples_dropped"].get("not_sampled", 0) for f in mix["sources"])


def test_loader_yields_source_ids(mixed):
    from loaders.dataset import make_dataset

    _, _, out = mixed
    batch = next(iter(make_dataset(f"{out}/L64", batch_size=4, seed=0, num_epochs=1)))
    assert batch["source_ids"].dtype == np.int32
    assert ((batch["source_ids"] == 0) == (batch["segment_ids"] == 0)).all()
    assert set(np.unique(batch["source_ids"]).tolist()) <= {0, 1, 2, 3}


def test_target_token_weights_within_half_a_point(mixed, tmp_path):
    folder, _, _ = mixed
    path = folder / "mix_tokens.yaml"
    path.write_text(mixture_yaml((3, 1, 1), "target_tokens", 4))
    out = str(tmp_path / "out")
    pack(["--mixture", str(path), "--max-length", "256", "--output", out])
    manifest = json.loads(open(f"{out}/L256/manifest.json").read())
    for f in manifest["mixture"]["sources"]:
        assert abs(f["realized_share"] - f["requested_share"]) <= 0.005
        assert f["written_weight"] == f["target_tokens"]
    assert manifest["mixture"]["limiting_source"] == "fr"


def test_one_and_two_workers_write_the_same_bytes(mixed, tmp_path):
    _, path, out = mixed
    other = str(tmp_path / "two")
    pack(["--mixture", path, "--max-length", *map(str, LENGTHS), "--output", other], TWO_PROCESSES)
    for L in LENGTHS:
        assert shard_bytes(f"{out}/L{L}") == shard_bytes(f"{other}/L{L}")


def test_mixture_with_input_or_format_is_refused(mixed):
    _, path, _ = mixed
    for extra, flag in ((["--input", "x.jsonl"], "--input"), (["--format", "alpaca"], "--format"), (["--sample"], "--sample")):
        with pytest.raises(OptionsError, match=f"--mixture names each source's inputs and format; do not combine it with {flag}$"):
            parse_args(["--mixture", path, "--output", "o", *extra])


def test_a_source_whose_inputs_are_missing(tmp_path):
    path = make_inputs(tmp_path)
    os.remove(tmp_path / "data" / "chat.jsonl")
    with pytest.raises(JobError) as e:
        pack(["--mixture", path, "--max-length", "64", "--output", str(tmp_path / "out")])
    assert str(e.value).startswith("mixture source 'chat': ") and "\n" not in str(e.value)


def test_a_source_with_no_usable_examples(tmp_path):
    path = make_inputs(tmp_path)
    write_jsonl(str(tmp_path / "data" / "tr.jsonl"), [{"en": "word " * 200, "de": "Wort " * 200}] * 3)
    with pytest.raises(JobError) as e:
        pack(["--mixture", path, "--max-length", "64", "--output", str(tmp_path / "out")])
    assert str(e.value).startswith("mixture source 'fr' has no usable examples at max length 64 (3 read, dropped "
                                   "{'too_long': 3})") and "\n" not in str(e.value)
    assert not os.path.exists(tmp_path / "out" / "L64" / "manifest.json")


def test_a_short_mix_fails_unless_allowed(tmp_path):
    path = make_inputs(tmp_path)
    # fr (14 examples) at 30/32 leaves alpaca and chat less than one example each
    (tmp_path / "mix.yaml").write_text(mixture_yaml((1, 1, 30), "examples", 1))
    with pytest.raises(JobError, match=r"the mix misses its shares by more than 0.5%: 'alpaca' reached 0.00% of examples "
                       r"\(asked 3.12%\), .* source 'fr' limits the mix"):
        pack(["--mixture", path, "--max-length", "256", "--output", str(tmp_path / "out")])
    pack(["--mixture", path, "--max-length", "256", "--output", str(tmp_path / "ok"), "--allow-short-mix"])
    assert os.path.exists(tmp_path / "ok" / "L256" / "manifest.json")


def test_remix_from_tokens_equals_a_full_run(mixed, tmp_path):
    folder, _, out = mixed
    new = folder / "remix.yaml"
    new.write_text(mixture_yaml((1, 3, 1), "target_tokens", 3))
    full, remixed = str(tmp_path / "full"), str(tmp_path / "remixed")
    # so few examples cannot meet 1:3:1 by target tokens within 0.5 pp at L64: the point here is equality
    pack(["--mixture", str(new), "--max-length", *map(str, LENGTHS), "--output", full, "--no-tokens", "--allow-short-mix"])
    pack(["--from-tokens", f"{out}/tokens", "--mixture", str(new), "--max-length", *map(str, LENGTHS), "--output", remixed,
          "--allow-short-mix"])
    for L in LENGTHS:
        assert shard_bytes(f"{full}/L{L}") == shard_bytes(f"{remixed}/L{L}")
        a = json.loads(open(f"{full}/L{L}/manifest.json").read())
        b = json.loads(open(f"{remixed}/L{L}/manifest.json").read())
        assert a["mixture"] == b["mixture"] and a["stats"] == b["stats"]
        assert b["lineage"]["from_tokens"] == f"{out}/tokens"


def test_remix_with_other_sources_is_refused(mixed, tmp_path):
    from prepack.format.tokenset import TokenSetError

    folder, _, out = mixed
    other = folder / "other.yaml"
    other.write_text(mixture_yaml().replace("name: chat", "name: dialog"))
    with pytest.raises(JobError) as e:
        pack(["--from-tokens", f"{out}/tokens", "--mixture", str(other), "--output", str(tmp_path / "o")])
    assert "sources ['alpaca', 'dialog', 'fr'] differ from the set's ['alpaca', 'chat', 'fr']" in str(e.value)
    assert "\n" not in str(e.value) and TokenSetError
    options = folder / "options.yaml"
    options.write_text(mixture_yaml().replace("target_lang: de", "target_lang: fr"))
    with pytest.raises(JobError, match=r"source 'fr': options .* differ from the set's"):
        pack(["--from-tokens", f"{out}/tokens", "--mixture", str(options), "--output", str(tmp_path / "p")])


def test_preflight_shows_the_mix_the_job_writes(mixed, tmp_path, capsys):
    from apps.preflight import main

    _, path, out = mixed
    assert main(["--mixture", path, "--max-length", *map(str, LENGTHS), "--batch-size", "8", "--output",
                 str(tmp_path / "pf"), "--no-plots"]) == 0
    assert "(limits the mix)" in capsys.readouterr().out
    result = json.loads((tmp_path / "pf" / "preflight.json").read_text())
    for L in LENGTHS:
        written = {f["name"]: f for f in json.loads(open(f"{out}/L{L}/manifest.json").read())["mixture"]["sources"]}
        for row in (r for r in result["mixture"]["rows"] if r["max_length"] == L):
            f = written[row["source"]]
            assert row["kept_weight"] == f["kept_weight"]
            assert row["repeats"] == pytest.approx(f["repeats"], abs=1 / f["kept_weight"])
            assert row["realized_share"] == pytest.approx(f["realized_share"], abs=0.005)


def test_preflight_refuses_mixture_with_input(mixed, tmp_path, capsys):
    from apps.preflight import main

    _, path, _ = mixed
    assert main(["--mixture", path, "--input", "x.jsonl", "--output", str(tmp_path / "pf")]) == 2
    assert capsys.readouterr().err.strip() == ("prepack preflight: error: --mixture names each source's inputs and "
                                               "format; do not combine it with --input or --format")


def test_report_shows_the_mix_and_loss_by_source(mixed, tmp_path):
    from apps.report import main

    _, _, out = mixed
    metrics = tmp_path / "m.jsonl"
    with open(metrics, "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "loss": 3.0 - step / 10, "step_time_s": 0.5, "target_tokens": 100,
                                "tokens": 200, "target_tokens_per_s": 200.0,
                                "loss_by_source": {"alpaca": 3.1, "chat": 2.9, "fr": None if step == 2 else 3.3},
                                "target_tokens_by_source": {"alpaca": 50, "chat": 25, "fr": 25}}) + "\n")
    assert main(["--shards", out, "--metrics", str(metrics), "--output", str(tmp_path / "r.md")]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "### Mixture" in text and "| 64 | packed | fr | 25.0% | 25.0% |" in text and "### Loss by source" in text
    assert (tmp_path / "r_figures" / "loss_by_source.png").exists() and (tmp_path / "r_figures" / "mixture.png").exists()
    # The shard table counts examples, not copies, and sampling is no max-length loss.
    from apps.report import find_manifests, manifest_rows

    for folder, manifest in find_manifests(out):
        (row,), _ = manifest_rows("mix", folder, manifest, [2])
        assert row["examples"] == manifest.stats["examples_read"] - manifest.stats["bad_records"]
        assert row["examples_dropped"] == sum(v for k, v in manifest.stats["examples_dropped"].items()
                                              if k not in ("not_sampled", "bad_json", "missing_field", "no_targets"))


@pytest.mark.slow  # trains a model: see pytest.ini
def test_train_logs_loss_and_target_tokens_by_source(mixed, tmp_path):
    from train.cli import main

    _, _, out = mixed
    metrics = tmp_path / "m.jsonl"
    assert main(["--shards", f"{out}/L64", "--model", "tiny", "--batch-size", "2", "--steps", "3",
                 "--metrics-out", str(metrics), "--log-every", "0"]) == 0
    steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if "step" in r and "loss" in r]
    assert len(steps) == 3
    for r in steps:
        by = r["target_tokens_by_source"]
        assert sorted(by) == ["alpaca", "chat", "fr"] and sum(by.values()) == r["target_tokens"]
        # the per-source losses are the step loss split by target tokens
        total = sum(r["loss_by_source"][n] * t for n, t in by.items() if t)
        assert total / r["target_tokens"] == pytest.approx(r["loss"], rel=1e-4)
        assert all((r["loss_by_source"][n] is None) == (t == 0) for n, t in by.items())


def test_max_bad_fraction_applies_to_each_source(tmp_path):
    path = make_inputs(tmp_path)
    with open(tmp_path / "data" / "tr.jsonl", "a") as f:
        f.write("not json\n{\"en\": \"only one side\"}\n{oops\n")  # 3 of 17 bad: 17.6% of fr, 2.8% of the mix
    with pytest.raises(JobError) as e:
        pack(["--mixture", path, "--max-length", "256", "--output", str(tmp_path / "out"), "--max-bad-fraction", "0.1"])
    assert str(e.value).startswith("mixture source 'fr' (format translation): 3 of 17 examples read are bad records (17.65%, more than "
                                   "--max-bad-fraction 0.1)") and "\n" not in str(e.value)
    pack(["--mixture", path, "--max-length", "256", "--output", str(tmp_path / "ok"), "--max-bad-fraction", "0.2"])
    fr = json.loads((tmp_path / "ok" / "L256" / "manifest.json").read_text())["mixture"]["sources"][2]
    assert fr["examples_read"] == 17 == fr["examples_unique"] + sum(fr["examples_dropped"].values())


@pytest.mark.parametrize("extra", [["--no-pack"], ["--overlong", "split"], ["--overlong", "truncate"],
                                   ["--overlong", "window"]])
def test_other_packing_options_keep_the_per_source_identity(tmp_path, extra):
    path = make_inputs(tmp_path)
    out = str(tmp_path / "out")
    pack(["--mixture", path, "--max-length", "64", "--output", out, "--allow-short-mix", *extra])
    manifest, rows = read_shard_set(f"{out}/L64")
    for row in rows:
        rowformat.check_row(row, 64)
    per_source = Counter()
    for row in rows:
        for k in range(1, int(row["segment_ids"].max()) + 1):
            per_source[int(row["source_ids"][row["segment_ids"] == k][0])] += 1
    for index, f in enumerate(manifest.mixture["sources"], start=1):
        assert f["examples_written"] == per_source[index]
        assert (f["examples_read"] - f["examples_split"] + f["split_pieces"]
                - f.get("examples_windowed", 0) + f.get("window_pieces", 0)
                == f["examples_unique"] + sum(f["examples_dropped"].values()))
    if "window" in extra:  # some example is longer than 64: the sources count their windowed examples
        assert manifest.stats["examples_windowed"] == sum(f["examples_windowed"] for f in manifest.mixture["sources"]) > 0


def test_remix_of_a_set_without_a_mixture_is_refused(mixed, tmp_path):
    folder, path, _ = mixed
    out = str(tmp_path / "plain")
    pack(["--input", str(folder / "data" / "alpaca.jsonl"), "--format", "alpaca", "--max-length", "64", "--output", out])
    with pytest.raises(JobError) as e:
        pack(["--from-tokens", f"{out}/tokens", "--mixture", path, "--output", str(tmp_path / "o")])
    assert str(e.value) == (f"--mixture {path}: the tokenized set {out}/tokens was not made from a mixture; "
                            "run a full `prepack pack --mixture` instead")


def test_from_tokens_without_mixture_packs_the_recorded_one(mixed, tmp_path):
    _, _, out = mixed
    again = str(tmp_path / "again")
    pack(["--from-tokens", f"{out}/tokens", "--max-length", *map(str, LENGTHS), "--output", again])
    for L in LENGTHS:
        assert shard_bytes(f"{out}/L{L}") == shard_bytes(f"{again}/L{L}")


def test_report_labels_packed_and_unpacked_mixes_of_one_length(mixed, tmp_path):
    from apps.report import main

    folder, path, out = mixed
    unpacked = str(tmp_path / "unpacked")
    pack(["--mixture", path, "--max-length", "64", "--no-pack", "--output", unpacked])
    metrics = tmp_path / "m.jsonl"
    with open(metrics, "w") as f:
        for step in range(1, 8):  # chat only at step 4 (one point), fr absent at steps 3 and 4 (a gap)
            f.write(json.dumps({"step": step, "loss": 3.0 - step / 10, "step_time_s": 0.5, "target_tokens": 100,
                                "tokens": 200, "target_tokens_per_s": 200.0,
                                "loss_by_source": {"alpaca": 3.1 - step / 20, "chat": 2.9 if step == 4 else None,
                                                   "fr": None if step in (3, 4) else 3.3 - step / 30}}) + "\n")
    assert main(["--shards", out, "--shards", unpacked, "--metrics", str(metrics), "--output", str(tmp_path / "r.md")]) == 0
    lines = (tmp_path / "r.md").read_text().splitlines()
    table = [line for line in lines if line.startswith("| 64 |")]
    packed = [line for line in table if line.startswith("| 64 | packed |")]
    one_per_row = [line for line in table if line.startswith("| 64 | unpacked |")]
    # Each set's three sources once, each row saying which set it belongs to.
    assert len(packed) == len(one_per_row) == 3 and len(table) == 6
    assert {line.split(" | ")[2] for line in packed} == {line.split(" | ")[2] for line in one_per_row} == {"alpaca", "chat", "fr"}
    assert (tmp_path / "r_figures" / "mixture.png").exists() and (tmp_path / "r_figures" / "loss_by_source.png").exists()


@pytest.mark.parametrize("overlong,weight_of", [("split", "examples"), ("split", "target_tokens"),
                                                ("window", "examples")])
def test_the_pieces_of_an_example_are_sampled_together(tmp_path, overlong, weight_of):
    """A mixture samples examples, not pieces: every example cut at L64 is written with all of
    its pieces the same number of times (0, 1 or 2), in the source whose partial copy takes some
    of its split examples and not others; and the share of its example each piece carries
    (own targets / example_targets) sums to a whole number of examples. Shown to fail with the
    pieces ranked by their own hashes (pipelines/mix_weights.py Units.of): some examples' pieces
    were written 1 and 2 times, and the share sum was fractional."""
    from prepack.packing.packer import OverlongPolicy, cut_pieces

    path = make_inputs(tmp_path)
    (tmp_path / "mix.yaml").write_text(mixture_yaml(weights=(1, 3, 1), weight_of=weight_of))
    out = str(tmp_path / "out")
    pack(["--mixture", path, "--max-length", "64", "--output", out, "--allow-short-mix", "--overlong", overlong])
    manifest, rows = read_shard_set(f"{out}/L64")
    found, shares = Counter(), Fraction(0)
    for row in rows:
        for k in range(1, int(row["segment_ids"].max()) + 1):
            at = row["segment_ids"] == k
            found[(int(row["source_ids"][at][0]), tuple(row["input_ids"][at].tolist()))] += 1
            own = int(row["loss_mask"][at].sum())
            shares += Fraction(own, int(row["example_targets"][at][0]) or own)
    assert shares.denominator == 1, float(shares)
    policy = OverlongPolicy(overlong)
    cut_counts: dict[int, set] = {}
    for index, (name, _, fmt, options, _, records) in enumerate(SOURCES, start=1):
        template = get_template(fmt, **options)
        examples = tokenized([c for r in records for c in template.to_conversations(r)])
        keys = [[(index, tuple(np.asarray(e.input_ids)[p.positions()].tolist()))
                 for p, why in cut_pieces(np.asarray(e.loss_mask), 64, policy) if why is None]
                for e in examples if len(e.input_ids) > 64]
        alike = Counter(key for pieces in keys for key in pieces)  # a piece two examples share says nothing
        for pieces in keys:
            if len(pieces) > 1 and all(alike[key] == 1 for key in pieces):
                counts = {found[key] for key in pieces}
                assert len(counts) == 1, f"{name}: an example's pieces were written {sorted(counts)} times"
                cut_counts.setdefault(index, set()).update(counts)
    # The case exercised: a source whose partial copy writes some cut examples more often than others.
    assert any(len(c) > 1 for c in cut_counts.values()), cut_counts


def test_a_split_mixture_writes_the_same_bytes_on_one_and_two_workers(tmp_path):
    """The pieces' units (lead pieces, deduplicated candidates) depend on no bundling."""
    path = make_inputs(tmp_path)
    (tmp_path / "mix.yaml").write_text(mixture_yaml(weights=(1, 3, 1)))
    args = ["--mixture", path, "--max-length", "64", "128", "--allow-short-mix", "--overlong", "split"]
    pack(args + ["--output", str(tmp_path / "one")])
    pack(args + ["--output", str(tmp_path / "two")], TWO_PROCESSES)
    for L in (64, 128):
        assert shard_bytes(str(tmp_path / "one" / f"L{L}")) == shard_bytes(str(tmp_path / "two" / f"L{L}"))
