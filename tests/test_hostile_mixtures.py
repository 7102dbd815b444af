"""A mixture is hostile input (issue 31): a `--mixture` file and a tokenized set's recorded
mixture (`--from-tokens` on a copied tokens/ folder) go through one validator before any work;
each bad one is refused in one line naming the file, the source and the field, within seconds."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from apps import cli
from pipelines.launch.job import run
from pipelines.launch.errors import JobError
from pipelines.options import parse_args
from prepack.format.manifest import MANIFEST_NAME
from prepack.packing import mixture as mixture_module
from prepack.mixture_file import load_mixture
from prepack.packing.mixture import MixtureError, validate_recorded
from testkit import fuzz
from testkit.pipeline import IN_PROCESS, alpaca_records, chat_records, write_jsonl

SECONDS = 5  # every refusal here comes back well within this on a loaded 2-core machine


def source_yaml(name="a", weight="1", extra=()):
    lines = [f"  - name: {name}", "    input: /x.jsonl", "    format: translation", f"    weight: {weight}", *extra]
    return "\n".join(lines) + "\n"


def refusal(tmp_path, text: str, file_name="mix.yaml") -> str:
    path = tmp_path / file_name
    path.write_text(text)
    started = time.process_time()
    with pytest.raises(MixtureError) as e:
        load_mixture(str(path))
    assert time.process_time() - started < SECONDS
    message = str(e.value)
    assert message.startswith(f"mixture file {path}: ") and "\n" not in message and len(message) < 400
    return message


def alias_bomb(at: str) -> str:
    """A billion-laughs YAML: nine levels of nine aliases, the last one used at `at`."""
    lines = ['x0: &x0 ["lol"]'] + [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 9)}]" for i in range(1, 10)]
    return "\n".join(lines) + "\n" + at.replace("BOMB", "*x9") + "\n"


@pytest.mark.parametrize("at", [
    "weight_of: BOMB\nsources: [{name: a, input: /x.jsonl, format: alpaca, weight: 1}]",
    "sources: [{name: BOMB, input: /x.jsonl, format: alpaca, weight: 1}]",
    "sources: [{name: a, input: BOMB, format: alpaca, weight: 1}]",
])
def test_an_alias_bomb_is_refused_without_expanding(tmp_path, at):
    message = refusal(tmp_path, alias_bomb(at))
    assert message.endswith("line 1: anchors and aliases (&name, *name) are not allowed; write each value out")


@pytest.mark.parametrize("weight, shown", [
    ('"1e100000000"', "a string '1e100000000'"),
    ("1e100000000", "a string '1e100000000'"),  # YAML 1.1 reads it as text
    ("1.0e+100000000", "a number inf"),
    ("9" * 5001, "<a number written with 5,001 characters>"),
    ("-3", "a number -3"),
    ("0", "a number 0"),
    (".nan", "a number nan"),
    ("1e-12", "a string '1e-12'"),
    ("2e+12", "a string '2e+12'"),
    ("true", "a boolean True"),
    ("[1]", "an array [1]"),
])
def test_a_weight_that_is_not_a_bounded_positive_number_is_refused(tmp_path, weight, shown):
    message = refusal(tmp_path, "sources:\n" + source_yaml(weight=weight))
    assert message.endswith("source 'a': weight must be a positive number from 1e-09 to 1e+12 (an int, a float or "
                            f"a decimal string), got {shown}")


@pytest.mark.parametrize("weight, value", [("3", 3), ("1.5", 1.5), ('"2.25"', 2.25), ('"1e3"', 1000), ("1000000000000", 10**12)])
def test_a_bounded_weight_is_accepted(tmp_path, weight, value):
    (tmp_path / "mix.yaml").write_text("sources:\n" + source_yaml(weight=weight))
    assert float(load_mixture(str(tmp_path / "mix.yaml")).sources[0].weight) == value


@pytest.mark.parametrize("text, name", [
    ("[" * 100_000 + "]" * 100_000, "mix.json"),
    ("a:\n" + "".join(" " * i + "- \n" for i in range(1, 1000)), "mix.yaml"),
    ("sources: " + "{a: " * 100_000 + "1" + "}" * 100_000, "mix.yaml"),
    ('{"sources": ' + "[" * 100_000 + "]" * 100_000 + "}", "mix.json"),
])
def test_deep_nesting_is_refused(tmp_path, text, name):
    assert "nested more than 32 levels deep" in refusal(tmp_path, text, name)


@pytest.mark.parametrize("repeats", ["1000000", "0", "1001", "2.5", '"3"'])
def test_max_repeats_outside_1_to_1000_is_refused(tmp_path, repeats):
    message = refusal(tmp_path, f"max_repeats: {repeats}\nsources:\n" + source_yaml())
    assert ": max_repeats must be a whole number from 1 to 1,000, got " in message


def test_max_repeats_1000_is_accepted(tmp_path):
    (tmp_path / "mix.yaml").write_text("max_repeats: 1000\nsources:\n" + source_yaml())
    assert load_mixture(str(tmp_path / "mix.yaml")).max_repeats == 1000


@pytest.mark.parametrize("text, name, line", [
    ("sources: [{name: a, name: b, input: /x.jsonl, format: alpaca, weight: 1}]", "mix.yaml", 1),
    ('{"sources": [],\n "sources": [{"name": "a", "input": "/x.jsonl", "format": "alpaca", "weight": 1}]}',
     "mix.json", 2),
    ("max_repeats: 2\nmax_repeats: 3\nsources: []\n", "mix.yaml", 2),
])
def test_a_duplicate_key_is_refused(tmp_path, text, name, line):
    assert f": line {line}: duplicate key " in refusal(tmp_path, text, name)


def test_a_merge_key_is_refused(tmp_path):
    assert "merge keys (<<) are not allowed" in refusal(
        tmp_path, "sources: [{<<: {name: a}, input: /x.jsonl, format: alpaca, weight: 1}]")


@pytest.mark.parametrize("option, shown", [("{x: 1}", "an object {'x': 1}"), ("no", "a boolean False"),
                                           ("7", "a number 7"), ('""', "a string ''")])
def test_a_format_option_of_the_wrong_type_is_refused(tmp_path, option, shown):
    message = refusal(tmp_path, "sources:\n" + source_yaml(extra=[f"    source_lang: {option}"]))
    assert message.endswith(f"source 'a': source_lang must be a string of 1 to 200 characters (quote it), got {shown}")


def test_a_file_over_the_size_cap_is_refused_before_parsing(tmp_path, monkeypatch):
    text = "sources:\n" + source_yaml() + "# " + "x" * mixture_module.MAX_FILE_BYTES + "\n"
    assert "larger than 1,048,576 bytes" in refusal(tmp_path, text)


@pytest.mark.parametrize("name, shown", [("x" * 65, "a string 'xxx"), ("[a]", "an array ['a']")])
def test_a_long_or_odd_name_is_shown_capped(tmp_path, name, shown):
    message = refusal(tmp_path, "sources:\n" + source_yaml(name=name))
    assert f"source 1: name {shown}" in message


def test_a_huge_input_list_is_shown_capped(tmp_path):
    specs = ", ".join(["/x.jsonl"] * 20_000)
    message = refusal(tmp_path, f"sources: [{{name: a, input: [{specs}], format: alpaca, weight: 1}}]")
    assert "source 'a': input must be a spec or a list of 1 to 10,000 specs" in message


def test_the_cli_refuses_with_exit_2_and_one_line(tmp_path, capsys):
    (tmp_path / "mix.yaml").write_text(alias_bomb("sources: [{name: BOMB, input: /x.jsonl, format: alpaca, weight: 1}]"))
    assert cli.main(["pack", "--mixture", str(tmp_path / "mix.yaml"), "--output", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "anchors and aliases" in err and f"mixture file {tmp_path}/mix.yaml" in err
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------- the recorded mixture


def recorded(**over) -> dict:
    source = {"name": "a", "inputs": ["/x.jsonl"], "format": "alpaca", "options": {}, "weight": 1}
    doc = {"sha256": "0" * 64, "weight_of": "examples", "max_repeats": 1, "sources": [source]}
    for key, value in over.items():
        if key.startswith("s_"):
            source[key[2:]] = value
        else:
            doc[key] = value
    return doc


@pytest.mark.parametrize("over, message", [
    ({"s_weight": 0}, "source 'a': weight must be a positive number from 1e-09 to 1e+12 (an int, a float or a decimal "
                      "string), got a number 0"),
    ({"s_weight": -3}, "source 'a': weight must be a positive number"),
    ({"s_weight": "1e100000000"}, "source 'a': weight must be a positive number"),
    ({"max_repeats": 10**9}, "max_repeats must be a whole number from 1 to 1,000, got a number 1000000000"),
    ({"max_repeats": 0}, "max_repeats must be a whole number from 1 to 1,000, got a number 0"),
    ({"sha256": "x"}, "sha256 must be 64 lowercase hex digits"),
    ({"s_options": {"source_lang": {"x": 1}}}, "source 'a': source_lang must be a string of 1 to 200 characters (quote it), got an object {'x': 1}"),
    ({"s_options": {"lang": "en"}}, "source 'a': options: unknown key 'lang'"),
    ({"s_options": []}, "source 'a': options must be an object"),
    ({"s_inputs": "/x.jsonl"}, "source 'a': inputs must be a list of specs"),
    ({"s_format": "oasst1"}, "format 'oasst1' templates whole tables"),
    ({"sources": []}, "sources must be a non-empty list"),
    ({"extra": 1}, "unknown key 'extra'"),
])
def test_a_bad_recorded_mixture_is_one_line(over, message):
    with pytest.raises(MixtureError) as e:
        validate_recorded(recorded(**over), "choices.mixture")
    assert str(e.value).startswith("choices.mixture: ") and message in str(e.value) and "\n" not in str(e.value)


def test_a_good_recorded_mixture_is_the_described_one(tmp_path):
    (tmp_path / "mix.yaml").write_text("sources:\n" + source_yaml(extra=["    source_lang: en", "    target_lang: fr"]))
    mix = load_mixture(str(tmp_path / "mix.yaml"))
    again = validate_recorded(json.loads(json.dumps(mix.describe())), "m")
    assert again.describe() == mix.describe() and again.same_sources(mix) is None


def pack(args: list[str]):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


@pytest.fixture(scope="module")
def tokens_copy(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed-tokens")
    write_jsonl(str(d / "a.jsonl"), alpaca_records(12, seed=4))
    write_jsonl(str(d / "c.jsonl"), chat_records(6))
    (d / "mix.yaml").write_text("weight_of: examples\nsources:\n  - {name: a, input: a.jsonl, format: alpaca, weight: 2}\n"
                                "  - {name: c, input: c.jsonl, format: chat, weight: 1}\n")
    pack(["--mixture", str(d / "mix.yaml"), "--max-length", "128", "--output", str(d / "out"), "--allow-short-mix"])
    shutil.copytree(d / "out" / "tokens", d / "tokens")  # a copied tokens/ folder: no run record names it
    return d / "tokens"


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["sources"][1].update(weight=0), "source 'c': weight must be a positive number"),
    (lambda m: m["sources"][0].update(weight=-3), "source 'a': weight must be a positive number"),
    (lambda m: m["sources"][0].update(weight="1e100000000"), "source 'a': weight must be a positive number"),
    (lambda m: m.update(max_repeats=10**9), "max_repeats must be a whole number from 1 to 1,000"),
    (lambda m: m.update(max_repeats=0), "max_repeats must be a whole number from 1 to 1,000"),
])
def test_from_tokens_refuses_an_edited_recorded_mixture_before_any_work(tokens_copy, tmp_path, edit, message):
    folder = tmp_path / "tokens"
    shutil.copytree(tokens_copy, folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    edit(manifest["choices"]["mixture"])
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    started = time.process_time()
    with pytest.raises(JobError) as e:
        pack(["--from-tokens", str(folder), "--max-length", "128", "--output", str(tmp_path / "new")])
    assert time.process_time() - started < SECONDS
    assert str(e.value).startswith(f"{folder}/{MANIFEST_NAME}: choices.mixture: ") and message in str(e.value)
    assert "\n" not in str(e.value) and not (tmp_path / "new").exists()


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["choices"]["mixture"]["sources"].pop(),
     "choices.mixture's sources name the inputs ['{folder_parent}/a.jsonl'], but the set's inputs (choices.inputs) are "
     "['{folder_parent}/a.jsonl', '{folder_parent}/c.jsonl']: the manifest was edited or is damaged"),
    (lambda m: m["choices"]["mixture"]["sources"].reverse(),
     "choices.mixture's sources name the inputs ['{folder_parent}/c.jsonl', '{folder_parent}/a.jsonl'], but the set's inputs"),
    (lambda m: [m["choices"]["inputs"].pop(), m["choices"]["mixture"]["sources"].pop()],
     "job.tasks[1].input_index 1 names no input of the set's 1: the manifest was edited or is damaged"),
])
def test_from_tokens_refuses_a_recorded_mixture_that_does_not_cover_the_inputs(tokens_copy, tmp_path, edit, message):
    """A recorded mixture listing 1 of the set's 2 sources: an IndexError traceback in the
    launcher (each example's source is looked up by its input index). One line now."""
    folder = tmp_path / "tokens"
    shutil.copytree(tokens_copy, folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    edit(manifest)
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(JobError) as e:
        pack(["--from-tokens", str(folder), "--max-length", "128", "--output", str(tmp_path / "new")])
    assert str(e.value).startswith(f"{folder}/{MANIFEST_NAME}: ") and "\n" not in str(e.value)
    assert message.format(folder_parent=tokens_copy.parent) in str(e.value), str(e.value)
    assert not (tmp_path / "new").exists()


# ----------------------------------------------------------------------------- fuzz


def _values():
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(min_value=-(1 << 80), max_value=1 << 80) | st.floats()
               | st.text(max_size=12) | st.sampled_from(["alpaca", "chat", "translation", "examples", "1e100000000"]))
    return st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["name", "input", "inputs", "format", "weight", "options", "source_lang", "x"]), inner,
        max_size=3), max_leaves=8)


def _fuzz(examples: int, tmp_path) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    good = {"weight_of": "examples", "max_repeats": 2,
            "sources": [{"name": "a", "input": "/x.jsonl", "format": "translation", "weight": 2, "source_lang": "en"},
                        {"name": "b", "input": ["/y.jsonl"], "format": "alpaca", "weight": 1}]}
    fields = ["weight_of", "max_repeats", "sources", "s0.name", "s0.input", "s0.format", "s0.weight", "s0.source_lang",
              "s1.weight", "s1.target_lang", "s1.x"]

    def check(call):
        try:
            call()
        except MixtureError as e:
            assert "\n" not in str(e) and len(str(e)) < 600

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(edits=st.lists(st.tuples(st.sampled_from(fields), _values()), min_size=1, max_size=3),
           text=st.text(alphabet="&*!<>[]{}:,-#'\"\n ab1.e", max_size=60))
    def one(edits, text):
        doc = json.loads(json.dumps(good))
        for field, value in edits:
            if field[:1] == "s" and field[2:3] == ".":
                entries = doc["sources"]
                if isinstance(entries, list) and len(entries) == 2 and isinstance(entries[int(field[1])], dict):
                    entries[int(field[1])][field[3:]] = value
            else:
                doc[field] = value
        path = tmp_path / "fuzz.json"
        path.write_text(json.dumps(doc))
        check(lambda: load_mixture(str(path)))
        path.write_text(text)
        check(lambda: load_mixture(str(path)))
        entries = doc["sources"] if isinstance(doc["sources"], list) else []
        described = {"sha256": "0" * 64, "weight_of": doc["weight_of"], "max_repeats": doc["max_repeats"],
                     "sources": [{"name": s.get("name"), "inputs": s.get("input"), "format": s.get("format"),
                                  "options": {}, "weight": s.get("weight")} if isinstance(s, dict) else s
                                 for s in entries]}
        check(lambda: validate_recorded(described, "m"))

    one()


def test_fuzz_mixtures_give_a_mixture_or_one_line(tmp_path):
    _fuzz(300, tmp_path)


@pytest.mark.slow
def test_fuzz_mixtures_deep(tmp_path):
    _fuzz(fuzz.DEEP_EXAMPLES, tmp_path)
