"""Scoring generations: tool calls read back in each chat format's layout (prepack/text/chat/tool_calls.py),
the per-line scores and the summary's rates (train/generation/score.py), and `prepack report --generations`
(apps/compare_generations.py). No model: these read text."""
from __future__ import annotations

import json

import pytest

from prepack.text.chat import tool_calls
from prepack.text.chat.tool_calls import Call, ParsedCalls
from train.generation import score


def test_hermes_calls_as_qwen3_writes_them():
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n</tool_call>')
    parsed = tool_calls.parse_hermes(text)
    assert parsed.calls == (Call("get_weather", {"city": "Oslo", "unit": "celsius"}), Call("get_time", {"city": "Oslo"}))
    assert parsed.valid and parsed.malformed == 0


@pytest.mark.parametrize("text, malformed", [
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>', 1),  # not JSON
    ('<tool_call>\n{"arguments": {}}\n</tool_call>', 1),  # no name
    ('<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>', 1),  # arguments not an object
    ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}', 1),  # cut off by --max-new-tokens
    ('<tool_call>{"name": "f"}<tool_call>{"name": "g", "arguments": {}}</tool_call>', 1),  # the first never closed
])
def test_hermes_malformed_calls_are_counted(text, malformed):
    parsed = tool_calls.parse_hermes(text)
    assert parsed.malformed == malformed and not parsed.valid and parsed.attempted


def test_functiongemma_calls_as_its_layout_writes_them():
    text = ("<start_function_call>call:get_weather{city:<escape>Paris, FR<escape>,days:3,detail:true,"
            "hours:[9,<escape>noon<escape>],where:{lat:48.8,lon:2.3}}<end_function_call><start_function_call>"
            "call:ping{}<end_function_call>")
    parsed = tool_calls.parse_functiongemma(text)
    assert parsed.calls == (Call("get_weather", {"city": "Paris, FR", "days": 3, "detail": True, "hours": [9, "noon"],
                                                 "where": {"lat": 48.8, "lon": 2.3}}), Call("ping", {}))
    assert parsed.valid


@pytest.mark.parametrize("body", [
    "call:f{city:<escape>Paris}",  # unclosed escape
    "call:f{city:Paris}",  # a bare word is not JSON
    "call:f{city:<escape>a<escape>} tail",  # text after the arguments
    "get_weather{city:<escape>a<escape>}",  # no call:
    "call:f{:1}",  # empty key
])
def test_functiongemma_malformed_calls_are_counted(body):
    parsed = tool_calls.parse_functiongemma(f"<start_function_call>{body}<end_function_call>")
    assert parsed.calls == () and parsed.malformed == 1


def test_functiongemma_round_trips_the_layouts_rendering(tmp_path):
    """What the FunctionGemma-layout template writes for a call reads back as that call."""
    from prepack.text.chat import get_chat_format, tokenize_conversations
    from prepack.text.formats import get_template
    from prepack.text.tokenizer import load_tokenizer
    from testkit.hf_tokenizers import functiongemma_layout_dir

    tok = load_tokenizer(f"hf:{functiongemma_layout_dir(tmp_path / 'tok')}")
    fmt = get_chat_format("hf", tok)
    arguments = {"city": "Lima", "days": 2, "flags": [True, None], "at": {"h": 9.5}}
    record = {"tools": [{"type": "function", "function": {"name": "plan", "parameters": {"type": "object"}}}],
              "messages": [{"role": "user", "content": "Plan Lima"},
                           {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "plan",
                                                                                                  "arguments": arguments}}]}]}
    (example,) = tokenize_conversations(get_template("chat").to_conversations(record), tok, fmt)
    assert tool_calls.parse_functiongemma(fmt.decode(example.input_ids)).calls == (Call("plan", arguments),)


def test_default_parser_follows_the_chat_format():
    assert tool_calls.default_parser("qwen3") == tool_calls.default_parser("chatml") == "hermes"
    assert tool_calls.default_parser("gemma") == "none"
    assert tool_calls.default_parser("hf", "{{ '<start_function_call>' }}") == "functiongemma"
    assert tool_calls.default_parser("hf", "{{ '<tool_call>' }}") == "hermes"
    assert tool_calls.default_parser("hf", "{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown --tool-call-parser 'xml'; choose one of hermes, functiongemma, none"):
        tool_calls.get_parser("xml")


REF = (Call("get_weather", {"city": "Oslo", "days": 2}),)


@pytest.mark.parametrize("made, want", [
    (ParsedCalls((Call("get_weather", {"days": 2.0, "city": "Oslo"}),)), (True, True, True)),  # key order, 2 == 2.0
    (ParsedCalls((Call("get_weather", {"city": "Oslo", "days": "2"}),)), (True, True, False)),  # "2" is not 2
    (ParsedCalls((Call("get_time", {"city": "Oslo", "days": 2}),)), (True, False, False)),
    (ParsedCalls((Call("get_weather", {"city": "Oslo", "days": 2}),), malformed=1), (False, False, False)),
    (ParsedCalls((Call("get_weather", {"city": "Oslo", "days": 2}), Call("get_weather", {}))), (True, False, False)),
    (ParsedCalls(), (False, False, False)),
])
def test_call_scores(made, want):
    s = score.score_calls(REF, made)
    assert (s.valid, s.names_match, s.full_match) == want


def test_booleans_are_not_numbers():
    assert not score._same_json(True, 1) and not score._same_json([1], [True]) and score._same_json(1, 1.0)


def line(i: int, completion: str, reference: str, nll: float | None = 1.0, calls: score.CallScore | None = None,
         stop: str = "stop", parser: str | None = None) -> dict:
    return {"id": str(i), "prompt_tokens": 5, "completion": completion, "completion_tokens": 4, "reference": reference,
            "stop_reason": stop,
            "score": score.record_score(completion, reference, None if nll is None else nll * 4, 4, calls, parser)}


def test_summary_rates():
    call, no_call = (Call("f", {"a": 1}),), ()
    lines = [
        line(0, " Paris ", "Paris", nll=0.5),
        line(1, "Lyon", "Paris", nll=2.5, stop="length"),
        line(2, "x", "x", calls=score.score_calls(call, ParsedCalls(call))),
        line(3, "y", "x", calls=score.score_calls(call, ParsedCalls((), malformed=1))),
        line(4, "z", "z", calls=score.score_calls(no_call, ParsedCalls())),
        line(5, "w", "z", calls=score.score_calls(no_call, ParsedCalls(call))),
    ]
    s = score.summarize(lines, "hermes")
    assert s["prompts"] == 6 and s["exact_match"] == pytest.approx(3 / 6)
    assert s["reference_nll"] == pytest.approx((0.5 + 2.5 + 4 * 1.0) / 6)
    assert (s["call_prompts"], s["no_call_prompts"]) == (2, 2)
    assert (s["valid_call_rate"], s["function_name_accuracy"], s["full_call_accuracy"], s["no_call_accuracy"]) == (0.5, 0.5, 0.5, 0.5)
    assert s["stop_reasons"] == {"length": 1, "stop": 5}
    text = score.table([("base", s)])
    assert text.splitlines()[0].split() == ["run", "prompts", "exact_match", "reference_nll", "valid_call", "name_acc",
                                            "full_call", "no_call"]
    assert text.splitlines()[1].split() == ["base", "6", "50.0%", "1.167", "50.0%", "50.0%", "50.0%", "50.0%"]


def test_summary_without_calls_has_no_call_rates():
    s = score.summarize([line(0, "a", "a")])
    assert s["valid_call_rate"] is None and s["call_prompts"] is None
    assert "valid_call" not in score.table([("tuned", s)])


# ------------------------------------------------------------------------ prepack report --generations


def write(path, lines) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path)


def test_report_generations_side_by_side(tmp_path, capsys):
    from apps.report import main

    base = write(tmp_path / "base.jsonl", [line(0, "no", "Paris", 5.0, stop="length"), line(1, "yes", "yes", 3.0)])
    tuned = write(tmp_path / "tuned.jsonl", [line(0, "Paris", "Paris", 0.1), line(1, "no|pe\n<end_of_turn>", "yes", 0.5)])
    assert main(["--generations", base, tuned]) == 0
    out = capsys.readouterr().out
    rows = {r.split("  ")[0].strip(): r.split() for r in out.splitlines() if r.strip()}
    assert rows["exact match"][-4:] == ["50.0%", "50.0%", "+0.0", "pp"]
    # Stored by generate, not measured by the report (it has no model): the label says so.
    assert rows["reference NLL (as stored, not measured here)"][-3:] == ["4.000", "0.300", "-3.700"]
    assert "fixed 0" in out and "broken 1" in out and "tuned: 'Paris'" in out
    # and on the page, with --output
    page = tmp_path / "page.md"
    assert main(["--generations", f"before={base}", f"after={tuned}", "--output", str(page)]) == 0
    text = page.read_text()
    assert "## Generations" in text and "| metric | before | after | change |" in text
    # a completion's line break, pipe and special token stay in its one cell, shown
    assert "| broken | 1 | yes | yes | no\\|pe<br>&lt;end_of_turn&gt; |" in text.splitlines()


def test_report_generations_refuses_other_prompts_and_foreign_files(tmp_path, capsys):
    from apps.report import main

    a = write(tmp_path / "a.jsonl", [line(0, "x", "x")])
    b = write(tmp_path / "b.jsonl", [line(1, "x", "x")])
    assert main(["--generations", a, b]) == 2
    assert "hold different prompts (1 only in the first, e.g. ['0']; 1 only in the other, e.g. ['1'])" in capsys.readouterr().err
    (tmp_path / "c.jsonl").write_text('{"id": "0", "completion": "x"}\n')
    assert main(["--generations", a, str(tmp_path / "c.jsonl")]) == 2
    assert "c.jsonl:1: not a `prepack generate` line (no reference, completion_tokens, stop_reason)" in capsys.readouterr().err


@pytest.mark.parametrize("content, words", [
    (b'{"id": "0", "completion": "\xff"}\n', "not UTF-8 text (byte 27)"),
    (b"[" * 100_000 + b"]" * 100_000 + b"\n", "not valid JSON (RecursionError: maximum recursion depth exceeded"),
    (b'{"id": 1' + b"0" * 5_000 + b"}\n", "not valid JSON (ValueError: Exceeds the limit (4300 digits)"),
])
def test_report_generations_refuses_undecodable_lines_in_one_line(tmp_path, capsys, content, words):
    """Non-UTF-8 bytes and arrays nested 100,000 deep were tracebacks."""
    from apps.report import main

    good = write(tmp_path / "good.jsonl", [line(0, "x", "x")])
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content)
    assert main(["--generations", good, str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"prepack report: error: {bad}:1: {words}") and err.count("\n") == 1


def test_report_generations_reads_a_line_with_a_bound(tmp_path, capsys, monkeypatch):
    from apps import compare_generations
    from apps.report import main

    monkeypatch.setattr(compare_generations, "MAX_LINE_BYTES", 100)
    long = write(tmp_path / "long.jsonl", [line(0, "x" * 200, "x")])
    assert main(["--generations", long]) == 2
    assert capsys.readouterr().err == (f"prepack report: error: {long}:1: longer than 100 bytes, not a line `prepack "
                                       "generate` wrote (it was not read further)\n")


def test_report_scores_an_unscored_run_by_exact_match(tmp_path, capsys):
    from apps.report import main

    plain = [{k: v for k, v in line(0, "Paris", "Paris").items() if k != "score"}]
    assert main(["--generations", write(tmp_path / "plain.jsonl", plain)]) == 0
    out = capsys.readouterr().out
    assert "100.0%" in out and "reference NLL" not in out


# ------------------------------------------------------------- report --generations believes nothing it can recompute


def test_report_recomputes_exact_match_from_the_texts(tmp_path, capsys):
    """The prober's case: ' Sep Sep' against 'Answer 0.' stored as an exact match showed 100% and "fixed"."""
    from apps.report import main

    base = write(tmp_path / "base.jsonl", [line(0, "no", "Answer 0."), line(1, "yes", "yes")])
    forged = line(0, " Sep Sep", "Answer 0.")
    forged["score"]["exact_match"] = True
    tuned = write(tmp_path / "tuned.jsonl", [line(1, "yes", "yes"), forged])
    assert main(["--generations", f"{base}", f"{tuned}"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"prepack report: error: {tuned}:2: score.exact_match is true, but the texts say false (recomputed "
                            "from the completion ' Sep Sep' and the reference 'Answer 0.'); a score its own texts "
                            "contradict is not believed: generate the file again\n")
    assert "100" not in captured.out and "fixed" not in captured.out


def hermes_line(i: int, completion: str, reference: str) -> dict:
    parse = tool_calls.get_parser("hermes")
    return line(i, completion, reference, calls=score.score_calls(parse(reference).calls, parse(completion)), parser="hermes")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_report_recomputes_tool_calls_from_the_texts(tmp_path, capsys):
    from apps.report import main

    honest = [hermes_line(0, CALL, CALL), hermes_line(1, "Hello.", CALL), hermes_line(2, "Fine.", "Fine.")]
    assert main(["--generations", write(tmp_path / "honest.jsonl", honest)]) == 0
    out = capsys.readouterr().out
    assert "valid call rate" in out and "50.0%" in out
    forged = hermes_line(1, "Hello.", CALL)
    forged["score"]["calls"].update(made=1, valid=True)
    assert main(["--generations", write(tmp_path / "forged.jsonl", [forged])]) == 2
    assert "forged.jsonl:1: score.calls.made is 1, but the texts say 0 (recomputed from the completion 'Hello.'" in \
        capsys.readouterr().err


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.pop("exact_match"), "score.exact_match is missing: not a line `prepack generate` wrote"),
    (lambda s: s.update(exact_match="yes"), "score.exact_match is a string 'yes', not true or false"),
    (lambda s: s.update(exact_match=1), "score.exact_match is a number 1, not true or false"),
    (lambda s: s.pop("reference_tokens"), "score.reference_tokens is missing"),
    (lambda s: s.update(reference_tokens=True), "score.reference_tokens is a boolean True, not a whole number"),
    (lambda s: s.update(reference_tokens=-4), "score.reference_tokens is a number -4, not a whole number"),
    (lambda s: s.update(reference_nll="low"), "score.reference_nll is a string 'low', not a finite number or null"),
    (lambda s: s.pop("reference_nll"), "score.reference_nll is a string 'missing', not a finite number or null"),
    (lambda s: s.update(calls=[]), "score.calls is an array [], not an object"),
    (lambda s: s.update(calls={"expected": 0}), "score.calls.made is missing"),
    (lambda s: s.update(calls={**score.CallScore(0, 0, 0, False, True, True).as_json(), "parser": "xml"}),
     "score.calls.parser is 'xml', not one of"),
])
def test_report_refuses_malformed_score_fields(tmp_path, capsys, edit, message):
    from apps.report import main

    bad = line(0, "x", "x")
    edit(bad["score"])
    path = write(tmp_path / "bad.jsonl", [line(1, "y", "y"), bad])
    assert main(["--generations", path]) == 2
    err = capsys.readouterr().err
    assert f"{path}:2: {message}" in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("field, value, message", [
    ("score", "high", "score is a string 'high', not an object"),
    ("completion_tokens", "4", "completion_tokens is a string '4', not a whole number"),
    ("stop_reason", None, "stop_reason is null None, not a string"),
    ("id", ["0"], "id is an array ['0'], not a string"),
])
def test_report_refuses_malformed_line_fields(tmp_path, capsys, field, value, message):
    from apps.report import main

    bad = line(0, "x", "x")
    bad[field] = value
    path = write(tmp_path / "bad.jsonl", [bad])
    assert main(["--generations", path]) == 2
    assert f"{path}:1: {message}" in capsys.readouterr().err
