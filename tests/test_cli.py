"""The `prepack` console script: missing extras, --version, unknown commands, a reader that goes away,
and what every command's parser does with an option it does not define (exit codes: README, "Exit codes")."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from apps import cli

REPO = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=120)


def test_train_without_the_train_extra_names_the_extra(tmp_path):
    # A fresh process where `import jax` fails as on a machine without the train extra.
    (tmp_path / "manifest.json").write_text('{"max_length": 512}')  # past the --shards check
    done = _run("import sys; sys.modules['jax'] = None; from apps.cli import main; "
                f"sys.exit(main(['train', '--shards', {str(tmp_path)!r}]))")
    assert done.returncode == 2, done.stderr
    assert done.stderr == ("prepack train: needs the 'train' extra (no module named 'jax'); install it with "
                           "pip install 'tunix-prepack[train]' (in a checkout: .venv/bin/pip install -e '.[train]')\n")


def test_a_missing_module_outside_the_extras_is_not_blamed_on_them():
    err = ModuleNotFoundError("No module named 'nosuchthing'", name="nosuchthing")
    assert cli.missing_extra(err, "train") is None
    assert cli.missing_extra(ModuleNotFoundError(name="apache_beam.io"), "pipeline,report") == "pipeline"
    assert cli.missing_extra(ModuleNotFoundError(name="matplotlib"), "pipeline,report") == "report"


def test_version(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("prepack ") and out.count("\n") == 1 and out.split()[1][0].isdigit()


def test_unknown_command(capsys):
    assert cli.main(["pakc"]) == 2
    assert capsys.readouterr().err.startswith("prepack: unknown command 'pakc'\n")


def test_pack_refuses_a_misspelled_option_before_any_work(tmp_path, capsys):
    out = tmp_path / "X"
    assert cli.main(["pack", "--sample", "--max-lenght", "512", "--output", str(out)]) == 2
    assert capsys.readouterr().err == (
        "prepack pack: unknown option --max-lenght (neither prepack pack nor Beam knows it); did you mean --max-length?\n")
    assert not out.exists()  # nothing ran, nothing written


def test_pack_refuses_an_untested_runner_and_an_unknown_tokenizer(tmp_path, capsys):
    out = tmp_path / "X"
    assert cli.main(["pack", "--sample", "--output", str(out), "--runner", "DaskRunner"]) == 2
    assert capsys.readouterr().err.startswith("prepack pack: --runner DaskRunner: this job is tested only on FnApiRunner "
                                              "and DataflowRunner")
    assert cli.main(["pack", "--sample", "--output", str(out), "--tokenizer", "gemma4"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not an embedded name (gemma3, qwen3)" in err and "hf:gemma4" in err
    assert not out.exists()


def test_a_reader_that_goes_away_ends_a_command_quietly(tmp_path):
    """`prepack inspect ... | head`: the pipe closes mid-output; the command exits 0 with nothing
    on stderr (no traceback, no 'Exception ignored' at exit), for shard sets and tokenized sets."""
    from pipelines.launch.job import run
    from pipelines.options import parse_args
    from testkit.pipeline import IN_PROCESS

    config, beam_args = parse_args(["--sample", "--max-length", "256", "--output", str(tmp_path), "--no-progress"] + IN_PROCESS)
    run(config, beam_args)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for folder in ("L256", "tokens"):
        code = f"import sys; from apps.cli import main; sys.exit(main(['inspect', {str(tmp_path / folder)!r}, '--rows', '400']))"
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
        assert proc.stdout.readline()  # what `head -1` reads, then it exits
        proc.stdout.close()
        _, stderr = proc.communicate(timeout=120)
        assert (folder, proc.returncode, stderr.decode()) == (folder, 0, "")


def test_a_broken_pipe_of_the_command_itself_is_not_taken_for_the_reader_leaving():
    """Only a closed stdout ends a command quietly: a BrokenPipeError from the command's own pipe
    (stdout still open) fails, shown whole, not exit 0 with nothing said."""
    boom = "def main(argv):\n    raise BrokenPipeError(32, 'Broken pipe')\n"
    done = _run(f"import sys, types; m = types.ModuleType('boom'); exec({boom!r}, m.__dict__); sys.modules['boom'] = m; "
                "from apps import cli; cli.SUBCOMMANDS['inspect'] = ('boom', 'main', 'pipeline', ''); "
                "sys.exit(cli.main(['inspect']))")
    assert done.returncode == 1 and done.stderr.rstrip().endswith("BrokenPipeError: [Errno 32] Broken pipe"), done.stderr


# What each command needs besides the option under test for its parser to reach the unknown one
# (a missing required argument is reported first).
REQUIRED_ARGS = {"pack": ["--sample"], "inspect": ["SET"], "verify": ["SET"], "preflight": ["--output", "O"],
                 "report": [], "train": ["--shards", "S"], "export": ["--merge", "--lora", "A", "--output", "B"], "generate": ["--input", "I", "--output", "O"],
                 "tokenizer-folder": ["--output", "O"]}


def _long_options(name: str, capsys) -> list[str]:
    """The command's options, as its --help lists them."""
    with pytest.raises(SystemExit) as done:
        cli.main([name, "--help"])
    assert done.value.code == 0
    return sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*[a-z0-9])", capsys.readouterr().out)) - {"--help"})


def _refusal(name: str, option: str, capsys, tmp_path, monkeypatch) -> tuple[int, str]:
    monkeypatch.chdir(tmp_path)  # nothing a command might write lands in the checkout
    try:
        code = cli.main([name, *REQUIRED_ARGS[name], option])
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().err


def test_every_command_refuses_an_abbreviation_and_names_the_option_meant_by_a_typo(capsys, tmp_path, monkeypatch):
    """`verify OUT --row 2` was taken silently as --rows, and only pack suggested the option meant:
    each command's parser is prepack.cli_help.CommandParser, one line and exit 2 for either."""
    assert set(REQUIRED_ARGS) == set(cli.SUBCOMMANDS)
    for name in cli.SUBCOMMANDS:
        options = _long_options(name, capsys)
        longest = max(options, key=len)  # long enough that its abbreviation and a typo are unambiguous
        abbreviation = longest[:-2]
        assert abbreviation not in options
        typo = longest[:4] + longest[5] + longest[4] + longest[6:]  # two letters swapped
        for given in (abbreviation, typo):
            code, err = _refusal(name, given, capsys, tmp_path, monkeypatch)
            assert code == 2, (name, given, err)
            assert err.count("\n") == 1 and f"prepack {name}: " in err, (name, given, err)
            assert f"unknown option {given}" in err and err.rstrip().endswith(f"did you mean {longest}?"), (name, given, err)


def test_verify_refuses_row_as_an_abbreviation_of_rows(capsys, tmp_path, monkeypatch):
    code, err = _refusal("verify", "--row", capsys, tmp_path, monkeypatch)
    assert (code, err) == (2, "prepack verify: error: unknown option --row; did you mean --rows?\n")


def test_an_option_no_command_has_points_to_help(capsys, tmp_path, monkeypatch):
    code, err = _refusal("report", "--zzzzzz", capsys, tmp_path, monkeypatch)
    assert (code, err) == (2, "prepack report: error: unknown option --zzzzzz; see prepack report --help\n")


# One refusal of each command that passes the parser: an input that is not there. Every one exits 2
# (pack exited 1 for it, and inspect for a folder without a manifest).
MISSING_INPUT = {
    "pack": (["--input", "none.jsonl", "--format", "alpaca", "--output", "O"], "input 'none.jsonl': no such file"),
    "inspect": (["none"], "no manifest.json in none"),
    "verify": (["none"], "none: neither a shard set"),
    "preflight": (["--input", "none.jsonl", "--format", "alpaca", "--output", "O", "--no-plots"],
                  "input 'none.jsonl': no such file"),
    "report": (["--metrics", "none.jsonl", "--output", "r.html"], "--metrics none.jsonl: no such file"),
    "train": (["--shards", "none"], "--shards none: no such file or folder"),
    "export": (["--merge", "--lora", "none", "--output", "O"], "no LoRA file at none"),
    "generate": (["--input", "none.jsonl", "--format", "alpaca", "--output", "o.jsonl", "--model", "tiny"],
                 "input 'none.jsonl': no such file"),
    "tokenizer-folder": (["--output", "file/x"], "is a file, not a folder"),
}


def test_every_command_refuses_a_missing_input_with_exit_2(capsys, tmp_path, monkeypatch):
    assert set(MISSING_INPUT) == set(cli.SUBCOMMANDS)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "file").write_text("mine")
    for name, (args, words) in MISSING_INPUT.items():
        code = cli.main([name, *args])
        err = capsys.readouterr().err
        assert (code, err.count("\n")) == (2, 1) and words in err, (name, code, err)
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing written
