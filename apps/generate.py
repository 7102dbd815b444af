"""`prepack generate`: what does the (tuned) model answer to the data's own prompts, and how often
is it right?

    prepack generate --input held_out.jsonl --format chat --model gemma3-270m --lora lora.safetensors \\
        --output tuned.jsonl --score

Records are read, templated and tokenized exactly as `prepack pack` does (apps/read_inputs.py: the
job's readers and Preparer; the same --format, --columns, --roles, --tokenizer, --chat-format,
--expand-turns), and each packed example is cut at its last target turn (or each, --all-turns)
into the prompt the model trained on and the reference reply (prepack/text/chat/prompts.py).
Tunix's Sampler generates from those ids (train/generation/generate.py). The output is a JSONL, one line per
prompt in input order (train/generation/generations.py); `--score` adds each line's score and writes a
summary JSON beside it (train/generation/score.py; with the generation's tokens/s), and prints the table. Bad records are dead letters, as
in pack: written beside the output, and failing the run past --max-bad-fraction.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

from apps import read_inputs
from prepack.cli_help import CommandParser
from prepack.text.formats import template_names
from train.compilation import compile_cache

PROG = "prepack generate"


# Source formats whose records hold no one reply to generate for.
NO_PROMPTS = {
    "text": "--format text is plain text with no replies to prompt for; generate from a chat or instruction format",
    "preference": "--format preference holds two replies (chosen, rejected) per prompt, not one reference; generate "
                  "from the chosen side as a chat or prompt_completion file",
}


class GenerateCliError(Exception):
    """Bad options or inputs: one line, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog=PROG, description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("prompts (read and rendered as `prepack pack` does)")
    src.add_argument("--input", action="append", default=[], metavar="SPEC", required=True,
                     help="repeatable: a JSONL/JSON/Parquet file or glob (local or gs://), a save_to_disk folder, "
                     "hf:NAME[:CONFIG][:SPLIT] or tfds:NAME[:SPLIT], as `prepack pack --input`")
    src.add_argument("--format", "--template", dest="format", default="auto",
                     help=f"source format: {', '.join(n for n in template_names() if n not in ('text', 'preference'))}, or auto (default: "
                     "chosen from the first records' keys, and said)")
    src.add_argument("--columns", metavar="NAME=COLUMN,...", help="as `prepack pack --columns`")
    src.add_argument("--roles", metavar="ROLE=VALUE,...", help="as `prepack pack --roles`")
    src.add_argument("--source-lang", help="translation: source language code (default en)")
    src.add_argument("--target-lang", help="translation: target language code (default fr)")
    src.add_argument("--prompt-format", help="translation: prompt with {source}, {target} and {text}")
    src.add_argument("--tfds-data-dir", help="data_dir for tfds: inputs (default: TFDS's own)")
    src.add_argument("--tokenizer", default="gemma3", help="gemma3 (embedded, default), qwen3 (embedded), sp:FILE.model, hf:NAME_OR_PATH")
    src.add_argument("--chat-format", default="auto", help="gemma, chatml, qwen3, hf (the tokenizer's template) or auto (default)")
    src.add_argument("--train-reasoning", choices=("yes", "no"), default="yes", help="as `prepack pack --train-reasoning` (qwen3)")
    src.add_argument("--expand-turns", action="store_true",
                     help="as `prepack pack --expand-turns`: each target reply its own example, rendered as at that "
                     "point of the dialogue (give it when the adapter was trained on such a set)")
    src.add_argument("--all-turns", action="store_true",
                     help="one prompt per target assistant turn (ids <id>#<k>), instead of the last one of each example")
    src.add_argument("--max-prompts", type=int, metavar="N", help="generate for the first N prompts only")
    src.add_argument("--max-bad-fraction", type=float, default=0.0,
                     help="fail, as `prepack pack` does, when more than this fraction of the examples are bad records "
                     "(default 0: any); they are written as dead letters beside --output either way")
    mdl = p.add_argument_group("model (as `prepack train`)")
    mdl.add_argument("--model", help="gemma3-270m, gemma3-1b, qwen3-0.6b, tiny (= tiny-gemma3), tiny-qwen3, tiny-llama3 "
                     "(default: the one --lora was trained on)")
    mdl.add_argument("--weights", help="Hugging Face safetensors folder, 'random', 'gguf' (gemma3-270m's default), "
                     "or a gemma3-270m .gguf file")
    mdl.add_argument("--dtype", choices=["float32", "bfloat16"], help="parameter dtype (default: bf16 real, f32 tiny)")
    mdl.add_argument("--lora", metavar="PATH", help="the adapter `prepack train --save-lora` wrote; without it the base model runs")
    mdl.add_argument("--compile-cache", metavar="DIR|off", help=compile_cache.HELP)
    mdl.add_argument("--weights-seed", type=int, metavar="S",
                     help="random weights' seed, as `prepack train --seed` (default: the seed --lora was trained with, else 0)")
    smp = p.add_argument_group("sampling (Tunix's Sampler, KV-cached; greedy by default)")
    smp.add_argument("--max-new-tokens", type=int, default=256)
    smp.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    smp.add_argument("--top-p", type=float, help="nucleus sampling (with --temperature)")
    smp.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (with --temperature)")
    smp.add_argument("--seed", type=int, default=0, help="sampling seed")
    smp.add_argument("--batch-size", type=int, default=8, help="prompts per batch")
    out = p.add_argument_group("output")
    out.add_argument("--output", required=True, metavar="FILE.jsonl",
                     help="the generations: one JSON line per prompt, {id, prompt_tokens, completion, completion_tokens, "
                     "reference, stop_reason} (local or gs://)")
    out.add_argument("--score", action="store_true",
                     help="score each completion against the record's own reply (exact match, reference NLL, tool calls); "
                     "writes FILE.score.json beside --output and prints the table")
    out.add_argument("--tool-call-parser", metavar="NAME",
                     help="how calls are read from completions: hermes (<tool_call> JSON; the default for chatml and qwen3), "
                     "functiongemma (<start_function_call>call:NAME{...}<end_function_call>), or none; for --chat-format hf "
                     "the default is the layout the template spells")
    out.add_argument("--overwrite", action="store_true", help="replace an existing --output (and its summary and dead letters)")
    return p


def output_paths(output: str) -> dict[str, str]:
    """The files a run writes: the generations, the score summary and the dead letters beside it,
    at the output's resolved path (prepack.storage.output_rule.output_path)."""
    from prepack.storage import is_gcs, location_problem, output_rule

    problem = location_problem(output)
    if problem:
        raise GenerateCliError(f"--output {problem}")
    if output.endswith("/") or (is_gcs(output) and output.count("/") < 3):
        raise GenerateCliError(f"--output {output} is a folder; name a file, e.g. {output.rstrip('/')}/generations.jsonl")
    try:  # the one string the rule judges and the files are written at
        output = output_rule.output_path("--output", output)
    except output_rule.OutputPathError as e:
        raise GenerateCliError(str(e)) from None
    if not is_gcs(output) and os.path.isdir(output):
        raise GenerateCliError(f"--output {output} is a folder; name a file, e.g. {output}/generations.jsonl")
    stem = output[:-len(".jsonl")] if output.endswith(".jsonl") else output
    return {"generations": output, "score": f"{stem}.score.json", "dead_letters": f"{stem}.dead_letters.jsonl"}


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _template_options(args: argparse.Namespace) -> dict[str, str]:
    from pipelines.options import mapping_options

    try:
        options = mapping_options("" if args.format == "auto" else args.format, args.columns, args.roles)
    except ValueError as e:
        raise GenerateCliError(str(e)) from None
    for key in ("source_lang", "target_lang", "prompt_format"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    return options


def read_prompts(args: argparse.Namespace, tokenizer: Any, chat_format: Any) -> tuple[list[Any], list[dict[str, Any]], int, bool]:
    """(prompt items, dead letters, examples read, whether any example has tools), reading every
    --input through the job's read and prepare stages."""
    from pipelines.inputs.limits import InputLimits
    from prepack.packing.accounting import Tally
    from train.generation.generations import example_prompts

    prepare, _, _ = read_inputs.pipeline_modules()
    options = _template_options(args)
    fmt = args.format
    if fmt in NO_PROMPTS:
        raise GenerateCliError(NO_PROMPTS[fmt])
    metas, tasks = read_inputs.read_tasks(args.input, args.tfds_data_dir)
    for spec in args.input:
        found, note = read_inputs.checked_format(spec, fmt, options, InputLimits(), tfds_data_dir=args.tfds_data_dir)
        if note:
            _say(note)
        if fmt == "auto":
            fmt = found
    if fmt == "auto":
        raise GenerateCliError("--format auto: the inputs hold no records to choose a format from; name one with --format")
    if fmt in NO_PROMPTS:  # what auto chose
        raise GenerateCliError(NO_PROMPTS[fmt])
    preparer = prepare.Preparer(metas, read_inputs.make_template(fmt, options), tokenizer, chat_format,
                                expand_turns=args.expand_turns)
    tally, bad = Tally(), []
    examples = read_inputs.templated(preparer, metas, tasks, tally, InputLimits(), bad=bad)
    items, has_tools = example_prompts(preparer, examples, tally, bad, args.all_turns)
    letters = [entry for _, entry in sorted(bad, key=lambda kv: kv[0])]
    return items, letters, tally.examples + sum(tally.bad_records.values()), has_tools


def resolve_model(args: argparse.Namespace) -> tuple[Any, str]:
    """(the --lora adapter, read whole and checked, or None; the model's name): before any tokenizer or weights."""
    from train.adapter_files import adapters

    adapter = adapters.read_adapter(args.lora) if args.lora else None
    name = args.model or (adapter.model if adapter else None)
    if name is None:
        raise GenerateCliError("--model is required (or --lora, whose file names the model it was trained on)")
    if adapter is not None and adapter.model and adapter.model != name:
        raise GenerateCliError(f"--lora {args.lora} was trained on --model {adapter.model}, not {name}")
    return adapter, name


def check_bounds(args: argparse.Namespace, name: str, adapter: Any, sampling: Any, vocab_size: int | None,
                 prompt_tokens: int) -> None:
    """--max-new-tokens against the model's context and --batch-size against the device's memory
    (train/generate_bounds.py), before the weights load; run once before the prompts are read (their
    length taken as 0, the batch as --max-prompts allows) and again with the longest prompt and the
    batch that runs (cut to the prompts)."""
    from train import generate_bounds
    from train.model import models

    spec = models.get_spec(name)
    generate_bounds.check_context(name, spec.context_length, sampling.max_new_tokens, prompt_tokens)
    vocab = adapter.vocab_size if adapter is not None and adapter.vocab_size else vocab_size
    config = models.resolve_config(name, vocab_size=vocab, dtype=args.dtype)
    generation = generate_bounds.plan(spec.family, config, batch_size=sampling.batch_size,
                                      max_new_tokens=sampling.max_new_tokens, prompt_tokens=prompt_tokens,
                                      compute_dtype=models.parse_dtype(args.dtype, spec.default_dtype))
    generate_bounds.check_memory(generation, sampling.batch_size)


def load_model(args: argparse.Namespace, tokenizer: Any, adapter: Any, name: str) -> tuple[Any, Any, dict[str, Any]]:
    """(the model, its compute dtype, what the summary records about it)."""
    from train.adapter_files import adapters
    from train.model import models
    from train.run_config.vocab import check_vocab

    spec = models.get_spec(name)
    vocab = adapter.vocab_size if adapter is not None and adapter.vocab_size else tokenizer.vocab_size
    config = models.resolve_config(name, vocab_size=vocab, dtype=args.dtype)
    check_vocab(tokenizer.identity(), name, spec.family, models.config_vocab_size(config), f"--tokenizer {tokenizer.name}")
    seed = args.weights_seed
    if seed is None:
        seed = int(adapter.metadata.get("seed") or 0) if adapter is not None else 0
    _say(f"loading {name} weights ({models.describe_weights(spec, args.weights)}) ...")
    started = time.perf_counter()
    built = models.build_model(name, weights=args.weights, vocab_size=vocab, dtype=args.dtype, seed=seed)
    model = adapters.apply_adapter(built.model, spec, adapter) if adapter is not None else built.model
    _say(f"loaded in {time.perf_counter() - started:.1f} s" + (f", LoRA rank {adapter.rank} from {args.lora}" if adapter else ""))
    compute = models.parse_dtype(args.dtype, spec.default_dtype)
    import jax.numpy as jnp

    about = {"model": name, "weights": built.weights, "dtype": jnp.dtype(compute).name,
             "lora": adapter.describe() if adapter is not None else None}
    return model, compute, about


def run_paths(args: argparse.Namespace, paths: dict[str, str]) -> Any:
    """What a generate run reads and writes, for the one output rule (prepack/storage/output_rule.py):
    the generations, their score and dead letters apart from every input and from each other."""
    from prepack.storage import output_rule

    inputs = output_rule.input_places("--input", args.input)
    inputs += output_rule.input_places("--lora", [args.lora])
    if args.weights not in (None, "random", "gguf"):
        inputs.append(output_rule.Place("--weights", args.weights))
    if args.tokenizer and args.tokenizer.startswith(("sp:", "hf:")):
        inputs += output_rule.input_places("--tokenizer", [args.tokenizer])
    outputs = [output_rule.Place("--output", paths["generations"]),
               output_rule.Place("--output's score", paths["score"]),
               output_rule.Place("--output's dead letters", paths["dead_letters"])]
    cache = compile_cache.place(args.compile_cache)
    return output_rule.RunPaths(inputs, outputs + ([cache] if cache else []))


def check_args(args: argparse.Namespace) -> tuple[dict[str, str], Any]:
    """(output paths, sampling options): every option checked, and the output rule, before any work."""
    from prepack import overwrite
    from prepack.storage import output_rule
    from prepack.text.chat import tool_calls
    from train.generation import generate

    paths = output_paths(args.output)
    try:  # resolved once: the string the rule judges and JAX's cache uses
        args.compile_cache = compile_cache.resolved_option(args.compile_cache)
    except output_rule.OutputPathError as e:
        raise GenerateCliError(str(e)) from None
    sampling = generate.SamplingOptions(args.max_new_tokens, args.temperature, args.top_p, args.top_k, args.seed, args.batch_size)
    sampling.check()
    if args.weights_seed is not None:
        problem = generate.seed_problem("--weights-seed", args.weights_seed)
        if problem:
            raise GenerateCliError(problem)
    if args.max_prompts is not None and args.max_prompts < 1:
        raise GenerateCliError(f"--max-prompts must be at least 1, got {args.max_prompts}")
    if not 0 <= args.max_bad_fraction <= 1:
        raise GenerateCliError(f"--max-bad-fraction must be within 0..1, got {args.max_bad_fraction}")
    if args.tool_call_parser is not None:
        tool_calls.get_parser(args.tool_call_parser)
    refused = output_rule.refusal(run_paths(args, paths))
    if refused:
        raise GenerateCliError(refused)
    if not args.overwrite:
        refusal = overwrite.refusal([paths["generations"], paths["score"], paths["dead_letters"]], "write generations over them")
        if refusal:
            raise GenerateCliError(refusal)
    return paths, sampling


def dead_letters(letters: list[dict[str, Any]], examples: int, path: str, max_bad_fraction: float) -> None:
    """Writes the dead letters beside the output; fails past --max-bad-fraction, as `prepack pack` does."""
    from collections import Counter

    from prepack import storage
    from prepack.packing.bad_records import too_many_bad_records
    from train.generation.generations import jsonl_bytes

    if letters:
        storage.storage_for(path).replace(path, jsonl_bytes(letters), content_type="application/x-ndjson")
        _say(f"{len(letters)} bad record(s) of {examples}: dead letters in {path}")
    problem = too_many_bad_records(len(letters), examples, Counter(e["reason"] for e in letters), max_bad_fraction)
    if problem:
        raise GenerateCliError(f"{problem}. Fix the inputs (is --format right?), or raise --max-bad-fraction to skip them")


def call_parser(args: argparse.Namespace, chat_format: Any, tokenizer: Any, has_tools: bool) -> str | None:
    """--tool-call-parser, else the chat format's layout when the records offer tools; None: calls are not read."""
    from prepack.text.chat import tool_calls

    if args.tool_call_parser is not None or not has_tools:
        return args.tool_call_parser
    parser = tool_calls.default_parser(chat_format.name, getattr(chat_format, "chat_template", None))
    if parser is None and args.score:
        raise GenerateCliError(f"the records make tool calls, and the template of {tokenizer.name!r} spells neither "
                               "<tool_call> nor <start_function_call>: name the layout with --tool-call-parser "
                               f"({', '.join(tool_calls.parser_names())})")
    return parser


def run(args: argparse.Namespace) -> int:
    from prepack import storage
    from prepack.text.chat import get_chat_format
    from prepack.text.tokenizer import load_tokenizer
    from train.generation import generate, generations

    paths, sampling = check_args(args)
    adapter, name = resolve_model(args)
    # Before the prompts are read their count is unknown, and the batch is cut to it: this first
    # look counts the rows --max-prompts allows (one without it), the second the batch that runs.
    check_bounds(args, name, adapter, dataclasses.replace(sampling, batch_size=min(sampling.batch_size, args.max_prompts or 1)),
                 None, 0)
    tokenizer = load_tokenizer(args.tokenizer)
    chat_format = get_chat_format(args.chat_format, tokenizer, args.train_reasoning == "yes")
    items, letters, examples, has_tools = read_prompts(args, tokenizer, chat_format)
    dead_letters(letters, examples, paths["dead_letters"], args.max_bad_fraction)
    items = items[:args.max_prompts] if args.max_prompts is not None else items
    if not items:
        raise GenerateCliError("the inputs hold no prompt to generate for (no example with a target assistant turn)")
    parser = call_parser(args, chat_format, tokenizer, has_tools)
    if sampling.batch_size > len(items):
        # A batch is padded to its size with copies: rows past the prompts would only be computed and
        # thrown away (--batch-size 100000 for 2 prompts ran out of memory).
        _say(f"--batch-size {sampling.batch_size:,} is more than the {len(items):,} prompts: one batch of {len(items):,}")
        sampling = dataclasses.replace(sampling, batch_size=len(items))
    check_bounds(args, name, adapter, sampling, tokenizer.vocab_size, max(len(i.prompt_ids) for i in items))
    # After every check that can refuse the run (its one line stays alone), before the first compile.
    compile_cache.enable(args.compile_cache, sys.stderr)
    model, compute, about = load_model(args, tokenizer, adapter, name)
    stop_ids = sorted(chat_format.end_of_turn_ids())
    generator = generate.Generator(model, pad_id=tokenizer.pad_id, stop_ids=stop_ids,
                                   max_prompt_tokens=max(len(i.prompt_ids) for i in items), sampling=sampling,
                                   compute_dtype=compute)
    _say(f"{len(items)} prompts from {examples} examples ({chat_format.name} chat format, stop ids {stop_ids}); "
         f"generating up to {sampling.max_new_tokens} tokens each, {sampling.batch_size} per batch (each new prompt "
         "length bucket compiles first)")
    started = time.perf_counter()

    def progress(done: int, total: int, seconds: float) -> None:
        _say(f"{done}/{total} prompts, {generator.throughput()}")

    def nll(pairs: Sequence[tuple[Any, Any]]) -> list[tuple[float, int]]:
        from pipelines.progress import progress_of

        _say("scoring the references (teacher-forced NLL) ...")
        with progress_of(f"{PROG}: scoring the references", "batches", sys.stderr) as scoring:  # minutes for many prompts on a CPU
            return generate.reference_nll(generator.view, pairs, compute_dtype=compute, batch_size=sampling.batch_size,
                                          progress=scoring)

    lines = generations.run_items(items, generator, chat_format, score=args.score, parser=parser, nll=nll, progress=progress)
    storage.storage_for(paths["generations"]).replace(
        paths["generations"], generations.jsonl_bytes(lines), content_type="application/x-ndjson")
    _say(f"wrote {len(lines)} generations to {paths['generations']} ({generator.throughput()}; "
         f"{time.perf_counter() - started:.1f} s in all)")
    if args.score:
        write_summary(args, paths, lines, parser, tokenizer, chat_format, sampling, {**about, "generation": generator.figures()})
    return 0


def write_summary(args: argparse.Namespace, paths: dict[str, str], lines: list[dict[str, Any]], parser: str | None,
                  tokenizer: Any, chat_format: Any, sampling: Any, about: dict[str, Any]) -> None:
    """--score: the summary JSON beside the output (with `about`: the model, and `generation`, the
    sampler's tokens, seconds and tokens/s, train/generation/generate.py's Generator.figures), and the table."""
    from prepack import storage
    from train.generation import score as score_lib

    summary = score_lib.summarize(lines, parser)
    summary.update({"generations": paths["generations"], "inputs": list(args.input), "tokenizer": tokenizer.name,
                    "chat_format": chat_format.name, "all_turns": args.all_turns, "expand_turns": args.expand_turns,
                    "sampling": sampling.describe(), **about})
    storage.storage_for(paths["score"]).replace(paths["score"], (json.dumps(summary, indent=1) + "\n").encode())
    print(score_lib.table([("base" if about["lora"] is None else "tuned", summary)]))
    _say(f"wrote the score summary to {paths['score']}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from prepack.format.manifest import ManifestError
    from prepack.text.chat import ChatFormatError
    from prepack.text.tokenizer import TokenizerError
    from train.adapter_files.lora_file import LoraFileError
    from train.generation.generate import GenerateError
    from train.model.models import ModelError
    from train.compilation.compile_cache import CompileCacheError
    from train.run_config.config import TrainError

    try:
        return run(args)
    except (GenerateCliError, read_inputs.InputsError, GenerateError, ChatFormatError, TokenizerError, ModelError, TrainError,
            LoraFileError, ManifestError, CompileCacheError) as e:
        print(f"{PROG}: {getattr(e, 'message', None) or e}", file=sys.stderr)
        return 2
    except ValueError as e:  # an unknown --tool-call-parser, a malformed option value
        if type(e) is not ValueError:
            raise
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
