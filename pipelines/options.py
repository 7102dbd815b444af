"""`prepack pack` options: the parser, built from small pieces, makes the job's RowSpec and RunOptions
(pipelines/configs.py); everything else goes to Beam.

Our own flags are parsed with argparse; whatever argparse does not know is
handed to Beam's PipelineOptions untouched, so every Beam option (runner,
direct_num_workers, project, region, temp_location, setup_file, ...) works.
Only when no runner is given do we pick one: FnApiRunner in multi-processing
mode on all cores. The plain DirectRunner would first try Prism, which
downloads a binary and fails offline (since Beam 2.68 the DirectRunner tries the Prism
runner first, apache/beam#34612; FnApiRunner runs in process).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from pipelines.inputs.limits import (DEFAULT_MAX_COMPRESSION_RATIO, DEFAULT_MAX_DECOMPRESSED_BYTES, DEFAULT_MAX_RECORD_BYTES,
                                     DEFAULT_MAX_WHOLE_FILE_BYTES, RATIO_CHECKED_AFTER, InputLimits)
from pipelines.planning import MAX_SUB_BUCKETS
from pipelines.configs import (DEFAULT_MAX_LENGTHS, DEFAULT_TARGET_SHARD_MB, DEFAULT_TOKENIZE_BATCH_SIZE, PackConfig, RowSpec,
                               RunOptions)
from pipelines.output.lock import DEFAULT_EXPIRY_S, MAX_EXPIRY_S, MIN_EXPIRY_S
from prepack.packing.bad_records import DEFAULT_MAX_BAD_FRACTION
from prepack.mixture_file import ALLOW_LOCAL_FLAG, load_mixture
from prepack.storage import location_problem, output_rule
from prepack.packing.mixture import Mixture, MixtureError
from prepack.packing.packer import OverlongPolicy, Planner
from prepack.format.layout import TOKENS_DIR
from prepack.format.rowformat import MAX_MAX_LENGTH
from prepack.cli_help import CommandParser, closest_option, long_options
from prepack.text.formats import template_names

MAX_LENGTHS_PER_JOB = 64  # each example carries one bit per max length (PayloadBatch.kept_at)
# The source formats (prepack/text/formats/), for help texts and messages.
FORMAT_NAMES = template_names()
SAMPLE_FORMAT = "alpaca"

# The runners this job is built and tested on, by Beam's dotted class paths (a runner's
# name resolves to one the way Beam's create_runner does it). Others break it in ways that
# surface far from the cause (Beam 2.77's DaskRunner hands tagged outputs to the main
# consumer, drops finish_bundle outputs, runs only the last sink): refused unless
# --allow-untested-runner.
SUPPORTED_RUNNERS: dict[str, tuple[str, ...]] = {
    "FnApiRunner": ("apache_beam.runners.portability.fn_api_runner.FnApiRunner",
                    "apache_beam.runners.portability.fn_api_runner.fn_runner.FnApiRunner"),
    "DataflowRunner": ("apache_beam.runners.dataflow.dataflow_runner.DataflowRunner",
                       "apache_beam.runners.dataflow.DataflowRunner"),
}


class OptionsError(ValueError):
    """Bad command-line options: printed as one line, exit status 2."""


def sample_path() -> str:
    """The embedded sample dataset (alpaca format) that `--sample` packs."""
    import prepack

    return os.path.join(os.path.dirname(os.path.abspath(prepack.__file__)), "sample_data", "sample_sft.jsonl")


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(  # no abbreviations: a Beam flag must never be taken for one of ours
        prog="prepack pack",
        description=(
            "Read SFT datasets, apply a template and chat format, tokenize once, pack per max length "
            "with a global plan (best-fit-decreasing, or exact fills where they need fewer rows), and publish "
            "ArrayRecord shards plus manifest.json into "
            "OUTPUT/L<max_length>/. Options this command does not know are passed to Beam "
            "(e.g. --runner=DataflowRunner --project=... --region=... --temp_location=gs://...)."
        ),
    )
    _add_input_options(p.add_argument_group("inputs"))
    groups = add_row_options(p)
    groups["packing"].add_argument("--no-pack", action="store_true",
                                   help="one example per row (baseline), same format and manifest")
    _add_output_options(p.add_argument_group("output"))
    return p


def add_row_options(parser: argparse.ArgumentParser, default_lengths: tuple[int, ...] = DEFAULT_MAX_LENGTHS
                    ) -> dict[str, argparse._ArgumentGroup]:
    """Every option that makes the rows (pipelines.configs.RowSpec) but the inputs, as `prepack pack`
    and `prepack preflight` both take it: one definition, read back by `row_spec`. Returns the
    groups by name, for a command's own options beside them."""
    groups = {
        "templates": parser.add_argument_group("templates"),
        "tokenizing": parser.add_argument_group("tokenizing"),
        "packing": parser.add_argument_group("packing"),
        "shards": parser.add_argument_group("shards"),
        "limits": parser.add_argument_group("limits", "what one input may make a worker hold (pipelines/README.md, \"Limits\")"),
    }
    _add_template_options(groups["templates"])
    _add_tokenizing_options(groups["tokenizing"])
    _add_packing_options(groups["packing"], default_lengths)
    _add_shard_options(groups["shards"])
    _add_limit_options(groups["limits"])
    return groups


def _add_input_options(src: argparse._ArgumentGroup) -> None:
    src.add_argument(
        "--input", action="append", default=[], metavar="SPEC",
        help="repeatable. A JSONL/JSON/Parquet/Arrow file or glob (local or gs://), a save_to_disk folder "
        "(DIR or DIR:SPLIT), hf:NAME[:CONFIG][:SPLIT] (needs the network), or tfds:NAME[:SPLIT]",
    )
    src.add_argument("--sample", action="store_true", help="pack the embedded sample dataset (alpaca format) instead of --input")
    src.add_argument("--format", "--template", dest="format",
                     help=f"source format: {', '.join(FORMAT_NAMES)}, or auto (chosen from the first records' keys, "
                     "and said); docs/formats.md shows a record of each")
    src.add_argument("--mixture", metavar="FILE",
                     help="mix several sources with weights (a YAML or JSON file: weight_of, max_repeats, sources); "
                     "replaces --input, --format and --sample")
    src.add_argument(ALLOW_LOCAL_FLAG, action="store_true",
                     help="a --mixture file on gs:// may name local paths (refused by default: a file in a bucket others "
                     "can write would make the job read this machine's files)")
    src.add_argument("--allow-short-mix", action="store_true",
                     help="publish a mixture even where its realized shares miss the requested ones by more than 0.5 pp")
    src.add_argument("--from-tokens", metavar="DIR",
                     help="pack from a tokenized set (OUTPUT/tokens of an earlier run) instead of --input: "
                     "no reading of the inputs, no tokenizer; same shard sets as a full run")


def _add_tokenizing_options(tok: argparse._ArgumentGroup) -> None:
    tok.add_argument("--tokenizer", help="gemma3 (embedded, default), qwen3 (embedded), sp:FILE.model, hf:NAME_OR_PATH")
    tok.add_argument("--chat-format", help="gemma, chatml, qwen3, hf (the tokenizer's template) or auto (default)")
    tok.add_argument("--train-reasoning", choices=("yes", "no"),
                     help="qwen3: whether the think block of a reply's reasoning_content (<think>, the trace, </think>) is "
                     "a target (default yes); the block is shown on the replies after the last user turn only, as Qwen3's "
                     "template does")
    tok.add_argument("--expand-turns", action="store_true",
                     help="a conversation with k target assistant turns becomes k examples: example i is the conversation "
                     "up to and including reply i, as the chat format renders it there, training reply i alone (ids <id>#<i>)")


def _add_template_options(tpl: argparse._ArgumentGroup) -> None:
    tpl.add_argument("--columns", metavar="NAME=COLUMN,...",
                     help="read other column and message-key names: e.g. messages=dialog,role=speaker,content=text,"
                     "tools=functions,system=sys (canonical names: messages, role, content, tools, system, text, prompt, "
                     "completion, and each format's own, e.g. instruction, output)")
    tpl.add_argument("--roles", metavar="ROLE=VALUE,...",
                     help="read other role values: e.g. user=human,assistant=bot,tool=observation (roles: system, user, "
                     "assistant, tool, tool_call); the default spellings still map")
    tpl.add_argument("--source-lang", help="translation: source language code (default en)")
    tpl.add_argument("--target-lang", help="translation: target language code (default fr)")
    tpl.add_argument("--prompt-format", help="translation: prompt with {source}, {target} and {text}")
    tpl.add_argument("--tfds-data-dir", help="data_dir for tfds: inputs (default: TFDS's own)")


def _add_packing_options(pk: argparse._ArgumentGroup, default_lengths: tuple[int, ...]) -> None:
    pk.add_argument(
        "--max-length", action="extend", nargs="+", default=[], metavar="L",
        help="repeatable, several per flag: e.g. --max-length 512 1024 2048 tokenizes once and writes OUTPUT/L512, ... "
        f"(default {' '.join(map(str, default_lengths))}; at most {MAX_MAX_LENGTH:,})",
    )
    add_overlong_options(pk)
    pk.add_argument("--planner", choices=[p.value for p in Planner], default=Planner.BEST.value,
                    help="how rows are planned from the length histogram: best (default: the fewer rows of "
                    "best-fit-decreasing and exact fills) or bfd (best-fit-decreasing only)")
    pk.add_argument("--max-segments-per-row", type=int, metavar="N",
                    help="at most N examples (segments) in a row, for attention kernels that cap them (default: no cap)")
    pk.add_argument("--sub-buckets", type=int, help="advanced: hash sub-buckets per length when assigning rows (default: from input size)")


def add_overlong_options(group: argparse._ActionsContainer) -> None:
    """--overlong and --window-context-tokens, as `prepack pack` and `prepack preflight` both take
    them (one definition; window_context_option checks the value for both)."""
    group.add_argument("--overlong", choices=[p.value for p in OverlongPolicy], default=OverlongPolicy.DROP.value,
                       help="examples longer than L: drop (default), truncate (cut to L), split (cut into pieces of at most L "
                       "tokens, each its own segment; a piece sees no earlier context), or window (pieces as split, but each "
                       "after the first starts with its reply's prompt as loss-0 context, then the reply's next tokens; each "
                       "target is trained in exactly one piece). For --format text documents split is the sensible choice "
                       "(nothing is lost); preference pairs take drop or truncate (which cuts both completions' ends)")
    group.add_argument("--window-context-tokens", metavar="N",
                       help="--overlong window: replay at most the last N tokens of a reply's prompt (the loss-0 run before "
                       "the reply: system and user turn for the first reply, the turn it answers for a later one) "
                       "(default: L // 4 at each max length, at least 1); a piece whose context leaves no room for a target "
                       "is dropped as window_context_too_long")


def _add_limit_options(lim: argparse._ArgumentGroup) -> None:
    lim.add_argument("--max-record-bytes", type=int, default=DEFAULT_MAX_RECORD_BYTES, metavar="N",
                     help=f"a JSONL line longer than this is skipped unread and dead-lettered as too_large "
                     f"(default {DEFAULT_MAX_RECORD_BYTES:,} = 32 MiB)")
    lim.add_argument("--max-decompressed-bytes", type=int, default=DEFAULT_MAX_DECOMPRESSED_BYTES, metavar="N",
                     help=f"fail the job when one file decompresses (or, read whole: JSON arrays, Parquet, Arrow, is) to "
                     f"more than this (default {DEFAULT_MAX_DECOMPRESSED_BYTES:,} = 64 GiB)")
    lim.add_argument("--max-whole-file-bytes", type=int, default=DEFAULT_MAX_WHOLE_FILE_BYTES, metavar="N",
                     help=f"fail the job when a file read whole (a JSON array, Parquet or Arrow file: one worker holds it "
                     f"and its records) holds more than this (default {DEFAULT_MAX_WHOLE_FILE_BYTES:,} = 1 GiB); JSONL streams")
    lim.add_argument("--max-compression-ratio", type=float, default=DEFAULT_MAX_COMPRESSION_RATIO, metavar="X",
                     help=f"fail the job when a compressed file expands more than X times, a decompression bomb "
                     f"(default {DEFAULT_MAX_COMPRESSION_RATIO:g}; checked past {RATIO_CHECKED_AFTER >> 20} MiB of output)")


def _add_shard_options(group: argparse._ArgumentGroup) -> None:
    shards = group.add_mutually_exclusive_group()
    shards.add_argument("--num-shards", type=int, help="shards per max length (default: from --target-shard-mb)")
    shards.add_argument("--target-shard-mb", type=float, default=DEFAULT_TARGET_SHARD_MB,
                        help=f"approximate compressed shard size (default {DEFAULT_TARGET_SHARD_MB:g})")
    group.add_argument("--max-bad-fraction", type=float, default=DEFAULT_MAX_BAD_FRACTION,
                       help="fail when bad records / examples read exceeds this (default 0: any bad record fails the job)")


def _add_output_options(out: argparse._ArgumentGroup) -> None:
    out.add_argument("--output", help="output folder, local or gs://; each max length gets OUTPUT/L<L>/")
    out.add_argument("--overwrite", action="store_true", help="replace existing shard sets in OUTPUT")
    add_run_options(out)


def add_run_options(out: argparse._ActionsContainer) -> None:
    """How a run behaves (pipelines.configs.RunOptions) beside its --output and --overwrite:
    `prepack pack`'s, and what `prepack preflight --pack-output` passes on (parse_run_args)."""
    out.add_argument("--allow-untrained-eot", action="store_true",
                     help="publish even when some target assistant turns do not train their end-of-turn token (counted "
                     "as stats.turns_without_trained_eot; by default such a run fails: the model would not learn to stop)")
    out.add_argument("--no-tokens", action="store_true",
                     help="do not publish the tokenized set OUTPUT/tokens (by default it is, for --from-tokens later)")
    out.add_argument("--clean-stale", action="store_true",
                     help="remove what earlier killed runs left in OUTPUT (staging folders, temp files, unpublished shards)")
    out.add_argument("--tokenize-batch-size", dest="batch_size", type=int, default=DEFAULT_TOKENIZE_BATCH_SIZE,
                     help="records per batch for reading and tokenizing")
    # The old name of --tokenize-batch-size (preflight's and report's --batch-size is the training batch).
    out.add_argument("--batch-size", dest="old_batch_size", type=int, help=argparse.SUPPRESS)
    out.add_argument("--allow-untested-runner", action="store_true",
                     help=f"run on a Beam runner other than {' and '.join(SUPPORTED_RUNNERS)} (untested; may lose or misroute rows)")
    out.add_argument("--lock-expiry-s", type=float, default=DEFAULT_EXPIRY_S,
                     help="a gs:// output lock its run has not renewed for this long is stale and may be taken over "
                          f"(default 600, at least {MIN_EXPIRY_S:g}; the run renews it every min(60, expiry/3) s and "
                          "stops when a renewal takes over a third of it)")
    out.add_argument("--no-progress", action="store_true", help="no records/s lines from the workers")
    out.add_argument("--verbose", action="store_true",
                     help="Beam's and the workers' full logs (by default warnings only, and after Ctrl-C only the last line)")


def parse_args(argv: Sequence[str]) -> tuple[PackConfig, list[str]]:
    """(our config, the remaining arguments for Beam). Raises OptionsError on bad values."""
    parser = build_parser()
    ns, beam_args = parser.parse_known_args(list(argv))
    beam_args = _beam_arguments(parser, ns, beam_args)
    inputs, fmt, mixture = _inputs(ns)
    if not ns.output:
        raise OptionsError("--output is required (a local folder or gs://bucket/prefix)")
    for flag, path in (("--output", ns.output), ("--from-tokens", ns.from_tokens)):
        if path and location_problem(path):
            raise OptionsError(f"{flag} {location_problem(path)}")
    try:  # the one string the rule judges and the sets are written under
        ns.output = output_rule.output_path("--output", ns.output)
    except output_rule.OutputPathError as e:
        raise OptionsError(str(e)) from None
    refused = output_rule.refusal(run_paths(ns, inputs))
    if refused:
        raise OptionsError(refused)
    template_options = _template_options(ns, fmt)
    rows = row_spec(ns, inputs, fmt, mixture, template_options, pack=not ns.no_pack)
    _check_run_behaviour(ns)
    return PackConfig(rows, _run_options(ns, _requested(ns, inputs, template_options))), beam_args


# A tokenized set read back into the output it was published in: OUT/tokens is OUT's own
# (`prepack pack --from-tokens OUT/tokens --output OUT`), the one input allowed inside --output.
INPUTS_INSIDE_OUTPUT = {("--from-tokens", "--output"): TOKENS_DIR}


def run_paths(ns: argparse.Namespace, inputs: Sequence[str]) -> output_rule.RunPaths:
    """What a pack run reads and writes, for the one output rule (prepack/storage/output_rule.py):
    --output apart from every input (a mixture's sources included), the --mixture file, a tokenizer
    file or folder, --tfds-data-dir and --from-tokens (but OUT/tokens), and from the working folder."""
    found = output_rule.input_places("--input", inputs)
    found += output_rule.input_places("--mixture", [ns.mixture])
    found += output_rule.input_places("--from-tokens", [ns.from_tokens])
    if ns.tokenizer and ns.tokenizer.startswith(("sp:", "hf:")):
        found += output_rule.input_places("--tokenizer", [ns.tokenizer])
    if ns.tfds_data_dir:
        found.append(output_rule.Place("--tfds-data-dir", ns.tfds_data_dir))
    return output_rule.RunPaths(found, [output_rule.Place("--output", ns.output)], INPUTS_INSIDE_OUTPUT)


def row_spec(ns: argparse.Namespace, inputs: tuple[str, ...], fmt: str, mixture: Mixture | None,
             template_options: dict[str, str], default_lengths: tuple[int, ...] = DEFAULT_MAX_LENGTHS,
             pack: bool = True) -> RowSpec:
    """The RowSpec of the options `add_row_options` defined, every value checked (OptionsError,
    one line): `prepack pack` runs it, `prepack preflight` evaluates it (and, with --pack-output,
    runs that same RowSpec)."""
    max_lengths = _lengths(ns.max_length, default_lengths)
    _check_limits(ns)
    _check_row_shape(ns, max_lengths)
    if ns.tokenizer:
        _check_tokenizer(ns.tokenizer)
    return _row_spec(ns, inputs, fmt, mixture, max_lengths, template_options, pack)


def parse_run_args(argv: Sequence[str], output: str, overwrite: bool, own_options: Sequence[str] = ()
                   ) -> tuple[RunOptions, list[str]]:
    """(RunOptions, Beam's arguments) of a job whose RowSpec is made already (`prepack preflight
    --pack-output`): the run options `add_run_options` defines, the rest Beam's (checked as pack
    checks them; own_options: the caller's, for the hint on a misspelt one)."""
    parser = CommandParser(prog="prepack preflight --pack-output", add_help=False)
    add_run_options(parser)
    parser.set_defaults(output=output, overwrite=overwrite, from_tokens=None, allow_short_mix=False)
    ns, beam_args = parser.parse_known_args(list(argv))
    beam_args = _beam_arguments(parser, ns, beam_args, own_options)
    _check_run_behaviour(ns)
    return _run_options(ns, {}), beam_args


def _beam_arguments(parser: argparse.ArgumentParser, ns: argparse.Namespace, beam_args: Sequence[str],
                    own_options: Sequence[str] = ()) -> list[str]:
    """What goes to Beam, checked (runner, unknown options), with the default runner added."""
    check_runner(beam_args, allow_untested=ns.allow_untested_runner)
    check_beam_args(beam_args, own_options=list(own_options) + long_options(parser))
    _take_old_batch_size(ns)
    beam_args = with_default_runner(beam_args)
    _refuse_multi_threading(beam_args)
    return beam_args


def _take_old_batch_size(ns: argparse.Namespace) -> None:
    if ns.old_batch_size is not None:
        print("prepack pack: warning: --batch-size is now --tokenize-batch-size (the old name will be removed)",
              file=sys.stderr)
        if ns.batch_size == DEFAULT_TOKENIZE_BATCH_SIZE:
            ns.batch_size = ns.old_batch_size


def _mixture(ns: argparse.Namespace) -> Mixture | None:
    """The --mixture file, parsed; refused beside the flags it replaces."""
    if not ns.mixture:
        return None
    for flag, given in (("--input", ns.input), ("--format", ns.format), ("--sample", ns.sample),
                        ("--source-lang", ns.source_lang), ("--target-lang", ns.target_lang),
                        ("--prompt-format", ns.prompt_format), ("--columns", ns.columns), ("--roles", ns.roles)):
        if given:
            raise OptionsError(f"--mixture names each source's inputs and format; do not combine it with {flag}")
    try:
        return load_mixture(ns.mixture, ns.allow_local_inputs)
    except MixtureError as e:
        raise OptionsError(str(e)) from None


def _inputs(ns: argparse.Namespace) -> tuple[tuple[str, ...], str, Mixture | None]:
    """(inputs, format, mixture file) from --input/--format, --sample, --mixture or --from-tokens;
    None: no mixture file, the run's one source is its inputs (PackConfig.mixture)."""
    mixture = _mixture(ns)
    if ns.from_tokens:
        if ns.sample:
            raise OptionsError("--from-tokens packs a tokenized set; do not combine it with --sample")
        return tuple(ns.input), ns.format or "", mixture
    if ns.mixture:
        return mixture.inputs(), "mixture", mixture
    if ns.sample:
        if ns.input:
            raise OptionsError("--sample packs the embedded sample dataset; do not combine it with --input")
        return (sample_path(),), ns.format or SAMPLE_FORMAT, None
    if not ns.input:
        raise OptionsError("no input: pass --input SPEC (repeatable) or --sample")
    if not ns.format:
        raise OptionsError(f"--format is required: {', '.join(FORMAT_NAMES)}, or auto")
    if ns.format != "auto" and ns.format not in FORMAT_NAMES:
        raise OptionsError(f"--format: unknown source format {ns.format!r}; expected one of {', '.join(FORMAT_NAMES)}, or auto")
    return tuple(ns.input), ns.format, None


def _check_limits(ns: argparse.Namespace) -> None:
    for flag, value in (("--max-record-bytes", ns.max_record_bytes), ("--max-decompressed-bytes", ns.max_decompressed_bytes),
                        ("--max-whole-file-bytes", ns.max_whole_file_bytes)):
        if value < 1:
            raise OptionsError(f"{flag} must be at least 1, got {value}")
    if not ns.max_compression_ratio >= 1:  # also refuses nan
        raise OptionsError(f"--max-compression-ratio must be at least 1, got {ns.max_compression_ratio}")


def _check_row_shape(ns: argparse.Namespace, max_lengths: tuple[int, ...]) -> None:
    """The options that shape the rows and shards."""
    if len(max_lengths) > MAX_LENGTHS_PER_JOB:
        raise OptionsError(f"--max-length: at most {MAX_LENGTHS_PER_JOB} lengths in one job, got {len(max_lengths)}; "
                           "run the job again for the others")
    if ns.num_shards is not None and ns.num_shards < 1:
        raise OptionsError(f"--num-shards must be at least 1, got {ns.num_shards}")
    if not 0 < ns.target_shard_mb < float("inf"):  # also refuses nan, which no comparison passes
        raise OptionsError(f"--target-shard-mb must be a positive number of megabytes, got {ns.target_shard_mb}")
    if not 0.0 <= ns.max_bad_fraction <= 1.0:
        raise OptionsError(f"--max-bad-fraction must be within 0..1, got {ns.max_bad_fraction}")
    if ns.sub_buckets is not None and not 1 <= ns.sub_buckets <= MAX_SUB_BUCKETS:
        raise OptionsError(f"--sub-buckets must be between 1 and {MAX_SUB_BUCKETS}, got {ns.sub_buckets}")
    if ns.max_segments_per_row is not None and ns.max_segments_per_row < 1:
        raise OptionsError(f"--max-segments-per-row must be at least 1, got {ns.max_segments_per_row}")
    ns.window_context_tokens = window_context_option(ns.window_context_tokens, ns.overlong)


def window_context_option(text: str | None, overlong: str) -> int | None:
    """--window-context-tokens N: a whole number of at least 1, and only with --overlong window
    (`prepack pack` and `prepack preflight` share it). OptionsError (one line) otherwise."""
    if text is None:
        return None
    if overlong != OverlongPolicy.WINDOW.value:
        raise OptionsError(f"--window-context-tokens applies to --overlong window only (got --overlong {overlong}); "
                           "add --overlong window or leave it out")
    try:
        value = int(text, 10)
    except ValueError:
        value = 0
    if value < 1:
        raise OptionsError(f"--window-context-tokens must be a whole number of at least 1, got {text!r}")
    return value


def _check_run_behaviour(ns: argparse.Namespace) -> None:
    """The options that say how this run behaves, not what it writes."""
    if not MIN_EXPIRY_S <= ns.lock_expiry_s <= MAX_EXPIRY_S:
        raise OptionsError(f"--lock-expiry-s must be between {MIN_EXPIRY_S:g} and {MAX_EXPIRY_S:g} seconds, got {ns.lock_expiry_s:g}")
    if ns.batch_size < 1:
        raise OptionsError(f"--tokenize-batch-size must be at least 1, got {ns.batch_size}")


def _template_options(ns: argparse.Namespace, fmt: str) -> dict[str, str]:
    names = ("source_lang", "target_lang", "prompt_format")
    options = {name: getattr(ns, name) for name in names if getattr(ns, name) is not None}
    try:
        options.update(mapping_options(fmt, ns.columns, ns.roles))
    except ValueError as e:
        raise OptionsError(str(e)) from None
    return options


def _check_tokenizer(name: str) -> None:
    """A name that is no embedded tokenizer, file or folder is refused now, not after Hub retries."""
    from prepack.text.tokenizer import TokenizerError, TokenizerSpec

    try:
        TokenizerSpec.parse(name)
    except TokenizerError as e:
        raise OptionsError(f"--tokenizer: {e}") from None


def _requested(ns: argparse.Namespace, inputs: tuple[str, ...], template_options: dict[str, str]) -> dict[str, Any]:
    """--from-tokens: the token choices given on the command line, to check against the set's."""
    if not ns.from_tokens:
        return {}
    given = {"inputs": inputs, "format": ns.format, "chat_format": ns.chat_format, "tokenizer": ns.tokenizer,
             "train_reasoning": ns.train_reasoning, "expand_turns": ns.expand_turns,
             "template_options": tuple(sorted(template_options.items())) if template_options else None}
    return {k: v for k, v in given.items() if v}


def _row_spec(ns: argparse.Namespace, inputs: tuple[str, ...], fmt: str, mixture: Mixture | None,
              max_lengths: tuple[int, ...], template_options: dict[str, str], pack: bool) -> RowSpec:
    return RowSpec(
        inputs=inputs,
        format=fmt,
        template_options=tuple(sorted(template_options.items())),
        chat_format=ns.chat_format or "auto",
        tokenizer=ns.tokenizer or "gemma3",
        max_lengths=max_lengths,
        pack=pack,
        overlong=OverlongPolicy(ns.overlong),
        window_context_tokens=ns.window_context_tokens,
        planner=Planner(ns.planner),
        max_segments_per_row=ns.max_segments_per_row,
        num_shards=ns.num_shards,
        target_shard_mb=ns.target_shard_mb,
        max_bad_fraction=ns.max_bad_fraction,
        sub_buckets=ns.sub_buckets,
        tfds_data_dir=ns.tfds_data_dir,
        limits=InputLimits(ns.max_record_bytes, ns.max_decompressed_bytes, ns.max_compression_ratio, ns.max_whole_file_bytes),
        mixture=mixture,
        train_reasoning=(ns.train_reasoning or "yes") == "yes",
        expand_turns=ns.expand_turns,
    )


def _run_options(ns: argparse.Namespace, requested: dict[str, Any]) -> RunOptions:
    return RunOptions(
        output=ns.output.rstrip("/") if ns.output not in ("/",) else ns.output,
        overwrite=ns.overwrite,
        clean_stale=ns.clean_stale,
        lock_expiry_s=ns.lock_expiry_s,
        batch_size=ns.batch_size,
        progress=not ns.no_progress,
        verbose=ns.verbose,
        write_tokens=not ns.no_tokens and not ns.from_tokens,
        from_tokens=ns.from_tokens.rstrip("/") if ns.from_tokens else None,
        requested=tuple(sorted(requested.items())),
        allow_short_mix=ns.allow_short_mix,
        allow_untrained_eot=ns.allow_untrained_eot,
    )


def _refuse_multi_threading(beam_args: Sequence[str]) -> None:
    if flag_value(beam_args, "--direct_running_mode") == "multi_threading":
        raise OptionsError(
            "--direct_running_mode=multi_threading is not supported: Beam's embedded SDK worker loses elements under "
            "load (its timed 1 s output-buffer flush, TimeBasedBufferingClosableOutputStream, sends get() then _clear() "
            "while the bundle thread writes without _flush_lock; an upstream bug, see pipelines/README.md). "
            "Use multi_processing (the default) or in_memory"
        )


def runner_path(name: str) -> str:
    """The dotted class path Beam would load for --runner NAME (as apache_beam.runners.runner.create_runner
    resolves it: a dotted path as is, else a known runner's class name, case-insensitive, "Runner" optional)."""
    if "." in name:
        return name
    known = {path.rsplit(".", 1)[-1].lower(): path for paths in SUPPORTED_RUNNERS.values() for path in paths[:1]}
    return known.get(name.lower(), known.get(name.lower() + "runner", name))


def check_runner(beam_args: Sequence[str], allow_untested: bool) -> None:
    """Refuses a --runner this job is not built and tested on, unless allow_untested."""
    name = flag_value(beam_args, "--runner")
    if name is None or allow_untested:
        return
    path = runner_path(name)
    if not any(path in paths for paths in SUPPORTED_RUNNERS.values()):
        raise OptionsError(f"--runner {name}: this job is tested only on {' and '.join(SUPPORTED_RUNNERS)} "
                           "(the default, no --runner, is the local FnApiRunner); pass --allow-untested-runner to try it anyway")


class _RefusingParser(argparse.ArgumentParser):
    """Beam's option parser, raising OptionsError instead of exiting."""

    def error(self, message: str):  # type: ignore[override]
        raise OptionsError(f"Beam option: {message}")


def _beam_parser(beam_args: Sequence[str]) -> argparse.ArgumentParser:
    from apache_beam.options import pipeline_options as po

    runner = flag_value(beam_args, "--runner")
    if runner and "." in runner_path(runner):
        # An untested runner's own options are defined in its module: import it to know them.
        try:
            importlib.import_module(runner_path(runner).rsplit(".", 1)[0])
        except ImportError:
            pass
    parser_class = type("_BeamRefusingParser", (_RefusingParser, po._BeamArgumentParser), {})
    parser = parser_class(allow_abbrev=False, add_help=False)
    seen: dict[str, type] = {}
    for cls in po.PipelineOptions.__subclasses__():  # what PipelineOptions.get_all_options parses with
        seen.setdefault(str(cls), cls)
    for cls in seen.values():
        cls._add_argparse_args(parser)
    return parser


def check_beam_args(beam_args: Sequence[str], own_options: Sequence[str]) -> None:
    """Refuses any argument that neither `prepack pack` nor Beam's PipelineOptions knows, before any
    work: Beam would only warn "Discarding unparseable args" and the job would run on defaults."""
    if not beam_args:
        return
    parser = _beam_parser(beam_args)
    _, unknown = parser.parse_known_args(list(beam_args))
    if not unknown:
        return
    flags = [a for a in unknown if a.startswith("-")]
    if not flags:
        raise OptionsError(f"unexpected argument {unknown[0]!r}: every value follows its option (e.g. --input FILE)")
    name = flags[0].split("=", 1)[0]
    close = closest_option(name, list(own_options) + long_options(parser))
    hint = f"; did you mean {close}?" if close else "; see prepack pack --help"
    raise OptionsError(f"unknown option {name} (neither prepack pack nor Beam knows it){hint}")


def _lengths(values: Sequence[str], default: tuple[int, ...] = DEFAULT_MAX_LENGTHS) -> tuple[int, ...]:
    """The --max-length values, sorted and unique; OptionsError (one line) unless each is a whole
    number from 2 to MAX_MAX_LENGTH: 2^31, 2^63 or 1e20 would make workers grow without end."""
    lengths = set()
    for text in values:
        try:
            lengths.add(int(text, 10))
        except ValueError:
            raise OptionsError(f"--max-length must be a whole number from 2 to {MAX_MAX_LENGTH:,}, got {text!r}") from None
    max_lengths = tuple(sorted(lengths)) or tuple(default)
    if any(L < 2 for L in max_lengths):
        raise OptionsError(f"--max-length must be at least 2, got {min(max_lengths)}")
    if any(L > MAX_MAX_LENGTH for L in max_lengths):
        raise OptionsError(f"--max-length must be at most {MAX_MAX_LENGTH:,} (a row is then 20 MiB), got {max(max_lengths):,}")
    return max_lengths


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of a Beam option given as `--flag=VALUE` or `--flag VALUE`, if present."""
    for i, a in enumerate(args):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag and i + 1 < len(args):
            return args[i + 1]
    return None


def with_default_runner(beam_args: Sequence[str]) -> list[str]:
    """Adds FnApiRunner multi-processing unless a runner is named; a local mode or worker
    count the user gives is kept. The job chooses the worker count from the input size
    (local_memory.with_local_workers)."""
    args = list(beam_args)
    given = {a.split("=")[0] for a in args}
    if "--runner" in given:
        return args
    extra = ["--runner=FnApiRunner"]
    if "--direct_running_mode" not in given:
        extra.append("--direct_running_mode=multi_processing")
    return extra + args


def mapping_options(fmt: str, columns: str | None, roles: str | None) -> dict[str, str]:
    """--columns and --roles as a format's options, in their canonical text (sorted pairs, as
    manifests record them), checked against the format (all formats' names for auto). ValueError
    (one line) for a malformed or unknown name."""
    from prepack.text.formats import ResolvedFormat, template_class
    from prepack.text.formats.fields import RoleMap, mapping_text, parse_mapping

    options: dict[str, str] = {}
    if columns is not None:
        canonical = sorted({c for name in FORMAT_NAMES for c in template_class(name).COLUMNS})
        options["columns"] = mapping_text(parse_mapping(columns, "--columns", canonical))
    if roles is not None:
        options["roles"] = mapping_text(parse_mapping(roles, "--roles", ("system", "user", "assistant", "tool_call", "tool"),
                                                      repeatable=True))
        RoleMap(options["roles"])
    if fmt and fmt not in ("auto", "mixture") and options:
        ResolvedFormat.checked(fmt, options)  # this format's own names (and whether it takes roles)
    return options
