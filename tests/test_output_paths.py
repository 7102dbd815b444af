"""One resolved path per output (prepack/storage/output_rule.py `output_path`), used by the rule and the writer alike.

Each command resolves each output path once, as the kernel does (links followed, then `..`), where
it reads its options; the output rule judges that string and the writer writes at it. Two links in
the working folder spell each output so that its spelling and its place disagree:
- `up -> work/x/y`: `up/../../S/L256` reads as a folder beside the working folder but is the shard
  set itself: every command refuses it in one line, and the input's bytes stay;
- `away -> elsewhere/deep`: `away/../S/L256` reads as the shard set but is elsewhere/S/L256: the
  rule lets it through, and the writer writes there, not into the input (os.path.abspath's place,
  where the writers used to write).
And a dangling link or a link loop named as an output is refused as what it is, not as "a file".
"""

from __future__ import annotations

import argparse
import io
import os

import pytest

from prepack.storage import output_rule, own_files, places

SHARDS = "S/L256"


@pytest.fixture
def tree(tmp_path, monkeypatch):
    """tmp/work (the working folder): the shard set S/L256, an adapter folder A, sub/a.jsonl, held.jsonl,
    x/y, and the links up -> work/x/y, away -> tmp/elsewhere/deep, dang -> a missing path, loop -> loop."""
    from testkit.shard_sets import build_shard_set

    work = tmp_path / "work"
    build_shard_set(work / "S" / "L256", num_rows=4, num_shards=1, max_length=256)
    for folder in ("A", "sub", "x/y"):
        (work / folder).mkdir(parents=True)
    (work / "A" / "adapter_config.json").write_text("{}")
    (work / "sub" / "a.jsonl").write_text('{"instruction": "Say hi", "input": "", "output": "Hi there!"}\n')
    (work / "held.jsonl").write_text('{"instruction": "a", "input": "", "output": "b"}\n')
    (tmp_path / "elsewhere" / "deep").mkdir(parents=True)
    os.symlink(work / "x" / "y", work / "up")
    os.symlink(tmp_path / "elsewhere" / "deep", work / "away")
    os.symlink(tmp_path / "missing" / "target", work / "dang")
    os.symlink("loop", work / "loop")
    monkeypatch.chdir(work)
    return work


def into(path: str) -> str:
    """`path` in the working folder, spelled as if beside it: up/../../PATH."""
    return f"up/../../{path}"


def away(path: str) -> str:
    """A path that reads as `path` in the working folder and is really elsewhere/PATH."""
    return f"away/../{path}"


def elsewhere(tree, path: str) -> str:
    return str(tree.parent / "elsewhere" / path)


def contents(tree) -> dict[str, bytes]:
    """Every input file's bytes (the links and what the commands may add beside them left out)."""
    found = {}
    for top in ("S", "A", "sub", "held.jsonl"):
        root = tree / top
        for p in [root] if root.is_file() else sorted(root.rglob("*")):
            if p.is_file():
                found[str(p.relative_to(tree))] = p.read_bytes()
    return found


def resolves(given: str, real) -> str:
    return f"{given} (resolves to {real})"


# ----------------------------------------------------------------------------- the one resolution


def test_resolved_is_the_kernels_place(tree):
    for path in (into(SHARDS), away(SHARDS), "up/..", "away/..", "new/../S", "./S/", "x/y/../../A", str(tree / "A")):
        assert places.resolved(path) == os.path.realpath(path)
    assert places.resolved(into(SHARDS)) == str(tree / SHARDS)
    assert places.resolved(away(SHARDS)) == elsewhere(tree, SHARDS)  # os.path.abspath says work/S/L256
    assert places.resolved("~/x") == os.path.join(os.path.expanduser("~"), "x")
    assert places.resolved("gs://b/a/../x/") == "gs://b/a/../x/"
    assert output_rule.output_path("--output", away("A")) == elsewhere(tree, "A")


def test_links_that_name_no_place_are_named(tree):
    missing = tree.parent / "missing" / "target"
    assert places.link_problem("dang") == (f" is a dangling link (to {missing}, which does not exist); remove the link "
                                                "or give another path")
    assert places.link_problem("dang/x") == (f": {tree}/dang is a dangling link (to {missing}, which does not exist); "
                                                  "remove the link or give another path")
    assert places.link_problem("loop") == " is a link loop (following it never ends); remove the link or give another path"
    assert places.link_problem("up/../../loop/x").startswith(f": {tree}/loop is a link loop")
    assert places.link_problem("new/x") is None and places.link_problem(away("new")) is None
    with pytest.raises(output_rule.OutputPathError, match=r"^--save-lora dang is a dangling link \(to "):
        output_rule.output_path("--save-lora", "dang")
    # a caller that did not resolve first: the rule refuses it too
    run = output_rule.RunPaths([output_rule.Place("--shards", SHARDS)], [output_rule.Place("--save-lora", "loop")])
    assert output_rule.refusal(run).startswith("--save-lora loop is a link loop")


# ----------------------------------------------------------------------------- train: every output

TRAIN = ["--shards", SHARDS, "--model", "tiny-gemma3", "--weights", "random", "--steps", "1", "--batch-size", "1",
         "--overwrite"]


@pytest.mark.parametrize(("flag", "path", "how", "more"), [
    ("--save-lora", SHARDS, "is", []),
    ("--checkpoint-dir", f"{SHARDS}/ck", "lies inside", []),
    ("--tensorboard", "S", "contains", []),
    ("--profile-dir", f"{SHARDS}/trace", "lies inside", ["--profile-steps", "1:1"]),
    ("--metrics-out", f"{SHARDS}/m.jsonl", "lies inside", []),
    ("--compile-cache", f"{SHARDS}/xla", "lies inside", []),
])
def test_train_refuses_an_output_that_really_lies_in_its_shards(tree, capsys, flag, path, how, more):
    from train import cli

    before = contents(tree)
    assert cli.main([*TRAIN, flag, into(path), *more]) == 2
    assert capsys.readouterr().err == (
        f"prepack train: {flag} {resolves(into(path), tree / path)} {how} the input --shards {SHARDS}; writing there could "
        f"replace or delete what this run reads: give {flag} a path outside every input\n")
    assert contents(tree) == before and not (tree / SHARDS / "ck").exists()


@pytest.mark.parametrize("variable", ["JAX_COMPILATION_CACHE_DIR", "XDG_CACHE_HOME"])
def test_train_refuses_a_default_compile_cache_that_really_lies_in_its_shards(tree, capsys, monkeypatch, variable):
    from train import cli

    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR", raising=False)
    monkeypatch.setenv(variable, into(SHARDS))
    folder = into(SHARDS) if variable == "JAX_COMPILATION_CACHE_DIR" else os.path.join(into(SHARDS), "prepack", "xla")
    before = contents(tree)
    assert cli.main(TRAIN) == 2
    err = capsys.readouterr().err
    how = "is" if variable == "JAX_COMPILATION_CACHE_DIR" else "lies inside"
    label = variable if variable == "JAX_COMPILATION_CACHE_DIR" else "--compile-cache's default"
    assert err.startswith(f"prepack train: {label} {resolves(folder, places.resolved(folder))} {how} the "
                          f"input --shards {SHARDS};") and err.count("\n") == 1, err
    assert contents(tree) == before


def test_train_checks_and_writes_each_output_at_its_resolved_place(tree, monkeypatch):
    """The options the writers get are the resolved places (elsewhere/...), which the rule lets
    through; the spelling alone (work/S/L256/...) would be the shard set."""
    from train import cli, trainer
    from train.run_config import outputs

    seen = []
    monkeypatch.setattr(trainer, "run", lambda cfg: seen.append(cfg) or {})
    names = {"--save-lora": "adapter", "--checkpoint-dir": "ck", "--tensorboard": "tb", "--profile-dir": "tb/trace",
             "--metrics-out": "m.jsonl", "--compile-cache": "xla"}
    argv = [*TRAIN, "--profile-steps", "1:1"]
    for flag, name in names.items():
        argv += [flag, away(f"{SHARDS}/{name}")]  # reads as inside the shard set
    assert cli.main(argv) == 0
    cfg = seen[0]
    got = {flag: getattr(cfg, flag[2:].replace("-", "_")) for flag in names}
    assert got == {flag: elsewhere(tree, f"{SHARDS}/{name}") for flag, name in names.items()}
    before = contents(tree)
    outputs.check_outputs(cfg)  # the rule and the other checks judge those strings: nothing refused
    assert outputs.profile_folder(cfg) == elsewhere(tree, f"{SHARDS}/tb/trace")
    assert contents(tree) == before


def test_every_train_output_is_resolved():
    from train.run_config import outputs
    from train.run_config.config import TrainConfig

    cfg = TrainConfig(shards="s", steps=5, metrics_out="m", checkpoint_dir="c", save_lora="a", tensorboard="t",
                      profile_dir="p", profile_steps="1:1", compile_cache="x")
    listed = {o.flag for o in outputs.run_outputs(cfg)}
    assert listed == {*outputs.OUTPUT_FIELDS, "--compile-cache"}  # the cache: compile_cache.resolved_option


def test_the_writers_write_at_the_resolved_place(tree):
    """Given a spelling that reads as the shard set, each writer writes where the kernel resolves
    it, as the rule judged it (a library caller that did not resolve first included)."""
    import jax

    from train.checkpointing import checkpoints
    from train.measurement.metrics import MetricsRecorder, TensorBoard
    from train.compilation import compile_cache

    before, listed = contents(tree), sorted(os.listdir(tree / SHARDS))
    own_files.write_own_files(away(SHARDS), {"adapter_model.safetensors": b"new"}, lambda name: name.endswith(".safetensors"))
    assert open(elsewhere(tree, f"{SHARDS}/adapter_model.safetensors"), "rb").read() == b"new"
    assert checkpoints.CheckpointDir(away(f"{SHARDS}/ck/")).path == elsewhere(tree, f"{SHARDS}/ck")
    recorder = MetricsRecorder(away(f"{SHARDS}/m.jsonl"), out=io.StringIO())
    recorder.close({})
    assert os.path.isfile(elsewhere(tree, f"{SHARDS}/m.jsonl"))
    board = TensorBoard(away("S/tb"))
    board.step({"step": 1, "loss": 1.0})  # the writer (and its folder) is made at the first scalar
    board.close()
    assert os.listdir(elsewhere(tree, "S/tb"))
    try:
        assert compile_cache.enable(away(f"{SHARDS}/xla"), io.StringIO()) == elsewhere(tree, f"{SHARDS}/xla")
        assert jax.config.jax_compilation_cache_dir == elsewhere(tree, f"{SHARDS}/xla")
    finally:
        compile_cache.enable(None, io.StringIO())
    assert os.path.isdir(elsewhere(tree, f"{SHARDS}/xla"))
    assert contents(tree) == before and sorted(os.listdir(tree / SHARDS)) == listed


@pytest.mark.parametrize(("argv", "line"), [
    (["--save-lora", "dang"], "--save-lora dang is a dangling link (to {missing}, which does not exist); remove the link "
                              "or give another path"),
    (["--save-lora", "loop"], "--save-lora loop is a link loop (following it never ends); remove the link or give another path"),
    (["--checkpoint-dir", "dang/ck"], "--checkpoint-dir dang/ck: {tree}/dang is a dangling link (to {missing}, which does not "
                                      "exist); remove the link or give another path"),
    (["--metrics-out", "loop/m.jsonl"], "--metrics-out loop/m.jsonl: {tree}/loop is a link loop (following it never ends); "
                                        "remove the link or give another path"),
    (["--compile-cache", "dang"], "--compile-cache dang is a dangling link (to {missing}, which does not exist); remove the "
                                  "link or give another path"),
])
def test_train_names_a_dangling_link_or_a_loop(tree, capsys, argv, line):
    from train import cli

    assert cli.main([*TRAIN, *argv]) == 2
    missing = tree.parent / "missing" / "target"
    assert capsys.readouterr().err == f"prepack train: {line.format(tree=tree, missing=missing)}\n"
    assert not missing.parent.exists()


def test_a_dangling_cache_folder_from_the_environment_is_named(tree, capsys, monkeypatch):
    from train import cli

    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", "dang")
    assert cli.main(TRAIN) == 2
    assert capsys.readouterr().err.startswith("prepack train: JAX_COMPILATION_CACHE_DIR dang is a dangling link (to ")


# ----------------------------------------------------------------------------- the other commands


def test_export_refuses_an_output_that_really_is_its_adapter(tree, capsys):
    from train.adapter_files import merge_export

    before = contents(tree)
    assert merge_export.main(["--merge", "--lora", "A", "--output", into("A"), "--overwrite"]) == 2
    assert capsys.readouterr().err == (f"prepack export: --output {resolves(into('A'), tree / 'A')} is the input --lora A; "
                                       "writing there could replace or delete what this run reads: give --output a path "
                                       "outside every input\n")
    assert merge_export.main(["--merge", "--lora", "A", "--output", "loop"]) == 2
    assert capsys.readouterr().err.startswith("prepack export: --output loop is a link loop (following it never ends)")
    assert contents(tree) == before


def test_export_writes_at_the_resolved_place_not_into_its_adapter(tree, capsys, monkeypatch):
    """`--output away/../A` reads as the --lora folder A: the merged folder lands in elsewhere/A.
    The adapter and its base are stand-ins (the rebuild is not what this checks); the folder is
    written by the command's own writer."""
    from types import SimpleNamespace

    import numpy as np

    from train.adapter_files import merge_export

    adapter = SimpleNamespace(meta={"model": "tiny-qwen3", "base_dtype": "float32"}, factors={}, scale=2.0)
    monkeypatch.setattr(merge_export, "read_adapter", lambda path: adapter)
    family = SimpleNamespace(hf_config=lambda *a: {"model_type": "qwen3"}, architecture="Qwen3ForCausalLM")
    monkeypatch.setattr(merge_export, "rebuild_base", lambda *a: SimpleNamespace(spec=SimpleNamespace(family=family),
                                                                                model=None, config=None))
    monkeypatch.setattr(merge_export, "base_hf_weights", lambda *a: {"model.norm.weight": np.ones(2, np.float32)})
    before = contents(tree)
    assert merge_export.main(["--merge", "--lora", "A", "--output", away("A")]) == 0, capsys.readouterr().err
    assert sorted(os.listdir(elsewhere(tree, "A"))) == ["config.json", "model.safetensors"]
    assert contents(tree) == before and os.listdir(tree / "A") == ["adapter_config.json"]


def test_report_refuses_or_writes_at_the_resolved_place(tree, capsys):
    from apps import report

    before = contents(tree)
    assert report.main(["--shards", SHARDS, "--output", into(f"{SHARDS}/r.html"), "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith(
        f"prepack report: error: --output {resolves(into(f'{SHARDS}/r.html'), tree / SHARDS / 'r.html')} lies inside the "
        f"input --shards {SHARDS};")
    assert report.main(["--shards", SHARDS, "--output", "dang"]) == 2
    assert capsys.readouterr().err.startswith("prepack report: error: --output dang is a dangling link (to ")
    os.makedirs(elsewhere(tree, SHARDS))
    assert report.main(["--shards", SHARDS, "--output", away(f"{SHARDS}/r.html")]) == 0, capsys.readouterr().err
    assert os.path.isfile(elsewhere(tree, f"{SHARDS}/r.html"))
    assert contents(tree) == before


def test_preflight_refuses_or_writes_at_the_resolved_place(tree, capsys):
    from apps import preflight

    base = ["--input", "sub/a.jsonl", "--format", "alpaca", "--no-plots"]
    before = contents(tree)
    assert preflight.main([*base, "--output", into("sub")]) == 2
    assert capsys.readouterr().err.startswith(
        f"prepack preflight: error: --output {resolves(into('sub'), tree / 'sub')} contains the input --input sub/a.jsonl;")
    assert preflight.main([*base, "--output", "p", "--pack-output", into("sub")]) == 2
    assert capsys.readouterr().err.startswith(
        f"prepack preflight: error: --pack-output {resolves(into('sub'), tree / 'sub')} contains the input --input "
        "sub/a.jsonl;")
    assert preflight.main([*base, "--output", "loop/p"]) == 2
    assert capsys.readouterr().err.startswith(f"prepack preflight: error: --output loop/p: {tree}/loop is a link loop")
    assert preflight.main([*base, "--output", away("sub")]) == 0
    assert sorted(os.listdir(elsewhere(tree, "sub"))) == ["preflight.csv", "preflight.json"]
    assert contents(tree) == before and os.listdir(tree / "sub") == ["a.jsonl"]


def generate_args(*argv: str) -> argparse.Namespace:
    from apps import generate

    return generate.build_parser().parse_args(["--input", "held.jsonl", "--format", "alpaca", "--model", "tiny-gemma3",
                                               "--weights", "random", *argv])


def test_generate_refuses_or_writes_at_the_resolved_place(tree, capsys):
    from apps import generate

    before = contents(tree)
    assert generate.main(["--input", "held.jsonl", "--format", "alpaca", "--model", "tiny-gemma3", "--weights", "random",
                          "--output", into("held.jsonl"), "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith(
        f"prepack generate: --output {resolves(into('held.jsonl'), tree / 'held.jsonl')} is the input --input held.jsonl;")
    with pytest.raises(generate.GenerateCliError, match=r"^--output dang is a dangling link \(to "):
        generate.check_args(generate_args("--output", "dang"))
    with pytest.raises(generate.GenerateCliError, match=r"^--compile-cache up/\.\./\.\./held\.jsonl/xla \(resolves to .*\) "
                                                        r"lies inside the input --input held\.jsonl;"):
        generate.check_args(generate_args("--output", "g.jsonl", "--compile-cache", into("held.jsonl/xla")))
    # `away/../held.jsonl` reads as the input: its files are written elsewhere, and the rule lets them through
    args = generate_args("--output", away("held.jsonl"), "--compile-cache", away("xla"))
    paths, _ = generate.check_args(args)
    assert paths == {"generations": elsewhere(tree, "held.jsonl"), "score": elsewhere(tree, "held.score.json"),
                     "dead_letters": elsewhere(tree, "held.dead_letters.jsonl")}
    assert args.compile_cache == elsewhere(tree, "xla")
    assert contents(tree) == before


def test_tokenizer_folder_refuses_or_writes_at_the_resolved_place(tree, capsys, monkeypatch):
    from types import SimpleNamespace

    from apps import tokenizer_folder
    from prepack.text import gemma3_hf_folder

    def save(folder: str) -> None:  # the tokenizer's own save, without building it (seconds)
        with open(os.path.join(folder, "tokenizer.json"), "w") as f:
            f.write("{}")

    monkeypatch.setattr(gemma3_hf_folder, "fast_tokenizer", lambda *a: SimpleNamespace(save_pretrained=save))

    (tree / "sub" / "t.jinja").write_text("{{ x }}")
    before = contents(tree)
    assert tokenizer_folder.main(["--output", into("sub"), "--template", "sub/t.jinja", "--overwrite"]) == 2
    assert capsys.readouterr().err.startswith(
        f"prepack tokenizer-folder: --output {resolves(into('sub'), tree / 'sub')} contains the input --template sub/t.jinja;")
    assert tokenizer_folder.main(["--output", "dang"]) == 2
    assert capsys.readouterr().err.startswith("prepack tokenizer-folder: --output dang is a dangling link (to ")
    assert tokenizer_folder.main(["--output", away("sub")]) == 0, capsys.readouterr().err
    assert "tokenizer.json" in os.listdir(elsewhere(tree, "sub"))
    assert contents(tree) == before and sorted(os.listdir(tree / "sub")) == ["a.jsonl", "t.jinja"]


def test_pack_refuses_or_takes_the_resolved_place(tree):
    from pipelines.options import OptionsError, parse_args

    base = ["--input", "sub/a.jsonl", "--format", "alpaca"]
    with pytest.raises(OptionsError) as e:
        parse_args([*base, "--output", into("sub")])
    assert str(e.value).startswith(f"--output {resolves(into('sub'), tree / 'sub')} contains the input --input sub/a.jsonl;")
    with pytest.raises(OptionsError, match=r"^--output dang/out: .*/dang is a dangling link \(to "):
        parse_args([*base, "--output", "dang/out"])
    config, _ = parse_args([*base, "--output", away("sub")])
    assert config.run.output == elsewhere(tree, "sub")


def test_verify_refuses_or_takes_the_resolved_compile_cache(tree):
    from apps import verify

    assert verify.compile_cache_refusal(argparse.Namespace(set="S", compile_cache=into(f"{SHARDS}/xla"))).startswith(
        f"--compile-cache {resolves(into(f'{SHARDS}/xla'), tree / SHARDS / 'xla')} lies inside the input SET S;")
    assert verify.compile_cache_refusal(argparse.Namespace(set="S", compile_cache="loop")).startswith(
        "--compile-cache loop is a link loop")
    args = argparse.Namespace(set="S", compile_cache=away(f"{SHARDS}/xla"))
    assert verify.compile_cache_refusal(args) is None and args.compile_cache == elsewhere(tree, f"{SHARDS}/xla")
