"""`prepack train --eval-generate FILE --eval-generate-every N`: held-out prompts generated and
scored during a run, in the metrics JSONL and the report's plots. The refusals are checked
without a model; one slow test trains a tiny model on a set packed by the job."""
from __future__ import annotations

import json

import pytest

from prepack.format.manifest import Manifest
from train import cli
from train.generation import eval_generate
from train.run_config.config import TrainConfig, TrainError

EVAL_DELAY_S = 2.0  # far longer than a tiny model's step, even on a busy CI machine
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def call_record(city: str) -> dict:
    return {"tools": [WEATHER], "messages": [
        {"role": "user", "content": f"Weather in {city}?"},
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                                                                               "arguments": {"city": city}}}]}]}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from testkit.hf_tokenizers import functiongemma_layout_dir

    return functiongemma_layout_dir(tmp_path_factory.mktemp("fg"))


def manifest(tok_dir, fmt: str = "chat") -> Manifest:
    return Manifest(max_length=256, num_rows=1, shards=[], tokenizer={"name": f"hf:{tok_dir}"}, stats={},
                    template={"name": fmt, "options": {}, "chat_format": "hf", "chat_format_resolved": "hf"},
                    options={"format": fmt, "template_options": {}, "chat_format": "hf", "tokenizer": f"hf:{tok_dir}"})


def write(path, records) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return str(path)


def test_prompts_are_rendered_as_the_set_was(tmp_path, tok_dir):
    path = write(tmp_path / "held.jsonl", [call_record("Oslo"), {"prompt": "not chat"},
                                           {"messages": [{"role": "user", "content": "Hi"},
                                                         {"role": "assistant", "content": "Hello."}]}])
    prompts = eval_generate.prepare(TrainConfig(shards="S", eval_generate=path), manifest(tok_dir))
    assert len(prompts.items) == 2 and prompts.skipped == 1
    assert prompts.parser == "functiongemma" and prompts.chat_format.name == "hf"
    assert [c.name for c in prompts.items[0].reference_calls] == ["get_weather"]
    assert prompts.max_new_tokens == max(len(i.reference_ids) for i in prompts.items) + eval_generate.EXTRA_NEW_TOKENS


@pytest.mark.parametrize("records, fmt, message", [
    (None, "chat", "--eval-generate {path}: no such file"),
    (["{not json"], "chat", "--eval-generate {path}:1: not a JSON line"),
    ([{"prompt": "p", "completion": "c"}], "chat", "--eval-generate {path}: none of its 1 records makes a prompt in the "
                                                  "shard set's format 'chat'"),
    ([call_record("Oslo")], "mixture", "--eval-generate needs a shard set packed from one chat or instruction format"),
    ([call_record("Oslo")], "preference", "--eval-generate needs a shard set packed from one chat or instruction format; "
                                          "S was packed from 'preference'"),
])
def test_refusals_before_any_weights_load(tmp_path, tok_dir, records, fmt, message):
    path = tmp_path / "held.jsonl"
    if records is not None:
        write(path, records)
    with pytest.raises(TrainError) as info:
        eval_generate.prepare(TrainConfig(shards="S", eval_generate=str(path)), manifest(tok_dir, fmt))
    assert message.format(path=path) in str(info.value)


def test_too_many_prompts(tmp_path, tok_dir):
    path = write(tmp_path / "held.jsonl", [call_record(f"City{i}") for i in range(eval_generate.MAX_PROMPTS + 1)])
    with pytest.raises(TrainError, match=f"257 prompts; give at most {eval_generate.MAX_PROMPTS}"):
        eval_generate.prepare(TrainConfig(shards="S", eval_generate=path), manifest(tok_dir))


@pytest.mark.parametrize("flags, message", [
    (["--eval-generate-every", "5"], "--eval-generate-every needs --eval-generate FILE"),
    (["--eval-generate", "held.jsonl", "--eval-generate-every", "0"], "argument --eval-generate-every: must be a whole number from 1 to 2,147,483,647, got 0"),
])
def test_flags(tmp_path, capsys, flags, message):
    (tmp_path / "L256").mkdir()
    (tmp_path / "L256" / "manifest.json").write_text(json.dumps({"max_length": 256}))
    try:
        status = cli.main(["--shards", str(tmp_path / "L256"), *flags])
    except SystemExit as exit_:  # argparse refuses an out-of-range count while parsing
        status = exit_.code
    assert status == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_run_scores_its_prompts_before_during_and_after(tmp_path, tok_dir, capsys, monkeypatch):
    import time

    from apps.report import main as report
    from pipelines.launch.job import run
    from pipelines.options import parse_args
    from testkit.pipeline import IN_PROCESS

    data = write(tmp_path / "train.jsonl", [call_record(c) for c in ("Paris", "Rome", "Lima", "Bern", "Kyiv", "Oslo")])
    held = write(tmp_path / "held.jsonl", [call_record("Quito"), call_record("Hanoi")])
    config, beam = parse_args(["--input", data, "--format", "chat", "--tokenizer", f"hf:{tok_dir}", "--chat-format", "hf",
                               "--max-length", "256", "--output", str(tmp_path / "OUT"), "--no-progress"] + IN_PROCESS)
    run(config, beam)
    metrics = tmp_path / "m.jsonl"
    # The evaluation after step 2 made EVAL_DELAY_S longer, so step 3 would show it if charged with it.
    evaluate = eval_generate.Evaluator.evaluate

    def slow_evaluate(self, step):
        if step == 2:
            time.sleep(EVAL_DELAY_S)
        return evaluate(self, step)

    monkeypatch.setattr(eval_generate.Evaluator, "evaluate", slow_evaluate)
    # --remat none: auto would compile the step once more only to plan its memory.
    assert cli.main(["--shards", str(tmp_path / "OUT" / "L256"), "--model", "tiny", "--batch-size", "2", "--steps", "3",
                     "--remat", "none", "--log-every", "1", "--eval-generate", held, "--eval-generate-every", "2",
                     "--metrics-out", str(metrics)]) == 0
    err = capsys.readouterr().err
    records = [json.loads(x) for x in metrics.read_text().splitlines()]
    evals = [r["eval_generate"] for r in records if "eval_generate" in r]
    assert [e["step"] for e in evals] == [0, 2, 3]
    assert all(e["prompts"] == 2 and e["reference_nll"] > 0 and e["valid_call_rate"] is not None for e in evals)
    assert evals[-1]["reference_nll"] < evals[0]["reference_nll"]  # three steps move the references' NLL
    assert records[-1]["summary"]["eval_generate"] == evals[-1]
    assert "eval-generate after step 0: exact match 0.0% of 2 prompts, reference NLL" in err
    steps = [r for r in records if "step" in r and "loss" in r]
    step3 = next(s for s in steps if s["step"] == 3)
    # the evaluation after step 2 is not charged to step 3 (--log-every 1: each step its own window)
    assert step3["step_time_s"] < EVAL_DELAY_S / 2
    page = tmp_path / "report.md"
    assert report(["--metrics", str(metrics), "--output", str(page)]) == 0
    assert "Held-out generations during training" in page.read_text()
    assert (tmp_path / "report_figures" / "eval_generate.png").exists()
