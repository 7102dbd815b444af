"""The mix a user sees: `prepack pack --mixture` prints each length's per-source table, and
`prepack inspect` on a mixture set shows it, names each segment's source and marks the copies
of one example; a source over its own bad fraction is named in one line. Real runs of the
shipped sample mixture (prepack/sample_data/sample_mix.yaml) and of a down-sampled variant."""

from __future__ import annotations

import json
import os
import re

import numpy as np

from prepack.packing.mix_table import mix_rows
from testkit.pipeline import IN_PROCESS, read_shard_set

SAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "prepack", "sample_data")
LENGTHS = (256, 512)


def pack(argv: list[str]) -> int:
    from pipelines.launch import cli

    return cli.main(argv + ["--no-progress", *IN_PROCESS])


def table(printed: str, L: int) -> dict[str, list[str]]:
    """The rows of the table printed for length L: source name -> its cells."""
    lines = printed.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"L{L} mix by "))
    out = {}
    for line in lines[start + 2:]:
        if not line.startswith("  ") or line.startswith("  shares not met"):
            break
        cells = re.split(r"\s{2,}", line.strip())
        out[cells[0]] = cells
    return out


def test_pack_prints_each_lengths_mix(tmp_path, capsys):
    out = str(tmp_path / "out")
    assert pack(["--mixture", os.path.join(SAMPLES, "sample_mix.yaml"), "--max-length", *map(str, LENGTHS),
                 "--output", out]) == 0
    printed = capsys.readouterr().out
    for L in LENGTHS:
        manifest = json.loads(open(f"{out}/L{L}/manifest.json").read())
        assert f"L{L} mix by target_tokens (max_repeats 2; 'alpaca' limits the mix):" in printed
        shown = table(printed, L)
        assert list(shown) == ["alpaca", "chat"]
        for f in manifest["mixture"]["sources"]:
            cells = shown[f["name"]]
            assert cells[1] == f["format"]
            assert cells[2] == f"{f['requested_share']:.2%}" and cells[3] == f"{f['realized_share']:.2%}"
            assert cells[4:7] == [f"{f['examples_unique']:,}", f"{f['examples_written']:,}",
                                  f"{f['examples_written'] - f['examples_unique']:,}"]
            r = f["repeats"]
            assert cells[7] == (f"repeated {r:.2f}x" if r > 1 else f"down-sampled {r:.2f}x" if r < 1 else "used whole")
            assert cells[8] == "0"
            dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(f["examples_dropped"].items()) if v) or "-"
            assert cells[9] == dropped
        # the copies the table shows are the set's
        assert (sum(int(shown[n][6].replace(",", "")) for n in shown) == manifest["stats"]["examples_repeated"])


def test_pack_shows_a_down_sampled_source(tmp_path, capsys):
    mix = tmp_path / "mix.yaml"
    mix.write_text("weight_of: examples\nsources:\n"
                   f"  - {{name: alpaca, input: {SAMPLES}/sample_sft.jsonl, format: alpaca, weight: 1}}\n"
                   f"  - {{name: chat, input: {SAMPLES}/sample_chat.jsonl, format: chat, weight: 1}}\n")
    out = str(tmp_path / "out")
    assert pack(["--mixture", str(mix), "--max-length", "512", "--output", out]) == 0
    shown = table(capsys.readouterr().out, 512)
    alpaca = json.loads(open(f"{out}/L512/manifest.json").read())["mixture"]["sources"][0]
    assert alpaca["repeats"] < 1  # 390 kept against chat's 200 at 1:1
    assert shown["alpaca"][7] == f"down-sampled {alpaca['repeats']:.2f}x"
    assert f"not_sampled {alpaca['examples_dropped']['not_sampled']:,}" in shown["alpaca"][9]
    assert shown["chat"][7] == "used whole" and shown["chat"][6] == "0"


def test_inspect_shows_the_mix_labels_sources_and_marks_copies(tmp_path, capsys):
    from apps.inspect import main

    out = str(tmp_path / "out")
    assert pack(["--mixture", os.path.join(SAMPLES, "sample_mix.yaml"), "--max-length", "512", "--output", out]) == 0
    capsys.readouterr()
    assert main([f"{out}/L512", "--rows", "12", "--ids"]) == 0
    printed = capsys.readouterr().out
    manifest, rows = read_shard_set(f"{out}/L512")
    assert table(printed, 512).keys() == {"alpaca", "chat"}
    names = {i: s["name"] for i, s in enumerate(manifest.mixture["sources"], start=1)}
    segments = {}  # (row, segment) -> (source id, tokens, mask)
    for r, row in enumerate(rows[:12]):
        for k in range(1, int(row["segment_ids"].max()) + 1):
            at = row["segment_ids"] == k
            segments[(r, k)] = (int(row["source_ids"][at][0]), row["input_ids"][at].tobytes(), row["loss_mask"][at].tobytes())
    lines: dict[tuple[int, int], str] = {}  # (row, segment) -> its printed line
    row = None
    for line in printed.splitlines():
        if (m := re.match(r"row (\d+): ", line)):
            row = int(m[1])
        elif (m := re.match(r"  segment (\d+): .*", line)):
            lines[(row, int(m[1]))] = line
    assert lines.keys() == segments.keys()
    marked = 0
    for place, (source, ids, mask) in segments.items():
        line = lines[place]
        assert f"[source {names[source]}]" in line
        same = sorted(p for p, s in segments.items() if p != place and s == (source, ids, mask))
        if same:
            marked += 1
            where = ", ".join(f"row {r} segment {k}" for r, k in same[:3])
            assert f"(same tokens as {where}: a repeated copy: the source is used" in line
        else:
            assert "same tokens" not in line
    assert marked  # the sample repeats alpaca twice: its two copies of the longest example open rows 0 and 1


def test_a_source_over_its_bad_fraction_is_named(tmp_path, capsys):
    mix = tmp_path / "mix.yaml"
    # alpaca's fields, every output empty: every record of that source is bad, a third of the mix's
    dialogs = tmp_path / "dialogs.jsonl"
    dialogs.write_text("".join(json.dumps({"instruction": f"question {i}", "output": ""}) + "\n" for i in range(200)))
    mix.write_text("sources:\n"
                   f"  - {{name: alpaca, input: {SAMPLES}/sample_sft.jsonl, format: alpaca, weight: 1}}\n"
                   f"  - {{name: dialogs, input: {dialogs}, format: alpaca, weight: 1}}\n")
    out = tmp_path / "out"
    assert pack(["--mixture", str(mix), "--max-length", "256", "--output", str(out), "--max-bad-fraction", "0.5"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"prepack pack: mixture source 'dialogs' (format alpaca): 200 of 200 examples read are bad records "
                   f"(100.00%, more than --max-bad-fraction 0.5): empty_response 200; every record of 'dialogs' is bad: "
                   f"check that its input is in format 'alpaca'; nothing was published; they are listed in "
                   f"{out}/L256/dead_letter.failed.jsonl"]
    assert not os.path.exists(out / "L256" / "manifest.json")


def test_a_source_in_another_format_is_refused_before_any_work(tmp_path, capsys):
    mix = tmp_path / "mix.yaml"
    # the chat sample declared as alpaca: refused from its first records, naming the source
    mix.write_text("sources:\n"
                   f"  - {{name: alpaca, input: {SAMPLES}/sample_sft.jsonl, format: alpaca, weight: 1}}\n"
                   f"  - {{name: dialogs, input: {SAMPLES}/sample_chat.jsonl, format: alpaca, weight: 1}}\n")
    out = tmp_path / "out"
    assert pack(["--mixture", str(mix), "--max-length", "256", "--output", str(out)]) == 2  # refused before any work
    assert capsys.readouterr().err == (f"prepack pack: mixture source 'dialogs': {SAMPLES}/sample_chat.jsonl: records have "
                                       "keys messages, not the instruction, output of format 'alpaca': try --format chat\n")
    assert not os.path.exists(out)


def test_a_few_bad_records_name_their_source(tmp_path, capsys):
    data = tmp_path / "chat.jsonl"
    with open(data, "w") as f:
        f.write(open(os.path.join(SAMPLES, "sample_chat.jsonl")).read() + "not json\n")
    mix = tmp_path / "mix.yaml"
    mix.write_text("sources:\n"
                   f"  - {{name: alpaca, input: {SAMPLES}/sample_sft.jsonl, format: alpaca, weight: 1}}\n"
                   f"  - {{name: chat, input: {data}, format: chat, weight: 1}}\n")
    assert pack(["--mixture", str(mix), "--max-length", "256", "--output", str(tmp_path / "out")]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == ("prepack pack: mixture source 'chat' (format chat): 1 of 201 examples read are bad records "
                    "(0.50%, more than --max-bad-fraction 0): malformed_json 1; fix the records of 'chat', or raise "
                    "--max-bad-fraction to skip them; nothing was published; they are listed in "
                    f"{tmp_path}/out/L256/dead_letter.failed.jsonl")


def test_mix_rows_read_a_manifests_figures():
    mixture = {"weight_of": "examples", "max_repeats": 1, "limiting_source": "b", "sources": [
        {"name": "a", "format": "alpaca", "requested_share": 0.5, "realized_share": 0.5, "examples_read": 10,
         "examples_unique": 4, "examples_written": 4, "repeats": 0.5,
         "examples_dropped": {"not_sampled": 4, "bad_json": 2, "too_long": 0}},
    ]}
    (row,) = mix_rows(mixture)
    assert row.bad_records == 2 and row.bad_fraction == 0.2 and row.dropped == {"not_sampled": 4, "bad_json": 2}
    assert row.use == "down-sampled 0.50x" and np.isclose(row.requested_share, 0.5)
