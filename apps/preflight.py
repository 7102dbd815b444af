"""`prepack preflight`: will packing pay off for this dataset, max length and batch size?

Answers from the tokenizer alone, before any model loads: read each input,
apply its template and chat format, tokenize, then for every max length L fit
the examples by the overlong rule and plan the rows from the length histogram,
and for every batch size B work out rows, steps and densities with
`prepack.packing.stats`. Each step is the job's own function, run in this process
without Beam: read (pipelines.inputs.sources, pipelines.inputs.readers), prepare
(pipelines.preparer.Preparer), fit (prepack.packing.fitting.fit_length, as
the fit stage runs it), plan (prepack.packing.packer.HistogramPlan, as PlanFn runs
it), all under the RowSpec `prepack pack` takes.

Throughput model (also written into preflight.json): training runs fixed
[B, L] batches, so a step costs the same whether its rows are packed or not;
rows fill ceil(rows / B) steps, the last one padded with empty rows. The
expected gain in useful-token (target-token) throughput is then packed target
tokens per step over unpacked target tokens per step (stats.BatchFigures).

Inputs take the same specs as `prepack pack` and go through the job's own read
and prepare stages (pipelines.inputs.sources, pipelines.inputs.readers, pipelines.preparer.Preparer),
run in this process: the same records, examples and bad-record reasons.

Tokenizing runs in this process, which suits inputs up to a few million
examples (about 2M tokens/s per core). For larger ones, `--max-examples N`
estimates from a seeded uniform sample of N examples per dataset; the exact
figures at any scale come from `prepack pack` (parallel, Dataflow-ready, with
and without --no-pack) followed by `prepack report --shards`, which renders the
same table from the published manifests.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import os
import random
import sys
import time
from collections import Counter
from fractions import Fraction
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from apps import read_inputs
from apps.packing_table import CSV_COLUMNS, THROUGHPUT_MODEL, render_text_table, result_row
from apps.report import find_manifests, manifest_rows
from pipelines.configs import PackConfig, RowSpec
from pipelines.options import OptionsError, add_row_options, mapping_options, parse_run_args, row_spec
from prepack.packing.accounting import LENGTH_REASONS, Tally
from prepack.packing.bad_records import too_many_bad_records
from prepack.cli_help import EXIT_REFUSED, CommandParser, closest_option, long_options
from prepack.storage import new_file
from prepack.text.formats import Template, template_names
from prepack.packing.fitting import fit_length
from prepack.packing.packer import DropReason, Fit, HistogramPlan, OverlongPolicy, Planner
from prepack.packing.stats import REFERENCE_BATCH_SIZE, PackingStats, stats_from_rows

DEFAULT_MAX_LENGTHS = (256, 512, 1024, 2048)
DEFAULT_BATCH_SIZES = (REFERENCE_BATCH_SIZE,)  # the batch size the pack summary plans for, too
TOKENIZE_BATCH = 512  # conversations per encode_batch call: big enough to amortize, small enough to retry

class PreflightError(read_inputs.InputsError):
    """Bad input or options: printed as one line, exit status 2."""


# ----------------------------------------------------------------------------- configuration


@dataclasses.dataclass(frozen=True)
class DatasetSpec:
    name: str
    path: str
    format: str  # a template name (prepack.text.formats)
    options: tuple[tuple[str, str], ...] = ()  # a mixture source's own template options (over --template-option)
    source: str = ""  # --mixture: the source this input belongs to




@dataclasses.dataclass(frozen=True)
class PreflightConfig:
    datasets: tuple[DatasetSpec, ...]
    output: str
    # What makes the rows, as `prepack pack` takes it (pipelines.configs.RowSpec): the tokenizer,
    # chat format, lengths, overlong rule, planner, cap, template options, bad fraction. Its
    # inputs and mixture are the datasets': --mixture's file, or each dataset a source of its own,
    # which no set records (shown side by side, not mixed).
    rows: RowSpec = RowSpec(inputs=(), format="", max_lengths=DEFAULT_MAX_LENGTHS)
    batch_sizes: tuple[int, ...] = DEFAULT_BATCH_SIZES
    max_examples: int | None = None  # None: every example
    seed: int = 0
    plots: bool = True
    pack_output: str | None = None  # set: run the Beam job per dataset into this folder and read its manifests

    def __post_init__(self) -> None:
        from prepack.packing.mixture import Mixture, MixtureSource

        if self.rows.mixture.recorded:
            return
        side_by_side = Mixture("", "", "examples", 1, tuple(MixtureSource(i, d.name, (d.path,), d.format, Fraction(1), d.options)
                                                           for i, d in enumerate(self.datasets, start=1)))
        object.__setattr__(self, "rows", dataclasses.replace(self.rows, inputs=tuple(d.path for d in self.datasets),
                                                             mixture=side_by_side))


# ----------------------------------------------------------------------------- tokenized examples


@dataclasses.dataclass
class ExampleSet:
    """One dataset after template and tokenizer: what the estimate needs, no token ids.

    Per example only its length and target count are kept, plus the loss mask of
    the examples longer than the smallest max length: truncation changes their
    target count, and whether any target survives, in a way lengths cannot tell.
    Target counts start at each example's second token, because the row builder
    zeroes a segment's first-token loss.
    """

    name: str
    lengths: np.ndarray  # int64 tokens per example
    targets: np.ndarray  # int64 target tokens per example, as they land in a row
    overlong_masks: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)  # example index -> loss mask
    # A preference set's pair bounds (prompt, split) of the examples in overlong_masks: a pair is cut by
    # the pair rule (prepack/packing/pairs.py), not as a prefix.
    overlong_pairs: dict[int, np.ndarray] = dataclasses.field(default_factory=dict)
    input: str = ""
    format: str = ""
    records_read: int = 0
    bad_records: Counter = dataclasses.field(default_factory=Counter)  # reason -> count
    examples_seen: int = 0  # before sampling; equals len(lengths) when not sampled
    tokenize_seconds: float = 0.0

    def __post_init__(self) -> None:
        if not self.examples_seen:
            self.examples_seen = len(self.lengths)

    @classmethod
    def from_masks(cls, name: str, masks: Iterable[Sequence[int]], keep_over: int = 0, **meta: Any) -> "ExampleSet":
        collector = _Collector(keep_over)
        collector.add(np.asarray(m, dtype=np.uint8) for m in masks)
        return collector.build(name, **meta)

    @property
    def sampled(self) -> bool:
        return self.examples_seen > len(self.lengths)

    def length_histogram(self) -> dict[int, int]:
        values, counts = np.unique(self.lengths, return_counts=True)
        return {int(v): int(c) for v, c in zip(values, counts)}


class _Collector:
    """Accumulates loss masks batch by batch into an ExampleSet's compact form."""

    def __init__(self, keep_over: int):
        self.keep_over = keep_over
        self.lengths: list[int] = []
        self.targets: list[int] = []
        self.masks: dict[int, np.ndarray] = {}
        self.pairs: dict[int, np.ndarray] = {}

    def add(self, masks: Iterable[np.ndarray | tuple[np.ndarray, np.ndarray]]) -> None:
        """Each example's loss mask, or a pair's (mask, bounds)."""
        for item in masks:
            mask, bounds = item if isinstance(item, tuple) else (item, None)
            if len(mask) > self.keep_over:
                self.masks[len(self.lengths)] = np.array(mask, dtype=np.uint8)  # a copy: frees the batch buffer
                if bounds is not None:
                    self.pairs[len(self.lengths)] = np.array(bounds)
            self.lengths.append(len(mask))
            self.targets.append(int(np.count_nonzero(mask[1:])))

    def __len__(self) -> int:
        return len(self.lengths)

    def build(self, name: str, **meta: Any) -> ExampleSet:
        return ExampleSet(name, np.array(self.lengths, dtype=np.int64), np.array(self.targets, dtype=np.int64),
                          self.masks, self.pairs, **meta)


@dataclasses.dataclass(frozen=True)
class Fitted:
    """One dataset at one max length after the overlong rule: what the job's fit stage keeps and
    counts (stats.examples_split, split_pieces, examples_windowed, window_pieces,
    context_tokens_replayed, examples_dropped by reason)."""

    kept_lengths: np.ndarray  # int64, the examples and pieces that reach a row
    kept_targets: np.ndarray  # int64, their target counts as they land in a row
    dropped: dict[str, int]  # DropReason value -> count (pieces, for the piece reasons)
    truncated: int = 0
    split: int = 0  # examples cut into pieces (--overlong split)
    pieces: int = 0  # the pieces they were cut into, kept or not
    windowed: int = 0  # examples cut into pieces (--overlong window)
    window_pieces: int = 0  # their pieces, kept or not
    context_replayed: int = 0  # the context tokens the kept window pieces start with


@dataclasses.dataclass(frozen=True)
class LengthResult:
    """One dataset at one max length: what survives the overlong policy, and the plan's stats."""

    max_length: int
    fitted: Fitted
    stats: PackingStats
    bfd_rows: int = 0

    @property
    def kept_lengths(self) -> np.ndarray:
        return self.fitted.kept_lengths


def fit_examples(examples: ExampleSet, max_length: int, overlong: OverlongPolicy,
                 window_context: int | None = None) -> Fitted:
    """The overlong rule as the job's fit stage applies it (prepack.packing.fitting.fit_length: the
    rule and, under --overlong split or window, the cut): an example longer than L gives way to
    its kept pieces. window_context: --window-context-tokens (None: L // 4)."""
    lengths, targets = examples.lengths.copy(), examples.targets.copy()
    missing = [int(i) for i in np.flatnonzero(lengths > max_length) if int(i) not in examples.overlong_masks]
    if missing:
        raise ValueError(f"{examples.name}: example {missing[0]} is longer than {max_length} but its loss mask was not kept")
    mask_of = examples.overlong_masks.__getitem__
    within = None
    if examples.overlong_pairs and overlong is OverlongPolicy.TRUNCATE:  # pairs: each side's targets after the cut
        from prepack.packing.pairs import targets_after_first as pair_targets

        over = [int(i) for i in np.flatnonzero(lengths > max_length)]
        within = np.zeros(len(lengths), np.int64)
        if over:
            within[over] = pair_targets(lengths[over], np.concatenate([mask_of(i) for i in over]),
                                        np.stack([examples.overlong_pairs[i] for i in over]), max_length)
    result = fit_length(lengths, mask_of, max_length, overlong, window_context, within)
    truncated = np.flatnonzero(result.fit == Fit.TRUNCATED)
    lengths[truncated] = max_length
    if len(truncated):
        targets[truncated] = result.targets_within[truncated]
    pieces = [(j, p) for j, cut in sorted(result.cuts.items()) for p, reason in cut if reason is None]
    piece_lengths = np.asarray([p.length for _, p in pieces], dtype=np.int64)
    piece_targets = np.asarray([np.count_nonzero(p.loss_mask(mask_of(j))[1:]) for j, p in pieces], dtype=np.int64)
    counts = result.counts()
    return Fitted(np.concatenate([lengths[result.kept], piece_lengths]), np.concatenate([targets[result.kept], piece_targets]),
                  counts.dropped, counts.truncated, split=counts.split, pieces=counts.split_pieces,
                  windowed=counts.windowed, window_pieces=counts.window_pieces, context_replayed=counts.context_replayed)


def evaluate_length(examples: ExampleSet, max_length: int, overlong: OverlongPolicy,
                    planner: Planner = Planner.BEST, max_segments: int | None = None,
                    window_context: int | None = None) -> LengthResult:
    """One max length planned as the job plans it: the same overlong rule, planner and cap."""
    fitted = fit_examples(examples, max_length, overlong, window_context)
    values, counts = np.unique(fitted.kept_lengths, return_counts=True)
    plan = HistogramPlan({int(v): int(c) for v, c in zip(values, counts)}, max_length, planner, max_segments)
    stats = stats_from_rows(plan.rows(), max_length, int(fitted.kept_targets.sum()), max_segments)
    return LengthResult(max_length, fitted, stats, plan.bfd_rows)


def _quantiles(lengths: np.ndarray) -> dict[str, float]:
    # numpy's default (linear interpolation) percentiles; zeros for an empty set.
    if not len(lengths):
        return {"mean_tokens": 0.0, "median_tokens": 0.0, "p95_tokens": 0.0, "max_tokens": 0}
    return {
        "mean_tokens": float(np.mean(lengths)),
        "median_tokens": float(np.median(lengths)),
        "p95_tokens": float(np.percentile(lengths, 95)),
        "max_tokens": int(np.max(lengths)),
    }


def evaluate(examples: ExampleSet, config: PreflightConfig, tokenizer_name: str = "", chat_format_name: str = "") -> list[dict[str, Any]]:
    """Rows for one dataset: one per max length x batch size, in that order."""
    rows = []
    for max_length in config.rows.max_lengths:
        result = evaluate_length(examples, max_length, config.rows.overlong, config.rows.planner, config.rows.max_segments_per_row,
                                 config.rows.window_context_tokens)
        fitted = result.fitted
        dropped = sum(fitted.dropped.values())
        # What --overlong truncate would keep of the examples dropped as too long: only those with
        # a target within the first max_length tokens (the others have nothing left to train on).
        truncate_keeps = None
        if config.rows.overlong is OverlongPolicy.DROP and fitted.dropped.get(DropReason.TOO_LONG.value, 0):
            truncate_keeps = (len(fit_examples(examples, max_length, OverlongPolicy.TRUNCATE).kept_lengths)
                              - len(fitted.kept_lengths))
        meta = {
            "dataset": examples.name,
            "input": examples.input,
            "format": examples.format,
            "tokenizer": tokenizer_name,
            "chat_format": chat_format_name,
            "overlong": config.rows.overlong.value,
            "planner": config.rows.planner.value,
            "max_segments_per_row": config.rows.max_segments_per_row,
            "bfd_rows": result.bfd_rows,
            "examples_split": fitted.split,
            "split_pieces": fitted.pieces,
            "dropped_no_targets_after_split": fitted.dropped.get(DropReason.NO_TARGETS_AFTER_SPLIT.value, 0),
            "examples_windowed": fitted.windowed,
            "window_pieces": fitted.window_pieces,
            "context_tokens_replayed": fitted.context_replayed,
            "dropped_window_context_too_long": fitted.dropped.get(DropReason.WINDOW_CONTEXT_TOO_LONG.value, 0),
            "records_read": examples.records_read,
            "bad_records": sum(examples.bad_records.values()),
            "examples": len(examples.lengths),
            "examples_dropped": dropped,
            "dropped_too_long": fitted.dropped.get(DropReason.TOO_LONG.value, 0),
            "dropped_no_targets_after_truncation": fitted.dropped.get(DropReason.NO_TARGETS_AFTER_TRUNCATION.value, 0),
            "examples_truncated": fitted.truncated,
            "truncate_would_keep": truncate_keeps,
            **_quantiles(result.kept_lengths),
        }
        for batch_size in config.batch_sizes:
            rows.append(result_row(meta, result.stats, batch_size))
    return rows


# ----------------------------------------------------------------------------- reading inputs
# The job's own read and prepare stages (pipelines.inputs.readers, pipelines.preparer.Preparer), run in
# this process: the same specs, the same records, examples and bad-record reasons as `prepack pack`.


def _pipelines() -> Any:
    return read_inputs.pipeline_modules()


def read_tasks(spec: str, rows: RowSpec) -> tuple[list[Any], list[Any]]:
    """(TaskMetas, ReadTasks) of one --input, as the job plans them; PreflightError if unreadable."""
    return read_inputs.read_tasks(spec, rows.tfds_data_dir)


def check_input(spec: str, rows: RowSpec) -> None:
    """Raises PreflightError if the input cannot be read: before the tokenizer loads."""
    read_tasks(spec, rows)


def _templated(preparer: Any, metas: list[Any], tasks: list[Any], tally: Tally, rows: RowSpec,
               progress: Any = None) -> Iterator[Any]:
    """(conv, response, meta) of every example, through the job's prepare stage (apps/read_inputs.py);
    bad records are tallied by reason as the job does (their dead letters are not kept)."""
    return read_inputs.templated(preparer, metas, tasks, tally, rows.limits, progress)


# ----------------------------------------------------------------------------- template + tokenizer


class _Reservoir:
    """Seeded uniform sample of at most `size` items (Algorithm R), returned in input order."""

    def __init__(self, size: int | None, seed: int):
        self.size, self.seen, self._rng = size, 0, random.Random(seed)
        self._items: list[tuple[int, Any]] = []

    def add(self, item: Any) -> None:
        self.seen += 1
        if self.size is None or len(self._items) < self.size:
            self._items.append((self.seen, item))
            return
        j = self._rng.randrange(self.seen)
        if j < self.size:
            self._items[j] = (self.seen, item)

    def items(self) -> list[Any]:
        return [item for _, item in sorted(self._items, key=lambda pair: pair[0])]


def _loss_masks(batches: Iterable[Any]) -> Iterator[np.ndarray | tuple[np.ndarray, np.ndarray]]:
    """Each example's loss mask (with a pair's bounds, in a preference set)."""
    for batch in batches:
        examples = batch.examples
        masks = np.split(examples.mask, np.cumsum(examples.lens, dtype=np.int64)[:-1])
        yield from (masks if examples.pair_bounds is None else zip(masks, examples.pair_bounds))


PROGRESS_EVERY_S = 10.0  # a progress line at most this often (pipelines/progress.py), none in shorter runs


def load_examples(spec: DatasetSpec, tokenizer: Any, chat_format: Any, config: PreflightConfig) -> ExampleSet:
    """Reads, templates and tokenizes one dataset (all of it, or a seeded sample of --max-examples)."""
    prepare, _, _ = _pipelines()
    metas, tasks = read_tasks(spec.path, config.rows)
    template = make_template(spec.format, {**config.rows.template_kwargs, **dict(spec.options)})
    preparer = prepare.Preparer(metas, template, tokenizer, chat_format, expand_turns=config.rows.expand_turns)
    from pipelines.progress import counter

    tally = Tally()
    started = time.perf_counter()
    # Reading runs ahead of tokenizing when sampling, or for a table-level format (oasst1): report it too.
    reads_ahead = config.max_examples is not None or template.table_level
    reading = counter(f"preflight: {spec.name}: read", "records", PROGRESS_EVERY_S) if reads_ahead else None
    items: Iterable[Any] = _templated(preparer, metas, tasks, tally, config.rows, reading)
    seen = None
    if config.max_examples is not None:
        reservoir = _Reservoir(config.max_examples, config.seed)
        for item in items:
            reservoir.add(item)
        items, seen = reservoir.items(), reservoir.seen
    collector = _Collector(keep_over=min(config.rows.max_lengths))
    tokenizing = counter(f"preflight: {spec.name}: tokenized", "examples", PROGRESS_EVERY_S)
    for chunk in read_inputs.batches(items, TOKENIZE_BATCH):
        collector.add(_loss_masks(preparer.tokenize(prepare.Templated.of(chunk), tally, [])))
        tokenizing.update(len(collector) - tokenizing.n)
    for bar in (reading, tokenizing):
        if bar is not None:
            bar.close()
    bad_records = tally.bad_records + tally.bad_examples
    problem = too_many_bad_records(sum(bad_records.values()), (seen if seen is not None else len(collector))
                                   + sum(bad_records.values()), bad_records, config.rows.max_bad_fraction)
    if problem:
        raise PreflightError(f"{spec.name}: {problem}. Fix the inputs (is --format {spec.format} right?), "
                             "or raise --max-bad-fraction to skip them")
    return collector.build(
        spec.name,
        input=spec.path,
        format=spec.format,
        records_read=tally.records_read,
        bad_records=bad_records,
        examples_seen=seen if seen is not None else len(collector),
        tokenize_seconds=time.perf_counter() - started,
    )


def checked_format(spec: DatasetSpec, config: PreflightConfig) -> DatasetSpec:
    """The dataset's format looked at on its first records, as `prepack pack` does
    (pipelines/launch/format_check.py): auto resolved and said, a format the records do not fit
    refused in one line."""
    options = {**config.rows.template_kwargs, **dict(spec.options)}
    fmt, note = read_inputs.checked_format(spec.path, spec.format, options, config.rows.limits, f"{spec.name}: ",
                                           config.rows.tfds_data_dir)
    if note:
        print(f"prepack preflight: {note}", file=sys.stderr)
    return dataclasses.replace(spec, format=fmt)


def make_template(name: str, options: dict[str, str]) -> Template:
    """The template for a --format; --template-option values go only to templates that take them,
    so one `source_lang=de` can sit beside alpaca inputs."""
    return read_inputs.make_template(name, options)


# ----------------------------------------------------------------------------- run and write


def run(config: PreflightConfig, loader: Callable[[DatasetSpec], ExampleSet], tokenizer_name: str = "", chat_format_name: str = "") -> dict[str, Any]:
    """Loads every dataset with `loader` and evaluates it; returns what preflight.json holds."""
    datasets, rows = [], []
    datasets_by_name: dict[str, tuple[DatasetSpec, ExampleSet]] = {}
    for spec in config.datasets:
        examples = loader(spec)
        datasets_by_name[spec.name] = (spec, examples)
        rows.extend(evaluate(examples, config, tokenizer_name, chat_format_name))
        all_lengths = _quantiles(examples.lengths)
        datasets.append(
            {
                "name": examples.name,
                "input": examples.input,
                "format": examples.format,
                "records_read": examples.records_read,
                "bad_records": dict(sorted(examples.bad_records.items())),
                "examples_seen": examples.examples_seen,
                "examples": len(examples.lengths),
                "sampled": examples.sampled,
                "tokens": int(examples.lengths.sum()),
                "target_tokens": int(examples.targets.sum()),
                "tokens_per_example": all_lengths,
                "tokenize_seconds": round(examples.tokenize_seconds, 3),
                "length_histogram": {str(k): v for k, v in examples.length_histogram().items()},
            }
        )
    mix = mixture_rows(config, datasets_by_name)
    return {
        "tool": "prepack preflight",
        **({"mixture": {**config.rows.mixture.describe(), "rows": mix}} if config.rows.mixture.recorded else {}),
        "config": {
            "tokenizer": config.rows.tokenizer,
            "chat_format": config.rows.chat_format,
            "max_lengths": list(config.rows.max_lengths),
            "batch_sizes": list(config.batch_sizes),
            "overlong": config.rows.overlong.value,
            "window_context_tokens": config.rows.window_context_tokens,
            "planner": config.rows.planner.value,
            "max_segments_per_row": config.rows.max_segments_per_row,
            "template_options": dict(config.rows.template_kwargs),
            "max_examples": config.max_examples,
            "seed": config.seed,
            "pack_output": config.pack_output,
        },
        "throughput_model": THROUGHPUT_MODEL,
        "packing": f"the job's planner over the length histogram (prepack.packing.packer.HistogramPlan, --planner "
                   f"{config.rows.planner.value})",
        "datasets": datasets,
        "rows": rows,
    }


def mixture_rows(config: PreflightConfig, loaded: dict[str, tuple[DatasetSpec, ExampleSet]]) -> list[dict[str, Any]]:
    """The per-source table at every L: kept sizes under the overlong rule, then the share rule's
    budgets (prepack.packing.mixture.preview); the realized mix before anything is packed. None
    for datasets shown side by side (no mixture file): nothing is mixed."""
    from prepack.packing.mixture import preview

    if not config.rows.mixture.recorded:
        return []
    out = []
    for L in config.rows.max_lengths:
        examples, targets = [], []
        for source in config.rows.mixture.sources:
            n = t = 0
            for spec, ex in loaded.values():
                if spec.source == source.name:
                    fitted = fit_examples(ex, L, config.rows.overlong, config.rows.window_context_tokens)
                    n, t = n + len(fitted.kept_lengths), t + int(fitted.kept_targets.sum())
            examples.append(n)
            targets.append(t)
        if not all(examples):
            empty = config.rows.mixture.sources[examples.index(0)].name
            raise PreflightError(f"mixture source {empty!r} has no usable examples at max length {L}; check its input and format")
        out += preview(config.rows.mixture, examples, targets, L)
    return out


def render_mixture_table(rows: Sequence[dict[str, Any]], weight_of: str) -> str:
    head = f"{'L':>6}  {'source':<16} {'kept':>9} {'kept ' + weight_of:>22} {'asked':>7} {'mix':>7} {'repeats':>8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(f"{r['max_length']:>6}  {r['source']:<16} {r['kept_examples']:>9,} {r['kept_weight']:>22,} "
                     f"{r['requested_share']:>7.1%} {r['realized_share']:>7.1%} {r['repeats']:>7.2f}x"
                     + ("  (limits the mix)" if r["limiting"] else ""))
    return "\n".join(lines)


_PACK_TEMPLATE_OPTIONS = ("source_lang", "target_lang", "prompt_format")  # what `prepack pack`'s templates take


def run_with_pipeline(config: PreflightConfig, run_args: Sequence[str], overwrite: bool = False) -> dict[str, Any]:
    """The same result as `run`, from the Beam job: one `prepack pack` per dataset, then its manifests.

    Each job runs the RowSpec preflight evaluated (one dataset's inputs and format), no command
    line rebuilt; run_args: the run options and Beam's (pipelines.options.parse_run_args).
    Bad records up to --max-bad-fraction are counted, not fatal, as in-process. Manifests carry
    no length histogram, so the median/p95 columns and the histogram plot are left out.
    """
    try:
        from pipelines.launch import cli as pack_cli
    except ImportError as e:
        raise PreflightError(f"--pack-output needs the pipeline extra ({e}); pip install 'tunix-prepack[pipeline]'") from e
    unknown = sorted(set(config.rows.template_kwargs) - set(_PACK_TEMPLATE_OPTIONS))
    if unknown:
        raise PreflightError(f"--pack-output: `prepack pack` takes no template option {', '.join(unknown)}")
    try:
        own = [o for action in _parser()._actions for o in action.option_strings if o.startswith("--")]
        run_options, beam_args = parse_run_args(run_args, output="", overwrite=overwrite, own_options=own)
    except OptionsError as e:
        raise PreflightError(f"--pack-output: {e}") from None
    rows, datasets = [], []
    for spec in config.datasets:
        out = os.path.join(config.pack_output, spec.name)
        started = time.perf_counter()
        code = pack_cli.run_config(PackConfig(dataset_rows(config, spec), dataclasses.replace(run_options, output=out)),
                                   beam_args)
        if code != 0:
            raise PreflightError(f"{spec.name}: `prepack pack` failed (exit {code}); see its message above")
        found = find_manifests(out)
        for folder, manifest in found:
            more, warnings = manifest_rows(spec.name, folder, manifest, config.batch_sizes, given=spec.path)
            for row in more:
                row.pop("dropped_by_reason", None)
                row.pop("packing", None)
                row["overlong"] = config.rows.overlong.value
                row["planner"] = config.rows.planner.value
                row["max_segments_per_row"] = config.rows.max_segments_per_row
            rows += more
            for w in warnings:
                print("warning: " + w, file=sys.stderr)
        stats = found[0][1].stats
        datasets.append({
            "name": spec.name, "input": spec.path, "format": spec.format, "shards": out,
            "records_read": stats.get("records_read", stats.get("examples_read")),
            "bad_records": {k: v for k, v in stats.get("examples_dropped", {}).items() if k not in LENGTH_REASONS},
            "examples": stats.get("examples_read"), "examples_seen": stats.get("examples_read"), "sampled": False,
            "pack_seconds": round(time.perf_counter() - started, 3), "length_histogram": {},
        })
    result = run(dataclasses.replace(config, datasets=()), lambda spec: None)  # the header fields, no datasets
    result.update(datasets=datasets, rows=rows, packing="global BFD by the Beam job (`prepack pack`); figures from its manifests")
    return result


def dataset_rows(config: PreflightConfig, spec: DatasetSpec) -> RowSpec:
    """The RowSpec of one dataset as preflight evaluates it: the command's, with this dataset's
    inputs, format and template options (its one source, as a plain `prepack pack` run)."""
    return dataclasses.replace(config.rows, inputs=(spec.path,), format=spec.format,
                               template_options=tuple(sorted({**config.rows.template_kwargs, **dict(spec.options)}.items())),
                               mixture=None)


def write_outputs(result: dict[str, Any], output: str, plots: bool = True) -> list[str]:
    """preflight.csv, preflight.json and the PNG plots; returns the paths written."""
    os.makedirs(output, exist_ok=True)
    # Each file new, renamed over the old one (prepack/storage/new_file.py): an old output that is
    # another name of the input data (a hard link) keeps the data's bytes.
    csv_path = os.path.join(output, "preflight.csv")
    with new_file.new_file(csv_path, "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(CSV_COLUMNS), extrasaction="ignore")
        writer.writeheader()
        for row in result["rows"]:
            writer.writerow({k: _csv_value(v) for k, v in row.items()})
    json_path = os.path.join(output, "preflight.json")
    new_file.write_bytes(json_path, (json.dumps(result, indent=2) + "\n").encode("utf-8"))
    written = [csv_path, json_path]
    if plots:
        from apps import plots as plotting  # lazy: matplotlib only when plots are asked for

        histograms = {d["name"]: {int(k): v for k, v in d["length_histogram"].items()} for d in result["datasets"]}
        written += plotting.preflight_plots(result["rows"], histograms, result["config"]["max_lengths"], output)
        if "mixture" in result:
            written.append(plotting.mixture_shares(result["mixture"]["rows"], result["mixture"]["weight_of"],
                                                   os.path.join(output, "mixture.png")))
    return written


def _csv_value(value: Any) -> Any:
    # Enough digits to recompute the table, few enough to read.
    return round(value, 6) if isinstance(value, float) else value


# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(  # no abbreviations: with --pack-output a Beam flag must never be taken for one of ours
        prog="prepack preflight",
        description="Estimate packing gains from the tokenizer alone: per dataset x max length x batch size, "
        "densities, rows, steps and the expected target-token throughput gain. In-process; for very large inputs "
        "use --max-examples, or `prepack pack` then `prepack report --shards`.",
    )
    p.add_argument("--mixture", metavar="FILE",
                   help="a `prepack pack --mixture` file: its sources are the datasets, and the realized mix is shown "
                        "per max length (instead of --input and --format)")
    p.add_argument("--allow-local-inputs", action="store_true",
                   help="a --mixture file on gs:// may name local paths (refused by default: a file in a bucket others "
                        "can write would make preflight read this machine's files)")
    p.add_argument("--input", action="extend", nargs="+", metavar="[NAME=]PATH",
                   help="a dataset: JSONL, JSON or Parquet file, or a glob; repeatable, each is its own dataset")
    p.add_argument("--format", "--template", dest="format", action="extend", nargs="+", metavar="FORMAT",
                   help=f"source format (template) of the inputs: {', '.join(template_names())}, or auto (chosen from "
                   "the first records' keys, as `prepack pack --format auto`); one for all, or one per --input in order")
    p.add_argument("--batch-size", action="extend", nargs="+", type=int, metavar="B",
                   help=f"batch sizes (default: {' '.join(map(str, DEFAULT_BATCH_SIZES))})")
    p.add_argument("--template-option", action="append", default=[], metavar="KEY=VALUE",
                   help="template option, e.g. source_lang=de (given only to formats that take it)")
    p.add_argument("--max-examples", type=int, default=None, metavar="N",
                   help="estimate from a seeded uniform sample of N examples per dataset (default: all)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--output", required=True, metavar="DIR", help="folder for preflight.csv, preflight.json and plots")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an earlier preflight's files in --output (and, with --pack-output, its shard sets)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots (no matplotlib needed)")
    p.add_argument("--pack-output", metavar="DIR",
                   help="large inputs: run the Beam job (`prepack pack`) per dataset into DIR/NAME/L*/ and take the "
                        "figures from its manifests; options preflight does not know go to the job and Beam "
                        "(e.g. --runner=DataflowRunner --project=...), and the shards stay usable for training")
    # What makes the rows: `prepack pack`'s own options, one definition (the same spellings and checks).
    add_row_options(p, DEFAULT_MAX_LENGTHS)
    return p


def _mixture_datasets(path: str, allow_local_inputs: bool = False) -> tuple[Any, list[DatasetSpec]]:
    from prepack.mixture_file import load_mixture
    from prepack.packing.mixture import MixtureError

    try:
        mixture = load_mixture(path, allow_local_inputs)
    except MixtureError as e:
        raise PreflightError(str(e)) from None
    datasets = []
    for source in mixture.sources:
        for k, spec in enumerate(source.inputs):
            name = source.name if len(source.inputs) == 1 else f"{source.name}#{k + 1}"
            datasets.append(DatasetSpec(name, spec, source.format, source.options, source.name))
    return mixture, datasets


def _named_datasets(inputs: Sequence[str], formats: Sequence[str]) -> list[DatasetSpec]:
    """Each --input a dataset of its own, named by NAME=PATH or its file name."""
    datasets, names = [], Counter()
    for raw, fmt in zip(inputs, formats):
        name, path = _split_name(raw)
        names[name] += 1
        if names[name] > 1:  # two inputs called train.jsonl: keep both, tell them apart
            name = f"{name}#{names[name]}"
        datasets.append(DatasetSpec(name, path, fmt, source=name))
    return datasets


def config_from_args(args: argparse.Namespace) -> PreflightConfig:
    from prepack.storage import is_gcs, location_problem, output_rule

    if is_gcs(args.output) or location_problem(args.output):
        raise PreflightError(f"--output {location_problem(args.output) or repr(args.output)}: preflight writes its "
                             "tables and plots to a local folder; name one")
    if args.pack_output and location_problem(args.pack_output):
        raise PreflightError(f"--pack-output {location_problem(args.pack_output)}")
    try:  # the one string per output that the rule judges and the files are written at
        args.output = output_rule.output_path("--output", args.output)
        if args.pack_output:
            args.pack_output = output_rule.output_path("--pack-output", args.pack_output)
    except output_rule.OutputPathError as e:
        raise PreflightError(str(e)) from None
    mixture = None
    if args.mixture:
        if args.input or args.format:
            raise PreflightError("--mixture names each source's inputs and format; do not combine it with --input or --format")
        if args.pack_output:
            raise PreflightError("--mixture runs in-process; do not combine it with --pack-output")
        mixture, datasets = _mixture_datasets(args.mixture, args.allow_local_inputs)
        inputs, formats = [d.path for d in datasets], [d.format for d in datasets]
    elif not args.input or not args.format:
        raise PreflightError("--input and --format are required (or --mixture FILE)")
    else:
        inputs, formats = list(args.input), list(args.format)
    if len(formats) not in (1, len(inputs)):
        raise PreflightError(f"got {len(inputs)} inputs and {len(formats)} formats; give one format for all or one per input")
    if len(formats) == 1:
        formats *= len(inputs)
    if not args.mixture:
        datasets = _named_datasets(inputs, formats)
    batch_sizes = tuple(args.batch_size or DEFAULT_BATCH_SIZES)
    bad = [v for v in batch_sizes if v <= 0]
    if bad:
        raise PreflightError(f"--batch-size must be positive, got {bad}")
    if args.max_examples is not None and args.max_examples <= 0:
        raise PreflightError(f"--max-examples must be positive, got {args.max_examples}")
    options = {}
    for item in args.template_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise PreflightError(f"--template-option {item!r}: expected KEY=VALUE")
        options[key] = value
    for key in ("source_lang", "target_lang", "prompt_format"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    try:
        options.update(mapping_options("", args.columns, args.roles))  # each format's own names: make_template
    except ValueError as e:
        raise PreflightError(str(e)) from None
    try:  # `prepack pack`'s own reading and checks of the row options
        rows = row_spec(args, tuple(d.path for d in datasets), "", mixture, options, DEFAULT_MAX_LENGTHS)
    except OptionsError as e:
        raise PreflightError(str(e)) from None
    refused = output_rule.refusal(run_paths(args, datasets))
    if refused:
        raise PreflightError(refused)
    return PreflightConfig(datasets=tuple(datasets), output=args.output, rows=rows, batch_sizes=tuple(sorted(set(batch_sizes))),
                           max_examples=args.max_examples, seed=args.seed, plots=not args.no_plots, pack_output=args.pack_output)


def run_paths(args: argparse.Namespace, datasets: Sequence[DatasetSpec]) -> Any:
    """What a preflight reads and writes, for the one output rule (prepack/storage/output_rule.py):
    its folder and --pack-output's apart from every input, the --mixture file and a tokenizer file,
    and from each other."""
    from prepack.storage import output_rule

    inputs = output_rule.input_places("--input", [d.path for d in datasets])
    inputs += output_rule.input_places("--mixture", [args.mixture])
    if args.tokenizer and args.tokenizer.startswith(("sp:", "hf:")):
        inputs += output_rule.input_places("--tokenizer", [args.tokenizer])
    outputs = [output_rule.Place("--output", args.output)]
    if args.pack_output:
        outputs.append(output_rule.Place("--pack-output", args.pack_output))
    return output_rule.RunPaths(inputs, outputs)


def _split_name(raw: str) -> tuple[str, str]:
    """NAME=PATH, or PATH named after its file (alpaca.jsonl -> alpaca)."""
    name, sep, path = raw.partition("=")
    if sep and name and os.sep not in name and not os.path.exists(raw):
        return name, path
    stem = os.path.basename(raw.rstrip("/")) or raw
    for ext in (".jsonl", ".json", ".parquet"):
        if stem.lower().endswith(ext):
            stem = stem[: -len(ext)]
    return stem.replace("*", "_"), raw


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not args.pack_output:  # only the pipeline mode passes options on (to Beam)
        name = next((a for a in extra if a.startswith("-")), extra[0]).split("=", 1)[0]
        close = closest_option(name, long_options(parser))
        print(f"prepack preflight: error: unknown option {name} (Beam's options are taken only with --pack-output)"
              f"{f'; did you mean {close}?' if close else ''}", file=sys.stderr)
        return EXIT_REFUSED
    try:
        config = config_from_args(args)
        if not args.overwrite:
            from prepack.overwrite import refusal

            exists = refusal([os.path.join(config.output, name) for name in ("preflight.csv", "preflight.json")],
                             "replace an earlier preflight")
            if exists:
                raise PreflightError(exists)
        if config.plots:
            from apps.plots import matplotlib_missing

            if matplotlib_missing():
                raise PreflightError(f"{matplotlib_missing()}, or pass --no-plots")
        # Fail on every bad input or format before the tokenizer loads or anything is read.
        for spec in config.datasets:
            if spec.format != "auto":
                make_template(spec.format, {**config.rows.template_kwargs, **dict(spec.options)})
            if not config.pack_output:
                check_input(spec.path, config.rows)  # the job checks its own inputs up front
        config = dataclasses.replace(config, datasets=tuple(checked_format(spec, config) for spec in config.datasets))
        if config.pack_output:
            # One --overwrite for the whole command: the job's shard sets as well as preflight's files.
            result = run_with_pipeline(config, extra, overwrite=args.overwrite)
        else:
            tokenizer, chat_format = _load_tokenizer(config)
            fmt_name = getattr(chat_format, "name", type(chat_format).__name__)
            result = run(config, lambda spec: load_examples(spec, tokenizer, chat_format, config), config.rows.tokenizer, fmt_name)
        written = write_outputs(result, config.output, plots=config.plots)
    except read_inputs.InputsError as e:  # PreflightError, or the reading's own
        print(f"prepack preflight: error: {e}", file=sys.stderr)
        return 2
    print(render_text_table(result["rows"]))
    if "mixture" in result:
        print(f"\nmixture {args.mixture} (weight_of {result['mixture']['weight_of']}, max_repeats "
              f"{result['mixture']['max_repeats']}): the mix each max length would get")
        print(render_mixture_table(result["mixture"]["rows"], result["mixture"]["weight_of"]))
    for d in result["datasets"]:
        if d["sampled"]:
            print(f"note: {d['name']}: estimated from a sample of {d['examples']:,} of {d['examples_seen']:,} examples")
    print("throughput model: " + THROUGHPUT_MODEL)
    print("wrote " + ", ".join(written))
    return 0


def _load_tokenizer(config: PreflightConfig) -> tuple[Any, Any]:
    from prepack.text.chat import ChatFormatError, get_chat_format
    from prepack.text.tokenizer import TokenizerError, load_tokenizer

    try:
        tokenizer = load_tokenizer(config.rows.tokenizer)
    except TokenizerError as e:
        raise PreflightError(str(e)) from e
    try:
        return tokenizer, get_chat_format(config.rows.chat_format, tokenizer, config.rows.train_reasoning)
    except ChatFormatError as e:
        raise PreflightError(str(e)) from e
