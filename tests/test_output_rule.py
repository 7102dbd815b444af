"""The one output rule (prepack/storage/output_rule.py) and the own-files writer (prepack/storage/own_files.py).

The rule on each path form a careless command line gives (`.`, `..`, `./`, a trailing slash, a
symlink to a parent, a shard set's folder and its parent, an adapter folder as an export's
output, gs:// prefixes), then each command that writes refusing before any work, in one line
naming both paths, with what it reads left as it was (issue 57's cases); and --overwrite of a
folder replacing only the command's own files.
"""

from __future__ import annotations

import os

import pytest

from prepack.storage import output_rule, own_files
from prepack.storage.output_rule import Place, RunPaths
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)


def refusal(inputs=(), outputs=(), inside=None, cwd=None) -> str | None:
    return output_rule.refusal(RunPaths([Place(*i) for i in inputs], [Place(*o) for o in outputs], inside or {}), cwd=cwd)


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """tmp/work (the working folder) holding S/L256 (a shard set), A (an adapter), sub/."""
    work = tmp_path / "work"
    for folder in ("S/L256", "A", "sub"):
        (work / folder).mkdir(parents=True)
    monkeypatch.chdir(work)
    return work


# ----------------------------------------------------------------------------- the working folder and above


@pytest.mark.parametrize("path", [".", "./", "..", "../", "sub/..", "sub/../", "../work", str(os.sep)])
def test_the_working_folder_and_those_above_it_are_refused(tree, path):
    line = refusal(outputs=[("--save-lora", path)])
    assert line is not None and line.startswith(f"--save-lora {path} is ") and "working folder" in line, line
    assert "give --save-lora a new folder of its own" in line and "\n" not in line


def test_a_symlink_to_a_parent_is_that_parent(tree):
    os.symlink("..", "sub/up")  # work/sub/up -> work
    line = refusal(outputs=[("--output", "sub/up")])
    assert line == (f"--output sub/up is the working folder ({tree}); writing there could replace the files of this "
                    "run and others: give --output a new folder of its own")
    os.symlink(str(tree / "S"), "link-to-S")
    assert refusal([("--shards", "S/L256")], [("--save-lora", "link-to-S/")]) == (
        "--save-lora link-to-S/ contains the input --shards S/L256; writing there could replace or delete what this run "
        "reads: give --save-lora a path outside every input")


def test_a_folder_inside_the_working_folder_is_fine(tree):
    assert refusal(outputs=[("--save-lora", "sub/adapter")]) is None
    assert refusal(outputs=[("--save-lora", "./sub/adapter/")]) is None


# ----------------------------------------------------------------------------- outputs against inputs


@pytest.mark.parametrize(("output", "how"), [
    ("S", "contains"), ("S/", "contains"), ("./S", "contains"), ("S/L256", "is"), ("S/L256/", "is"),
    ("S/L256/adapter", "lies inside"), ("sub/../S/L256", "is"),
])
def test_the_shard_set_its_folder_and_inside_it_are_refused(tree, output, how):
    assert refusal([("--shards", "S/L256")], [("--save-lora", output)]) == (
        f"--save-lora {output} {how} the input --shards S/L256; writing there could replace or delete what this run "
        "reads: give --save-lora a path outside every input")


def test_an_adapter_folder_is_no_export_output(tree):
    assert refusal([("--lora", "A")], [("--output", "A/")]).startswith("--output A/ is the input --lora A;")
    assert refusal([("--lora", "A")], [("--output", "A/merged")]).startswith("--output A/merged lies inside the input --lora A;")
    assert refusal([("--lora", "A")], [("--output", "B")]) is None


def test_gcs_is_compared_by_bucket_and_path_components():
    assert refusal([("--shards", "gs://b/a")], [("--save-lora", "gs://b/ab")]) is None
    assert refusal([("--shards", "gs://b/a")], [("--save-lora", "gs://c/a")]) is None
    assert refusal([("--shards", "gs://b/a/L256/")], [("--save-lora", "gs://b/a")]).startswith(
        "--save-lora gs://b/a contains the input --shards gs://b/a/L256/")
    assert refusal([("--shards", "gs://b/a")], [("--save-lora", "gs://b//a/")]).startswith("--save-lora gs://b//a/ is the input")
    assert refusal([("--shards", "gs://b/a")], [("--save-lora", "/a")]) is None  # a local /a is another place


def test_a_place_that_names_nothing_is_refused_first():
    assert refusal([("--shards", "s")], [("--output", "gs:///x")]) == "--output 'gs:///x' names no bucket: write gs://BUCKET/FOLDER"


def test_input_specs_become_the_places_they_read(tree):
    places = output_rule.input_places("--input", ["data/*.jsonl", "d/", "hf:org/set", "tfds:mnist", "hf:./f", "sp:t.model",
                                                 "gs://b/x/*.json", None, "a.jsonl"])
    assert places == [Place("--input", "data", whole=False), Place("--input", "d", whole=False), Place("--input", "./f"),
                      Place("--input", "t.model"), Place("--input", "gs://b/x", whole=False), Place("--input", "a.jsonl")]
    # A glob's folder: the output may lie inside it (the run reads only the files that match), not be or hold it.
    assert refusal([("--input", "data", False)], [("--output", "data/out")]) is None
    assert refusal([("--input", "data", False)], [("--output", "data")]).startswith("--output data is the input --input data")
    assert refusal([("--input", "data/a.jsonl")], [("--output", "data")]).startswith("--output data contains the input")


def test_an_input_the_layout_puts_inside_the_output_is_allowed_only_there(tree):
    inside = {("--from-tokens", "--output"): "tokens"}
    assert refusal([("--from-tokens", "OUT/tokens/")], [("--output", "OUT")], inside) is None
    assert refusal([("--from-tokens", "OUT/L512")], [("--output", "OUT")], inside).startswith(
        "--output OUT contains the input --from-tokens OUT/L512")
    assert refusal([("--from-tokens", "OUT")], [("--output", "OUT/tokens")], inside).startswith(
        "--output OUT/tokens lies inside the input --from-tokens OUT")


# ----------------------------------------------------------------------------- outputs against each other


def test_overlapping_outputs_are_refused_unless_documented(tree):
    assert refusal(outputs=[("--save-lora", "DIR"), ("--metrics-out", "DIR/m.jsonl")]) == (
        "--save-lora DIR contains --metrics-out DIR/m.jsonl; one output's writer could replace the other's files: give "
        "each output its own path, neither inside the other")
    assert refusal(outputs=[("--checkpoint-dir", "DIR/ckpt"), ("--save-lora", "DIR/")]).startswith(
        "--checkpoint-dir DIR/ckpt lies inside --save-lora DIR/")
    assert refusal(outputs=[("--save-lora", "DIR"), ("--tensorboard", "./DIR/")]).startswith("--save-lora DIR is --tensorboard ./DIR/")
    inside = {("--profile-dir", "--tensorboard"): ""}
    assert refusal(outputs=[("--tensorboard", "tb"), ("--profile-dir", "tb")], inside=inside) is None
    assert refusal(outputs=[("--tensorboard", "tb"), ("--profile-dir", "tb/p")], inside=inside) is None
    assert refusal(outputs=[("--tensorboard", "tb/t"), ("--profile-dir", "tb")], inside=inside).startswith(
        "--tensorboard tb/t lies inside --profile-dir tb")


# ----------------------------------------------------------------------------- the own-files writer


def owns_ab(name: str) -> bool:
    return name in ("a.bin", "b.json", "stale.bin")


def test_only_the_commands_own_files_are_replaced_or_removed(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (target / "data").mkdir()
    (target / "data" / "x.jsonl").write_text("{}")
    (target / "a.bin").write_bytes(b"old")
    (target / "stale.bin").write_bytes(b"stale")  # of the command's kind, not written this time: removed
    assert own_files.write_own_files(str(target), {"a.bin": b"new", "b.json": b"{}"}, owns_ab) == ["a.bin", "b.json"]
    assert sorted(p.name for p in target.iterdir()) == ["a.bin", "b.json", "data", "notes.txt"]
    assert (target / "a.bin").read_bytes() == b"new" and (target / "notes.txt").read_text() == "mine"
    assert (target / "data" / "x.jsonl").read_text() == "{}"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging left beside it


def test_a_file_the_command_does_not_own_changes_nothing(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "a.bin").write_bytes(b"old")
    with pytest.raises(own_files.OwnFilesError, match="notes.txt, which this command does not know as its own; nothing was replaced"):
        own_files.write_own_files(str(target), {"a.bin": b"new", "notes.txt": b"x"}, owns_ab)
    assert [p.name for p in target.iterdir()] == ["a.bin"] and (target / "a.bin").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


@pytest.mark.parametrize("fail_at", [1, 2, 4])  # moving an old file aside, then placing a new one
def test_a_swap_that_fails_midway_puts_the_old_files_back(tmp_path, monkeypatch, fail_at):
    target = tmp_path / "out"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    (target / "a.bin").write_bytes(b"old a")
    (target / "b.json").write_bytes(b"old b")
    (target / "stale.bin").write_bytes(b"stale")
    real, calls = os.replace, []

    def failing(src, dst):
        calls.append(dst)
        if len(calls) == fail_at:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(own_files.os, "replace", failing)
    with pytest.raises(OSError, match="No space left"):
        own_files.write_own_files(str(target), {"a.bin": b"new a", "b.json": b"new b"}, owns_ab)
    monkeypatch.setattr(own_files.os, "replace", real)
    # never the new adapter beside the old config: the folder is as it was
    assert {p.name: p.read_bytes() for p in target.iterdir()} == {
        "notes.txt": b"mine", "a.bin": b"old a", "b.json": b"old b", "stale.bin": b"stale"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_on_gcs_only_the_commands_own_objects_are_replaced_or_removed(gcs_emulator, gcs_prefix):  # noqa: F811
    from prepack import storage

    target = f"{gcs_prefix}/out"
    for name, data in (("notes.txt", b"mine"), ("a.bin", b"old"), ("stale.bin", b"stale"), ("deeper/stale.bin", b"x")):
        storage.storage_for(target).write(f"{target}/{name}", data)
    assert own_files.write_own_files(target, {"b.json": b"{}", "a.bin": b"new"}, owns_ab) == ["a.bin", "b.json"]
    assert sorted(p[len(target) + 1:] for p in storage.storage_for(target).list_files(target)) == [
        "a.bin", "b.json", "deeper/stale.bin", "notes.txt"]
    assert storage.read_bytes(f"{target}/a.bin") == b"new" and storage.read_bytes(f"{target}/notes.txt") == b"mine"


def test_a_new_folder_is_made(tmp_path):
    own_files.write_own_files(str(tmp_path / "new" / "out"), {"a.bin": b"1"}, owns_ab)
    assert (tmp_path / "new" / "out" / "a.bin").read_bytes() == b"1"


# ----------------------------------------------------------------------------- each command, before any work


@pytest.fixture
def shard_set(tree):
    from testkit.shard_sets import build_shard_set

    build_shard_set(tree / "S" / "L256", num_rows=4, num_shards=1, max_length=256)
    (tree / "S" / "published.json").write_text("{}")
    return tree / "S"


def listing(folder) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.mark.parametrize(("save_lora", "how"), [("S", "contains"), ("S/L256", "is"), (".", "is the working folder"),
                                                ("./", "is the working folder")])
def test_train_refuses_before_step_1_and_the_shard_set_stays(shard_set, capsys, save_lora, how):
    from train import cli

    before = listing(shard_set.parent)
    argv = ["--shards", "S/L256", "--model", "tiny-gemma3", "--weights", "random", "--steps", "1", "--batch-size", "1",
            "--save-lora", save_lora, "--overwrite"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prepack train: --save-lora {save_lora} {how}") and err.count("\n") == 1, err
    assert listing(shard_set.parent) == before


def test_train_refuses_a_parent_from_a_subfolder_and_outputs_inside_outputs(shard_set, capsys, monkeypatch):
    from train import cli

    common = ["--model", "tiny-gemma3", "--weights", "random", "--steps", "1", "--batch-size", "1", "--overwrite"]
    monkeypatch.chdir(shard_set.parent / "sub")
    assert cli.main(["--shards", "../S/L256", "--save-lora", "..", *common]) == 2
    assert capsys.readouterr().err.startswith("prepack train: --save-lora .. is a folder above the working folder")
    monkeypatch.chdir(shard_set.parent)
    assert cli.main(["--shards", "S/L256", "--save-lora", "DIR", "--metrics-out", "DIR/m.jsonl", *common]) == 2
    assert capsys.readouterr().err == ("prepack train: --metrics-out DIR/m.jsonl lies inside --save-lora DIR; one output's "
                                       "writer could replace the other's files: give each output its own path, neither "
                                       "inside the other\n")
    assert cli.main(["--shards", "S/L256", "--save-lora", "DIR", "--checkpoint-dir", "DIR/ckpt", *common]) == 2
    assert capsys.readouterr().err.startswith("prepack train: --checkpoint-dir DIR/ckpt lies inside --save-lora DIR;")
    assert not (shard_set.parent / "DIR").exists()


@pytest.mark.parametrize(("kw", "start"), [
    ({"eval_generate": "sub/held.jsonl", "metrics_out": "sub/held.jsonl/"}, "--metrics-out sub/held.jsonl/ is the input --eval-generate"),
    ({"eval_shards": "E/L256", "tensorboard": "E"}, "--tensorboard E contains the input --eval-shards E/L256"),
    ({"weights": "W", "checkpoint_dir": "W/ckpt"}, "--checkpoint-dir W/ckpt lies inside the input --weights W"),
    ({"profile_steps": "1:1", "profile_dir": "A", "save_lora": "A/x"}, "--save-lora A/x lies inside --profile-dir A"),
    ({"compile_cache": "S/L256/xla"}, "--compile-cache S/L256/xla lies inside the input --shards S/L256"),
    ({"compile_cache": ".."}, "--compile-cache .. is a folder above the working folder"),
])
def test_train_lists_every_input_and_output(tree, kw, start):
    from train.run_config import outputs
    from train.run_config.config import TrainConfig, TrainError

    with pytest.raises(TrainError) as e:  # resolved as `prepack train` resolves its options, then checked
        outputs.check_outputs(outputs.with_resolved_paths(TrainConfig(shards="S/L256", steps=2, **kw)))
    assert str(e.value).startswith(start), e.value
    # --profile-dir defaults to the --tensorboard folder: documented to live there, allowed
    outputs.check_outputs(TrainConfig(shards="S/L256", steps=2, weights="random", tensorboard="tb", profile_steps="1:1"))
    outputs.check_outputs(TrainConfig(shards="S/L256", steps=2, tensorboard="tb", profile_dir="tb/trace", profile_steps="1:1"))


@pytest.mark.parametrize("output", [".", "./", "A", "A/"])
def test_export_refuses_the_working_folder_and_the_adapter_before_reading_it(tree, capsys, output):
    from train.adapter_files import merge_export

    (tree / "A" / "adapter_config.json").write_text("{}")
    assert merge_export.main(["--merge", "--lora", "A", "--output", output, "--overwrite"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prepack export: --output {output} is ") and err.count("\n") == 1, err
    assert (tree / "A" / "adapter_config.json").read_text() == "{}"


def test_generate_refuses_an_output_inside_its_adapter_or_over_its_input(tree, capsys):
    from apps import generate

    (tree / "held.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n')
    base = ["--input", "held.jsonl", "--format", "alpaca", "--model", "tiny-gemma3", "--weights", "random"]
    assert generate.main([*base, "--lora", "A", "--output", "A/gen.jsonl"]) == 2
    assert capsys.readouterr().err.startswith("prepack generate: --output A/gen.jsonl lies inside the input --lora A;")
    assert generate.main([*base, "--output", "held.jsonl", "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith("prepack generate: --output held.jsonl is the input --input held.jsonl;")
    assert (tree / "held.jsonl").read_text().startswith('{"instruction"')


def test_tokenizer_folder_refuses_the_working_folder_and_its_template(tree, capsys):
    from apps import tokenizer_folder

    assert tokenizer_folder.main(["--output", ".", "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith("prepack tokenizer-folder: --output . is the working folder")
    (tree / "sub" / "t.jinja").write_text("{{ x }}")
    assert tokenizer_folder.main(["--output", "sub", "--template", "sub/t.jinja", "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith("prepack tokenizer-folder: --output sub contains the input --template sub/t.jinja")
    assert listing(tree / "sub") == ["t.jinja"]


def test_report_and_preflight_refuse_outputs_over_their_inputs(tree, capsys):
    from apps import preflight, report

    (tree / "sub" / "a.jsonl").write_text('{"instruction": "Say hi", "input": "", "output": "Hi there!"}\n')
    (tree / "m.jsonl").write_text("{}\n")
    assert report.main(["--metrics", "run=m.jsonl", "--output", "m.jsonl", "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith("prepack report: error: --output m.jsonl is the input --metrics m.jsonl;")
    assert preflight.main(["--input", "sub/a.jsonl", "--format", "alpaca", "--no-plots", "--output", "sub"]) == 2
    assert capsys.readouterr().err.startswith("prepack preflight: error: --output sub contains the input --input sub/a.jsonl;")
    assert preflight.main(["--input", "sub/a.jsonl", "--format", "alpaca", "--no-plots", "--output", "p",
                           "--pack-output", "p/sets"]) == 2
    assert capsys.readouterr().err.startswith("prepack preflight: error: --output p contains --pack-output p/sets;")
    assert listing(tree / "sub") == ["a.jsonl"] and not (tree / "p").exists()


def test_pack_refuses_an_output_over_its_inputs_but_takes_its_own_tokens(tree):
    from pipelines.options import OptionsError, parse_args

    (tree / "sub" / "a.jsonl").write_text("{}\n")
    with pytest.raises(OptionsError, match=r"^--output sub contains the input --input sub/a.jsonl; .* outside every input$"):
        parse_args(["--input", "sub/a.jsonl", "--format", "alpaca", "--output", "sub"])
    with pytest.raises(OptionsError, match=r"^--output \. is the working folder"):
        parse_args(["--input", "sub/a.jsonl", "--format", "alpaca", "--output", "."])
    (tree / "OUT").mkdir()
    (tree / "OUT" / "mix.yaml").write_text(f"sources: [{{name: a, input: {tree}/sub/a.jsonl, format: alpaca, weight: 1}}]\n")
    with pytest.raises(OptionsError, match=r"^--output OUT contains the input --mixture OUT/mix.yaml"):
        parse_args(["--mixture", "OUT/mix.yaml", "--allow-local-inputs", "--output", "OUT"])
    with pytest.raises(OptionsError, match=r"^--output sub contains the input --input .*/sub/a.jsonl"):  # a source of it
        parse_args(["--mixture", "OUT/mix.yaml", "--allow-local-inputs", "--output", "sub"])
    config, _ = parse_args(["--from-tokens", "OUT/tokens", "--max-length", "512", "--output", "OUT"])
    assert config.run.from_tokens == "OUT/tokens"
    with pytest.raises(OptionsError, match=r"^--output OUT contains the input --from-tokens OUT/L512"):
        parse_args(["--from-tokens", "OUT/L512", "--max-length", "512", "--output", "OUT"])


def test_preflight_overwrite_keeps_a_users_file(tree, capsys):
    from apps import preflight

    (tree / "sub" / "a.jsonl").write_text('{"instruction": "Say hi", "input": "", "output": "Hi there!"}\n')
    (tree / "p").mkdir()
    (tree / "p" / "notes.txt").write_text("mine")
    argv = ["--input", "sub/a.jsonl", "--format", "alpaca", "--no-plots", "--output", "p"]
    assert preflight.main(argv) == 0
    assert preflight.main(argv) == 2 and "--overwrite" in capsys.readouterr().err
    assert preflight.main(argv + ["--overwrite"]) == 0
    assert (tree / "p" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (tree / "p").iterdir()) == ["notes.txt", "preflight.csv", "preflight.json"]


def test_verify_keeps_the_compile_cache_out_of_the_set(tree):
    import argparse

    from apps import verify

    assert verify.compile_cache_refusal(argparse.Namespace(set="S", compile_cache="S/L256/xla")).startswith(
        "--compile-cache S/L256/xla lies inside the input SET S")
    assert verify.compile_cache_refusal(argparse.Namespace(set="S", compile_cache="off")) is None
    assert verify.compile_cache_refusal(argparse.Namespace(set="S", compile_cache="elsewhere")) is None
