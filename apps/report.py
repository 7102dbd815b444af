"""`prepack report`: one self-contained page from published manifests and training metrics.

- Shard sets (`--shards`, a shard set folder or an OUTPUT root holding L*/
  folders): the preflight table and plots, recomputed from each manifest's
  counts with prepack.packing.stats, so a manifest and a preflight estimate read alike.
- Training runs (`--metrics`, the JSONL `prepack train` writes): loss against
  target tokens and against time, and the useful-token budget view: how long
  each run takes to train on the same number of target tokens.
- Preflight results (`--preflight`, optional): the estimate, on the same page.
- Generations (`--generations BASE.jsonl TUNED.jsonl`, what `prepack generate` wrote): the runs'
  scores side by side and the prompts whose answer changed (apps/compare_generations.py); printed,
  and on the page when --output is given.

`--output page.html` embeds the PNGs (base64), so the page is one file;
`--output page.md` writes the PNGs beside it, named after the page.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import datetime
import glob
import html
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import numpy as np

from prepack.format.manifest import MANIFEST_NAME, Manifest, ManifestError, packing_kind
from prepack.packing.accounting import LENGTH_REASONS
from apps.packing_table import TABLE_COLUMNS, THROUGHPUT_MODEL, bound_lines, dataset_heading, drop_flags, format_cell, result_row
from prepack.packing.stats import PackingStats
from prepack.cli_help import CommandParser
from prepack.storage import new_file
# A run's objective names its own step metrics (train/objectives/ imports nothing heavy: the
# report still reads a JSONL without the train extra installed).
from train import objectives
from train.objectives import Objective

DEFAULT_BATCH_SIZES = (16,)


class ReportError(Exception):
    """Bad input: printed as one line, exit status 2."""


@dataclasses.dataclass(frozen=True)
class ReportConfig:
    output: str
    shards: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()
    preflight: tuple[str, ...] = ()
    batch_sizes: tuple[int, ...] = ()  # () : the training runs' own (from --metrics), else DEFAULT_BATCH_SIZES
    budget: float | None = None  # target tokens; None: the most that every run reached
    warmup_steps: int = 1  # first steps (compilation) timed as the median step, as the trainer's summary leaves step 1 out
    title: str = "tunix-prepack report"
    generations: tuple[str, ...] = ()


# ----------------------------------------------------------------------------- manifests


def find_manifests(path: str) -> list[tuple[str, Manifest]]:
    """(folder, manifest) for a shard set folder, or for every L*/ shard set under an OUTPUT root."""
    if path.startswith("gs://"):
        from prepack import storage  # lazy: google-cloud-storage only for gs:// inputs

        if not storage.storage_for(path).exists(storage.join(path, MANIFEST_NAME)):
            raise ReportError(f"--shards {path}: no {MANIFEST_NAME} there (for gs:// give each L* folder)")
        return [(path, _read_manifest(storage.join(path, MANIFEST_NAME)))]
    if not os.path.isdir(path):
        raise ReportError(f"--shards {path}: no such folder")
    own = os.path.join(path, MANIFEST_NAME)
    if os.path.isfile(own):
        return [(path, _read_manifest(own))]
    found = []
    for folder in glob.glob(os.path.join(path, "L*")):
        if re.fullmatch(r"L\d+", os.path.basename(folder)) and os.path.isfile(os.path.join(folder, MANIFEST_NAME)):
            found.append((folder, _read_manifest(os.path.join(folder, MANIFEST_NAME))))
    if not found:
        raise ReportError(f"--shards {path}: no {MANIFEST_NAME} in it or in an L*/ folder under it (is the job finished?)")
    return sorted(found, key=lambda item: item[1].max_length)


def _read_manifest(path: str) -> Manifest:
    from prepack import storage  # the one capped reader of metadata files

    try:
        text = storage.read_text(path)
    except ManifestError as e:
        raise ReportError(str(e)) from None
    if text is None:
        raise ReportError(f"{path}: vanished while it was read")
    return _parse_manifest(text, path)


def _parse_manifest(text: str, source: str) -> Manifest:
    try:
        return Manifest.from_json(text, source=source)
    except ManifestError as e:
        raise ReportError(str(e)) from e


def _stat(manifest: Manifest, key: str, source: str) -> Any:
    if key not in manifest.stats:
        raise ReportError(f"{source}: manifest stats lack {key!r}")
    return manifest.stats[key]


def manifest_rows(label: str, folder: str, manifest: Manifest, batch_sizes: Sequence[int],
                  given: str | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """Table rows for one shard set (one per batch size), and warnings about inconsistent stats."""
    source = os.path.join(folder, MANIFEST_NAME)
    dropped = _stat(manifest, "examples_dropped", source)
    if not isinstance(dropped, dict):
        raise ReportError(f"{source}: stats.examples_dropped should map reason -> count, got {dropped!r}")
    stats = PackingStats(
        max_length=manifest.max_length,
        examples=int(_stat(manifest, "examples_written", source)),
        tokens=int(_stat(manifest, "tokens", source)),
        target_tokens=int(_stat(manifest, "target_tokens", source)),
        rows=manifest.num_rows,
        segment_cap=(manifest.options or {}).get("max_segments_per_row"),
    )
    warnings = []
    for key, ours in (("packed_density", stats.packed_density), ("unpacked_density", stats.unpacked_density),
                      ("lower_bound_rows", stats.lower_bound_rows)):
        theirs = manifest.stats.get(key)
        if theirs is not None and not math.isclose(float(theirs), ours, rel_tol=1e-6, abs_tol=1e-9):
            warnings.append(f"{source}: stats.{key} is {theirs}, but its counts give {ours:.6g}")
    histogram = _histogram(manifest.stats.get("length_histogram"))
    # A mixture's not_sampled examples tokenized fine and fit: sampling left them out, not L.
    sampled_out = int(dropped.get("not_sampled", 0))
    length_drops = sum(int(v) for k, v in dropped.items() if k in LENGTH_REASONS) - sampled_out
    meta = {
        "dataset": label,
        "input": given or folder,
        "format": (manifest.template or {}).get("name", ""),
        "tokenizer": (manifest.tokenizer or {}).get("name", ""),
        "chat_format": (manifest.template or {}).get("chat_format_resolved") or (manifest.template or {}).get("chat_format", ""),
        "packing": manifest.packing,
        "overlong": (manifest.options or {}).get("overlong", ""),
        # The job counts records (source lines) apart from examples when it knows them (oasst1 differs).
        "records_read": manifest.stats.get("records_read", _stat(manifest, "examples_read", source)),
        # Record-level problems (bad JSON, missing fields) are the drops that do not depend on L.
        "bad_records": manifest.stats.get("bad_records",
                                          sum(int(v) for k, v in dropped.items() if k not in LENGTH_REASONS)),
        # As in preflight: examples are what tokenized fine; dropped are those the max length cost
        # (under --overlong split or window, written and dropped count pieces, and in a mixture written
        # counts repeated copies: back to examples).
        "examples": int(_stat(manifest, "examples_written", source)) + length_drops + sampled_out
        - int(manifest.stats.get("examples_repeated", 0))
        - int(manifest.stats.get("split_pieces", 0)) + int(manifest.stats.get("examples_split", 0))
        - int(manifest.stats.get("window_pieces") or 0) + int(manifest.stats.get("examples_windowed") or 0),
        "planner": (manifest.options or {}).get("planner", ""),
        "max_segments_per_row": (manifest.options or {}).get("max_segments_per_row"),
        "bfd_rows": manifest.stats.get("bfd_rows"),
        "examples_split": manifest.stats.get("examples_split", 0),
        "split_pieces": manifest.stats.get("split_pieces", 0),
        "dropped_no_targets_after_split": dropped.get("no_targets_after_split", 0),
        "examples_windowed": manifest.stats.get("examples_windowed") or 0,
        "window_pieces": manifest.stats.get("window_pieces") or 0,
        "context_tokens_replayed": manifest.stats.get("context_tokens_replayed") or 0,
        "dropped_window_context_too_long": dropped.get("window_context_too_long", 0),
        "examples_dropped": length_drops,
        "dropped_by_reason": dict(sorted(dropped.items())),
        "dropped_too_long": dropped.get("too_long", 0),
        "dropped_no_targets_after_truncation": dropped.get("no_targets_after_truncation", 0),
        "examples_truncated": manifest.stats.get("examples_truncated", 0),
        "mean_tokens": stats.tokens / stats.examples if stats.examples else 0.0,
        **_histogram_quantiles(histogram),
    }
    return [result_row(meta, stats, b) for b in batch_sizes], warnings


def _histogram(value: Any) -> dict[int, int]:
    if not isinstance(value, dict):
        return {}
    return {int(k): int(v) for k, v in value.items()}


def _histogram_quantiles(histogram: dict[int, int]) -> dict[str, Any]:
    """Median, p95 and max from a length histogram, when the manifest carries one."""
    if not histogram:
        return {}
    lengths = np.repeat(np.array(list(histogram), dtype=np.int64), list(histogram.values()))
    return {"median_tokens": float(np.median(lengths)), "p95_tokens": float(np.percentile(lengths, 95)),
            "max_tokens": int(lengths.max())}


def _shard_label(path: str) -> str:
    path = path.rstrip("/")
    base = os.path.basename(path)
    if re.fullmatch(r"L\d+", base):
        # OUTPUT/L512 is named after OUTPUT: its siblings are the same data at other lengths.
        return os.path.basename(os.path.dirname(path)) or base
    return base


# ----------------------------------------------------------------------------- training metrics


@dataclasses.dataclass
class Run:
    """One training run's per-step metrics (the JSONL `prepack train` writes)."""

    label: str
    path: str
    steps: np.ndarray
    loss: np.ndarray
    step_time_s: np.ndarray  # as logged
    target_tokens: np.ndarray  # per step
    tokens: np.ndarray  # per step
    summary: dict[str, Any]
    packing: str = ""
    warmup_steps: int = 0
    evals: list[tuple[float, float]] = dataclasses.field(default_factory=list)  # (step, eval loss)
    # A mixture set's run: source name -> its loss per step (NaN where the batch had none of it).
    loss_by_source: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # What its loss is (`prepack train --loss-mean`): "token" or "example"; a JSONL written
    # before the option existed logged the token mean; an objective's own otherwise ("pair").
    loss_mean: str = "token"
    # What it trained (train/objectives/: the records' `objective`; a JSONL written before the
    # option existed trained the default), and that objective's own metrics: name -> its value
    # per step (NaN where not logged).
    objective: Objective = objectives.DEFAULT
    objective_metrics: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # `prepack train --eval-generate`: its {"eval_generate": {...}} records, in order.
    eval_generate: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def clock_s(self) -> np.ndarray:
        """Step times for the time axis: the first `warmup_steps` (compilation) count as the
        median of the others, so a run is charged for its work but not for compiling."""
        times = self.step_time_s.copy()
        w = min(self.warmup_steps, len(times))
        if 0 < w < len(times):
            times[:w] = np.median(times[w:])
        return times

    @property
    def cum_time(self) -> np.ndarray:
        return np.cumsum(self.clock_s)

    @property
    def cum_target_tokens(self) -> np.ndarray:
        return np.cumsum(self.target_tokens)

    def time_to(self, budget: float) -> float:
        """Seconds until `budget` target tokens were trained, linear within the step that crosses it."""
        cum = self.cum_target_tokens
        if not len(cum) or budget > cum[-1]:
            return math.nan
        return float(np.interp(budget, np.concatenate([[0], cum]), np.concatenate([[0.0], self.cum_time])))

    def steps_to(self, budget: float) -> int:
        cum = self.cum_target_tokens
        return int(np.searchsorted(cum, budget) + 1) if len(cum) and budget <= cum[-1] else 0

    @property
    def diverged(self) -> str | None:
        """Why this run's result cannot be trusted (it stopped on a non-finite value, or its final loss is
        not finite or missing), or None. Such a run gets no speed-up: time to a budget means nothing
        when the model it bought is broken."""
        stopped = self.summary.get("stopped")
        if isinstance(stopped, dict):
            return f"stopped at step {stopped.get('step')}: {stopped.get('reason')}"
        final = self.loss[-1] if len(self.loss) else math.nan
        if not math.isfinite(final):
            return f"final loss is {'missing or NaN' if math.isnan(final) else final} (step {int(self.steps[-1])})"
        return None

    @property
    def eval_loss(self) -> float:
        value = self.summary.get("eval_loss")
        if value is None and self.evals:
            value = self.evals[-1][1]
        return math.nan if value is None else float(value)


REQUIRED_STEP_KEYS = ("step", "loss", "step_time_s", "target_tokens")
# `prepack train` writes a non-finite loss as null (JSON has no NaN) with the reason beside it.
NULLABLE_STEP_KEYS = ("loss",)
# The numbers of a step record the report reads (the per-source losses are checked where read).
NUMBER_STEP_KEYS = ("loss", "step_time_s", "target_tokens", "tokens", "target_tokens_per_s")
# A metrics line is a few hundred bytes (a mixture's per-source fields: a few KiB): a longer one
# is no record of `prepack train`, and is refused after this many bytes, unread beyond them
# (a 1 GB file of one line took 18 s and 2.1 GB before its one-line error).
MAX_METRICS_LINE_BYTES = 1 << 20
# The largest step number: `prepack train` counts steps in int32.
MAX_STEP = 2**31 - 1


def _checked_step(record: dict[str, Any], where: str) -> dict[str, Any]:
    """A step record's numbers: `step` a whole number from 0 to MAX_STEP, the others numbers
    (`loss` may be null); one line naming the field otherwise ("one", [1] and 1e30 were tracebacks)."""
    from prepack.hostile_input.untrusted import shown_with_type

    step = record["step"]
    if type(step) is not int or not 0 <= step <= MAX_STEP:
        raise ReportError(f"{where}: step is {shown_with_type(step)}, not a step number (a whole number from 0 to {MAX_STEP:,})")
    for key in NUMBER_STEP_KEYS:
        value = record.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ReportError(f"{where}: {key} is {shown_with_type(value)}, not a number")
    by_source = record.get("loss_by_source")
    if by_source is not None and not (isinstance(by_source, dict) and all(
            v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in by_source.values())):
        raise ReportError(f"{where}: loss_by_source is {shown_with_type(by_source)}, not an object of source -> number")
    return record


def load_run(path: str, label: str | None = None, warmup_steps: int = 1) -> Run:
    """Reads step lines, {"eval": {...}} lines and the {"summary": {...}} line of a metrics JSONL
    (written by a stranger: each line bounded, each number checked)."""
    if not os.path.isfile(path):
        raise ReportError(f"--metrics {path}: no such file")
    from prepack.hostile_input.untrusted import jsonl_values

    steps, evals, summary, generated = [], [], {}, []
    for where, record in jsonl_values(path, ReportError, MAX_METRICS_LINE_BYTES, "a metrics record of prepack train"):
        if not isinstance(record, dict):
            raise ReportError(f"{where}: expected a JSON object")
        if isinstance(record.get("eval"), dict):
            ev = record["eval"]
            if ev.get("loss") is not None:
                try:
                    evals.append((float(ev.get("step") or 0), float(ev["loss"])))
                except (TypeError, ValueError, OverflowError):
                    raise ReportError(f"{where}: eval step and loss must be numbers, got {ev.get('step')!r:.40} and "
                                      f"{ev.get('loss')!r:.40}") from None
        elif isinstance(record.get("eval_generate"), dict):
            ev = record["eval_generate"]
            if isinstance(ev.get("step"), int) and all(isinstance(ev.get(k), (int, float, type(None))) for k in
                                                       ("exact_match", "reference_nll", "full_call_accuracy")):
                generated.append(ev)
        elif isinstance(record.get("summary"), dict):
            summary.update(record["summary"])
        elif "loss" in record and "step" in record and "summary" not in record:
            missing = [k for k in REQUIRED_STEP_KEYS if k not in record or (record[k] is None and k not in NULLABLE_STEP_KEYS)]
            if missing:
                raise ReportError(f"{where}: step record lacks {', '.join(missing)}")
            steps.append(_checked_step(record, where))
        else:
            summary.update({k: v for k, v in record.items() if k != "summary"})  # a flat summary line
    if not steps:
        raise ReportError(f"{path}: no step records (expected JSON lines with {', '.join(REQUIRED_STEP_KEYS)})")
    column = lambda key: np.array([float(r.get(key) or 0) for r in steps], dtype=np.float64)  # noqa: E731
    target = _per_step(column("target_tokens"), column("step_time_s"), [r.get("target_tokens_per_s") for r in steps])
    name = label or os.path.splitext(os.path.basename(path))[0]
    packing = str(steps[-1].get("packing") or summary.get("packing") or _packing_from_name(name))
    loss = np.array([math.nan if r.get("loss") is None else float(r["loss"]) for r in steps], dtype=np.float64)
    names = list(dict.fromkeys(k for r in steps for k in (r.get("loss_by_source") or {})))
    by_source = {n: np.array([math.nan if (r.get("loss_by_source") or {}).get(n) is None else float(r["loss_by_source"][n])
                              for r in steps], dtype=np.float64) for n in names}
    loss_mean = str(steps[-1].get("loss_mean") or summary.get("loss_mean") or "token")
    objective = _objective_of(steps[-1].get("objective") or summary.get("objective") or objectives.DEFAULT.name, path)
    metrics = {k: np.array([math.nan if not isinstance(r.get(k), (int, float)) else float(r[k]) for r in steps], dtype=np.float64)
               for k in objective.metric_names}
    return Run(name, path, column("step"), loss, column("step_time_s"), target, column("tokens"), summary, packing,
               warmup_steps, evals, by_source, loss_mean, objective, metrics, generated)


def _objective_of(name: Any, path: str) -> Objective:
    from prepack.hostile_input.untrusted import shown_with_type

    if not isinstance(name, str) or name not in objectives.REGISTRY:
        raise ReportError(f"{path}: objective is {shown_with_type(name)}, not one of {', '.join(objectives.names())} "
                          f"(prepack train --objective)")
    return objectives.by_name(name)


def _per_step(values: np.ndarray, times: np.ndarray, rates: list[Any]) -> np.ndarray:
    """Per-step counts. The contract is per step; if the numbers only make sense as running
    totals (target_tokens_per_s matches the differences, not the values), take differences."""
    if len(values) < 3 or any(r is None for r in rates) or np.any(np.diff(values) < 0):
        return values
    rate = np.asarray(rates, dtype=np.float64)
    deltas = np.diff(values, prepend=0.0)
    safe = np.where(times > 0, times, np.nan)
    as_values = np.nanmedian(np.abs(values / safe - rate) / np.maximum(rate, 1e-9))
    as_deltas = np.nanmedian(np.abs(deltas / safe - rate) / np.maximum(rate, 1e-9))
    return deltas if as_deltas < 0.05 < as_values else values


def _packing_from_name(name: str) -> str:
    lower = name.lower()
    if "unpacked" in lower or "nopack" in lower or "no_pack" in lower:
        return "unpacked"
    if "packed" in lower or "bfd" in lower:
        return "packed"
    return ""


def budget_rows(runs: Sequence[Run], budget: float | None = None) -> tuple[float, list[dict[str, Any]]]:
    """The useful-token budget view: time each run needs for the same number of target tokens.

    Default budget: the most target tokens every run reached, so every run has a time.
    Speed-up is against the unpacked run when there is exactly one, else against the slowest.
    A diverged run (Run.diverged) gets no time to the budget and no speed-up, and is no reference.
    """
    if budget is None:
        budget = min(float(r.cum_target_tokens[-1]) for r in runs)
    times = [math.nan if r.diverged else r.time_to(budget) for r in runs]
    unpacked = [i for i, r in enumerate(runs) if r.packing == "unpacked"]
    finite = [i for i, t in enumerate(times) if not math.isnan(t)]
    ref = unpacked[0] if len(unpacked) == 1 and not math.isnan(times[unpacked[0]]) else (
        max(finite, key=lambda i: times[i]) if finite else None)
    out = []
    for run, t in zip(runs, times):
        total_time = float(run.cum_time[-1])
        total_target = float(run.cum_target_tokens[-1])
        out.append({
            "run": run.label,
            "packing": run.packing or "-",
            "steps": len(run.steps),
            "target_tokens": total_target,
            "time_s": total_time,
            "target_tokens_per_s": total_target / total_time if total_time else 0.0,
            "mean_step_time_s": float(np.mean(run.clock_s)),
            "steps_to_budget": run.steps_to(budget),
            "time_to_budget_s": t,
            "speedup": (times[ref] / t) if ref is not None and t and not math.isnan(t) else math.nan,
            "reference": runs[ref].label if ref is not None else "-",
            "final_loss": float(np.mean(run.loss[-max(1, len(run.loss) // 10):])),
            "loss_mean": run.loss_mean,
            "status": f"diverged: {run.diverged}" if run.diverged else "ok",
            "eval_loss": run.eval_loss,
        })
    return budget, out


# ----------------------------------------------------------------------------- page building


@dataclasses.dataclass
class Page:
    """Blocks in order: ("h1"|"h2"|"h3"|"p"|"pre", text), ("table", headers, rows), ("img", caption, png path)."""

    blocks: list[tuple[Any, ...]] = dataclasses.field(default_factory=list)

    def add(self, *block: Any) -> None:
        self.blocks.append(block)


def _table_block(rows: Sequence[dict[str, Any]], with_packing: bool) -> tuple[list[str], list[list[str]]]:
    columns = list(TABLE_COLUMNS)
    if with_packing:
        columns.insert(0, ("packing", "packing", "str"))
    return [h for h, _, _ in columns], [[format_cell(r.get(k), kind) for _, k, kind in columns] for r in rows]


BUDGET_COLUMNS = (
    ("run", "run", "str"), ("packing", "packing", "str"), ("steps", "steps", "int"),
    ("target tokens", "target_tokens", "int"), ("time", "time_s", "seconds"),
    ("target tok/s", "target_tokens_per_s", "int"), ("s/step", "mean_step_time_s", "seconds"),
    ("steps to budget", "steps_to_budget", "int"), ("time to budget", "time_to_budget_s", "seconds"),
    ("speed-up", "speedup", "times"), ("final loss", "final_loss", "float3"), ("eval loss", "eval_loss", "float3"),
    ("loss mean", "loss_mean", "str"), ("status", "status", "str"),
)


def _budget_cell(value: Any, kind: str) -> str:
    if isinstance(value, float) and math.isnan(value):
        return "-"
    if kind == "seconds":
        return f"{float(value):.2f} s"
    if kind == "float3":
        return f"{float(value):.3f}"
    return format_cell(value, kind)


# Below this gain, packing is not worth the extra step (a 5% gain is within run-to-run noise).
WORTH_IT = 1.05


def training_verdict(table: Sequence[dict[str, Any]], budget: float) -> str | None:
    """One or two sentences from the measured runs: did packing reach the same target tokens sooner, and by how much."""
    ref = next((r for r in table if r["run"] == r["reference"]), None)
    others = [r for r in table if r is not ref and not math.isnan(r["speedup"])]
    if ref is None or not others:
        return None
    best = max(others, key=lambda r: r["speedup"])
    speed = best["speedup"]
    measured = (f"the {best['run']} run trained on {budget:,.0f} target tokens in {best['time_to_budget_s']:.1f} s, "
                f"against {ref['time_to_budget_s']:.1f} s for {ref['run']}")
    if speed >= WORTH_IT:
        return f"Packing was worth it here: {measured}, {speed:.2f}x faster."
    if speed > 1 / WORTH_IT:
        return f"Packing made no real difference here: {measured} ({speed:.2f}x)."
    return f"Packing was not worth it here: {measured} ({speed:.2f}x, slower)."


def estimate_verdict(rows: Sequence[dict[str, Any]], what: str) -> str | None:
    """The same question from densities alone: the best expected gain, where. `what` says where the
    estimate comes from and why no training answers it ("from the shard sets; no training measured")."""
    packed = [r for r in rows if r.get("packing") != "unpacked" and r.get("throughput_gain")]
    if not packed:
        return None
    best = max(packed, key=lambda r: float(r["throughput_gain"]))
    gain = float(best["throughput_gain"])
    where = f"{best['dataset']} at L={best['max_length']}, B={best['batch_size']}"
    if gain >= WORTH_IT:
        return (f"Packing should be worth it here ({what}): {where} needs {gain:.2f}x fewer "
                f"steps for the same examples ({100 * float(best['packed_density']):.0f}% of row slots hold tokens "
                f"packed, {100 * float(best['unpacked_density']):.0f}% unpacked).")
    return f"Packing would gain little here ({what}): at best {gain:.2f}x fewer steps ({where})."


def runs_verdict(runs: Sequence[Run]) -> str | None:
    """What the given runs measured, when they do not compare packed with unpacked (one run, a DPO
    run, runs of one packing): each run's objective, steps and loss from first to last step, and for
    a DPO run its reward accuracy at the end."""
    parts = []
    for run in runs:
        finite = run.loss[np.isfinite(run.loss)]
        if not len(finite):
            continue
        n = len(run.steps)
        part = (f"{run.label} ({run.objective.title}, {n:,} step{'' if n == 1 else 's'}) took its loss from "
                f"{finite[0]:.3f} to {finite[-1]:.3f}")
        section = run.objective.report
        metric = run.objective_metrics.get(section.verdict_metric) if section is not None else None
        if metric is not None and np.isfinite(metric).any():
            part += f", {section.verdict_words} {metric[np.isfinite(metric)][-1]:.2f} at the end"
        parts.append(part + (f" ({run.diverged})" if run.diverged else ""))
    return "Trained: " + "; ".join(parts) + "." if parts else None


# Where packing's gain comes from when the runs given do not measure it.
UNCOMPARED = "no unpacked run beside the training measured above to compare it with"


def page_verdict(config: ReportConfig, runs: Sequence[Run], table: Sequence[dict[str, Any]], budget: float,
                 rows: Sequence[dict[str, Any]]) -> str | None:
    """The page's first line: measured training beats a shard-set estimate, which beats preflight's.
    Runs that do not compare packed with unpacked (a single DPO run) are said as what they measured,
    and the estimate beside them says that no run measured packing's gain."""
    measured = training_verdict(table, budget) if runs else None
    if measured:
        return measured
    trained = runs_verdict(runs) if runs else None
    why = UNCOMPARED if trained else "no training measured"
    estimate = (estimate_verdict(rows, f"from the shard sets; {why}") if config.shards else None) \
        or next((v for v in (estimate_verdict(_read_preflight(s)["rows"], f"preflight estimate; {why}")
                             for s in config.preflight) if v), None)
    return " ".join(p for p in (trained, estimate) if p) or None


def table_batch_sizes(given: Sequence[int], runs: Sequence[Run]) -> tuple[int, ...]:
    """The batch sizes of the shard tables: those given, else the training runs' own (their metrics
    record batch_size), so that the tables' gain is the one the runs measured; else the default."""
    if given:
        return tuple(given)
    from_runs = {r.summary.get("batch_size") for r in runs}
    from_runs = {b for b in from_runs if isinstance(b, int) and not isinstance(b, bool) and b > 0}
    return tuple(sorted(from_runs)) or DEFAULT_BATCH_SIZES


def build_page(config: ReportConfig, figures_dir: str) -> tuple[Page, list[str]]:
    """Reads every input, draws the figures into figures_dir, lays out the page; returns it and its PNGs."""
    page, pngs = Page(), []
    page.add("h1", config.title)
    page.add("p", f"Generated {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')} by `prepack report`.")
    runs = [load_run(path, label, config.warmup_steps) for label, path in map(_split_label, config.metrics)]
    for run in runs:
        if run.diverged:
            # At the top: a broken run must not read as a result further down.
            page.add("p", f"Warning: training run {run.label} diverged ({run.diverged}); it is shown without a "
                          "speed-up, and its loss curve ends where the loss stopped being finite.")

    def figure(name: str, draw: Any, *args: Any, **kwargs: Any) -> None:
        path = draw(*args, path=os.path.join(figures_dir, name), **kwargs)
        pngs.append(path)
        page.add("img", name, path)

    _preflight_sections(page, figure, config)
    if config.generations:
        from apps import compare_generations

        compare_generations.page_section(page, compare_generations.load_all(config.generations))
    rows = _shards_section(page, figure, config, runs) if config.shards else []
    budget, table = _training_section(page, figure, config, runs) if runs else (0.0, [])

    answer = page_verdict(config, runs, table, budget, rows)  # the page opens with the answer
    if answer:
        page.blocks.insert(1, ("p", "Verdict: " + answer))

    page.add("h2", "Definitions")
    page.add("p", "density = real tokens / (rows x L); target density = trained tokens / (rows x L); unpacked = one "
                  "example per row; row reduction = unpacked rows / packed rows.")
    page.add("p", "Throughput model: " + THROUGHPUT_MODEL)
    return page, pngs


def _preflight_sections(page: Page, figure: Any, config: ReportConfig) -> None:
    from apps import plots  # lazy: matplotlib only here

    for source in config.preflight:
        data = _read_preflight(source)
        page.add("h2", f"Preflight estimate: {source}")
        _packing_section(page, data["rows"], with_packing=False)
        hists = {d["name"]: _histogram(d.get("length_histogram")) for d in data.get("datasets", [])}
        prefix = f"preflight{config.preflight.index(source) + 1}_"
        figure(prefix + "density_vs_max_length.png", plots.density_vs_max_length, data["rows"])
        figure(prefix + "row_reduction.png", plots.row_reduction, data["rows"])
        if any(hists.values()):
            figure(prefix + "length_histogram.png", plots.length_histogram, hists, data["config"]["max_lengths"])


def _shards_section(page: Page, figure: Any, config: ReportConfig, runs: list[Run]) -> list[dict[str, Any]]:
    """The shard sets' table, warnings and figures; returns the table's rows."""
    from apps import plots  # lazy: matplotlib only here

    batch_sizes = table_batch_sizes(config.batch_sizes, runs)
    rows, warnings, hists, lengths = [], [], {}, set()
    for path in config.shards:
        label = _shard_label(path)
        for folder, manifest in find_manifests(path):
            more, warn = manifest_rows(label, folder, manifest, batch_sizes, given=path)
            rows += more
            warnings += warn
            lengths.add(manifest.max_length)
            hist = _histogram(manifest.stats.get("length_histogram"))
            if hist:
                hists.setdefault(label, hist)
    page.add("h2", "Shard sets")
    page.add("p", "Figures recomputed from each manifest's counts (examples_written, tokens, target_tokens, "
                  "num_rows) with prepack.packing.stats; median and p95 need a length histogram in the manifest.")
    _packing_section(page, rows, with_packing=True)
    for w in warnings:
        page.add("p", "Warning: " + w)
    # An unpacked shard set is already the dashed "unpacked" line of its packed sibling.
    drawn = [r for r in rows if r.get("packing") != "unpacked"] or rows
    figure("shards_density_vs_max_length.png", plots.density_vs_max_length, drawn)
    figure("shards_row_reduction.png", plots.row_reduction, drawn)
    if hists:
        figure("shards_length_histogram.png", plots.length_histogram, hists, sorted(lengths))
    _mixture_section(page, figure, [m for path in config.shards for _, m in find_manifests(path)])
    return rows


def _training_section(page: Page, figure: Any, config: ReportConfig, runs: list[Run]) -> tuple[float, list[dict[str, Any]]]:
    """The training runs' curves and useful-token budget table; returns (budget, table)."""
    from apps import plots  # lazy: matplotlib only here

    budget, table = budget_rows(runs, config.budget)
    page.add("h2", "Training runs")
    warm = (f" The first {config.warmup_steps} step(s) of each run carry compilation, so they are timed as the "
            f"run's median step." if config.warmup_steps else "")
    page.add("p", "Time is the sum of logged step_time_s; target tokens are the loss-mask tokens each step trained "
                  "on; final loss is the mean training loss over the last 10% of steps. Loss mean is each run's "
                  "`--loss-mean`: token (the mean over a batch's target tokens) or example (the mean of its "
                  "examples' token means)." + warm)
    if len({run.loss_mean for run in runs}) > 1:
        page.add("p", "Warning: these runs use different loss means (" + ", ".join(
            f"{run.label}: {run.loss_mean}" for run in runs) + "); their loss values measure different things.")
    figure("loss_curves.png", plots.loss_curves, runs, budget=budget)
    page.add("h3", f"Useful-token budget: {budget:,.0f} target tokens")
    page.add("p", "Time each run needs to train on the same number of target tokens (by default the most that "
                  "every run reached), interpolated within the step that crosses it. Speed-up is against "
                  f"{table[0]['reference']}.")
    page.add("table", [h for h, _, _ in BUDGET_COLUMNS],
             [[_budget_cell(r[k], kind) for _, k, kind in BUDGET_COLUMNS] for r in table])
    figure("budget.png", plots.budget_bars, table, budget=budget)
    for objective in objectives.REGISTRY.values():
        own = [run for run in runs if run.objective is objective]
        if objective.report is not None and own:
            _objective_section(page, figure, objective.report, own)
    if any(run.loss_by_source for run in runs):
        page.add("h3", "Loss by source")
        page.add("p", "Mixture sets: each source's training loss per step (its target tokens' mean NLL in the "
                      "batch; a step without that source has no point), from loss_by_source in the metrics JSONL.")
        figure("loss_by_source.png", plots.source_loss_curves, [r for r in runs if r.loss_by_source])
    if any(run.eval_generate for run in runs):
        page.add("h3", "Held-out generations during training")
        page.add("p", "`prepack train --eval-generate`: the held-out prompts' replies generated greedily with the "
                      "run's model at each evaluation, scored as `prepack generate --score` does (exact match of the "
                      "reply; the reference reply's mean token NLL).")
        figure("eval_generate.png", plots.eval_generate_curves, [r for r in runs if r.eval_generate])
    return budget, table


def _objective_section(page: Page, figure: Any, section: objectives.ReportSection, runs: Sequence[Run]) -> None:
    """The runs of one objective with a section of its own: its metrics, first and last steps, and
    TRL's reward curves where the objective logs them."""
    from apps import plots

    page.add("h3", section.heading)
    page.add("p", section.note)
    names = list(runs[0].objective_metrics)
    headers = ["run", "steps", "loss first", "loss last", *[f"{k} last" for k in names]]
    cells = []
    for run in runs:
        tail = max(1, len(run.steps) // 10)
        last = {k: float(np.nanmean(v[-tail:])) if np.isfinite(v[-tail:]).any() else math.nan
                for k, v in run.objective_metrics.items()}
        cells.append([run.label, f"{len(run.steps):,}", f"{run.loss[0]:.4f}", f"{float(np.nanmean(run.loss[-tail:])):.4f}",
                      *[f"{last[k]:.4f}" for k in names]])
    page.add("table", headers, cells)
    if section.figure:
        figure(section.figure, plots.reward_curves, runs)


def _mixture_section(page: Page, figure: Any, manifests: Sequence[Manifest]) -> None:
    """Mixture sets: the realized mix of each length, per source, and its plot."""
    from apps import plots

    mixed = [m for m in manifests if getattr(m, "mixture", None)]
    if not mixed:
        return
    page.add("h3", "Mixture")
    page.add("p", f"Shares of {mixed[0].mixture['weight_of']} asked and written per source (manifest `mixture`); "
                  "repeats = written / kept weight (< 1: down-sampled).")
    # A packed and a --no-pack set of one L are two mixes: each row says which set it is.
    rows = sorted(({**f, "max_length": m.max_length, "packing": packing_kind(m)} for m in mixed for f in m.mixture["sources"]),
                  key=lambda r: (r["max_length"], r["packing"]))
    headers = ["L", "packing", "source", "asked", "mix", "written", "unique", "not sampled", "repeats"]
    page.add("table", headers, [[str(r["max_length"]), r["packing"], r["name"], f"{r['requested_share']:.1%}", f"{r['realized_share']:.1%}",
                                 f"{r['examples_written']:,}", f"{r['examples_unique']:,}",
                                 f"{r['examples_dropped'].get('not_sampled', 0):,}", f"{r['repeats']:.2f}x"] for r in rows])
    figure("mixture.png", plots.mixture_shares, rows, mixed[0].mixture["weight_of"])


def _packing_section(page: Page, rows: Sequence[dict[str, Any]], with_packing: bool) -> None:
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(str(row["dataset"]), []).append(row)
    for group in groups.values():
        page.add("h3", dataset_heading(group[0]))
        drops = [(r["max_length"], {k: v for k, v in r["dropped_by_reason"].items() if v})
                 for r in group if r.get("dropped_by_reason") and any(r["dropped_by_reason"].values())]
        if drops:
            seen = list(dict.fromkeys((L, tuple(d.items())) for L, d in drops))
            page.add("p", "Dropped by reason: " + "; ".join(
                f"L{L} " + ", ".join(f"{k} {int(v):,}" for k, v in d) for L, d in seen))
        headers, cells = _table_block(group, with_packing)
        page.add("table", headers, cells)
        for line in drop_flags(group) + bound_lines(group):
            page.add("p", line)


def _read_preflight(source: str) -> dict[str, Any]:
    path = os.path.join(source, "preflight.json") if os.path.isdir(source) else source
    if not os.path.isfile(path):
        raise ReportError(f"--preflight {source}: no preflight.json there")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ReportError(f"{path}: not valid JSON ({e.msg})") from e
    if not isinstance(data, dict) or "rows" not in data:
        raise ReportError(f"{path}: not a preflight.json (no 'rows')")
    return data


def _split_label(raw: str) -> tuple[str | None, str]:
    label, sep, path = raw.partition("=")
    if sep and label and os.sep not in label and not os.path.exists(raw):
        return label, path
    return None, raw


# ----------------------------------------------------------------------------- rendering


def _markdown_cell(text: str) -> str:
    """A table cell that stays one cell: a generated completion may hold line breaks, pipes and
    special tokens such as <end_of_turn>, which Markdown would otherwise read as HTML and hide."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|").replace("\n", "<br>")


def render_markdown(page: Page, image_names: dict[str, str]) -> str:
    out = []
    for block in page.blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append("#" * int(kind[1]) + " " + block[1])
        elif kind == "p":
            out.append(block[1])
        elif kind == "table":
            headers, rows = block[1], block[2]
            out.append("| " + " | ".join(headers) + " |")
            out.append("|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|")
            out += ["| " + " | ".join(_markdown_cell(c) for c in row) + " |" for row in rows]
        elif kind == "img":
            out.append(f"![{block[1]}]({image_names[block[2]]})")
        out.append("")
    return "\n".join(out)


_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:0.5em 0 1.5em}th,td{padding:3px 8px;border-bottom:1px solid #ddd;
text-align:right}th:first-child,td:first-child{text-align:left}th{background:#f3f3f3}img{max-width:100%;margin:0.5em 0}
h3{font-size:15px;margin-top:1.5em}code{background:#f3f3f3}"""


def render_html(page: Page) -> str:
    out = ["<!DOCTYPE html>", "<html><head><meta charset='utf-8'>", f"<title>{html.escape(page.blocks[0][1])}</title>",
           f"<style>{_CSS}</style></head><body>"]
    for block in page.blocks:
        kind = block[0]
        if kind in ("h1", "h2", "h3"):
            out.append(f"<{kind}>{html.escape(block[1])}</{kind}>")
        elif kind == "p":
            text = html.escape(block[1])
            out.append("<p>" + re.sub(r"`([^`]+)`", r"<code>\1</code>", text) + "</p>")
        elif kind == "table":
            head = "".join(f"<th>{html.escape(h)}</th>" for h in block[1])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in block[2])
            out.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        elif kind == "img":
            with open(block[2], "rb") as f:
                data = base64.b64encode(f.read()).decode("ascii")
            out.append(f"<img alt='{html.escape(block[1])}' src='data:image/png;base64,{data}'>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


def write_report(config: ReportConfig) -> list[str]:
    """Writes the page (and, for Markdown, its PNGs); returns the paths written."""
    out = config.output
    ext = os.path.splitext(out)[1].lower()
    if ext not in (".html", ".htm", ".md"):
        raise ReportError(f"--output {out}: expected a .html or .md file")
    folder = os.path.dirname(os.path.abspath(out))
    stem = os.path.splitext(os.path.basename(out))[0]
    written = []
    # Figures are drawn in a scratch folder first, so bad input found midway leaves nothing behind.
    with tempfile.TemporaryDirectory() as tmp:
        page, pngs = build_page(config, tmp)
        os.makedirs(folder, exist_ok=True)
        if ext == ".md":
            # PNGs beside the page, in a folder named after it so two reports can share a folder.
            figures = os.path.join(folder, f"{stem}_figures")
            os.makedirs(figures, exist_ok=True)
            names = {}
            for png in pngs:
                target = os.path.join(figures, os.path.basename(png))
                with open(png, "rb") as f:
                    new_file.write_bytes(target, f.read())  # never through an old figure's other names
                names[png] = os.path.relpath(target, folder)
                written.append(target)
            text = render_markdown(page, names)
        else:
            text = render_html(page)
    new_file.write_bytes(out, text.encode("utf-8"))  # a new file: a hard link to an input keeps its bytes
    return [out, *written]


# ----------------------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="prepack report", description=__doc__.split("\n\n")[0])
    p.add_argument("--shards", action="extend", nargs="+", default=[], metavar="DIR",
                   help="a shard set folder (with manifest.json) or an OUTPUT root with L*/ folders; repeatable")
    p.add_argument("--metrics", action="extend", nargs="+", default=[], metavar="[LABEL=]PATH",
                   help="training metrics JSONL from `prepack train`; repeatable, labelled by file name or LABEL")
    p.add_argument("--preflight", action="extend", nargs="+", default=[], metavar="PATH",
                   help="a preflight.json (or its folder) to include")
    p.add_argument("--batch-size", action="extend", nargs="+", type=int, metavar="B",
                   help="batch sizes for steps and throughput gain in the shard tables "
                        f"(default: the training runs' own, from --metrics; without runs {DEFAULT_BATCH_SIZES[0]})")
    p.add_argument("--budget", type=float, default=None, metavar="TOKENS",
                   help="target-token budget for the budget view (default: the most every run reached)")
    p.add_argument("--warmup-steps", type=int, default=1, metavar="N",
                   help="time each run's first N steps (compilation) as its median step (default 1, as the "
                        "trainer's summary leaves step 1 out; 0 counts them as logged). Timing only: not the "
                        "learning-rate warmup of prepack train --warmup-steps")
    p.add_argument("--generations", action="extend", nargs="+", default=[], metavar="[LABEL=]PATH",
                   help="generations JSONL files from `prepack generate` (e.g. a base run and a tuned run) on the same "
                        "prompts: their scores side by side, printed (and on the page with --output)")
    p.add_argument("--title", default="tunix-prepack report")
    p.add_argument("--output", metavar="FILE.html|FILE.md", help="the page (required unless only --generations are given)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --output page")
    return p


def _check_locations(args: argparse.Namespace) -> None:
    """Every path names a place before anything is read; the page is a local file."""
    from prepack.storage import is_gcs, location_problem, output_rule

    if is_gcs(args.output) or location_problem(args.output):
        raise ReportError(f"--output {location_problem(args.output) or repr(args.output)}: the report is written to a "
                          "local file; name one")
    for path in args.shards:
        if location_problem(path):
            raise ReportError(f"--shards {location_problem(path)}")
    try:  # the one string the rule judges and the page is written at
        args.output = output_rule.output_path("--output", args.output)
    except output_rule.OutputPathError as e:
        raise ReportError(str(e)) from None
    refused = output_rule.refusal(run_paths(args))
    if refused:
        raise ReportError(refused)


def run_paths(args: argparse.Namespace) -> Any:
    """What a report reads and writes, for the one output rule (prepack/storage/output_rule.py):
    the page apart from every set, metrics, preflight and generations file it reads."""
    from prepack.storage import output_rule

    inputs = output_rule.input_places("--shards", args.shards)
    for flag, given in (("--metrics", args.metrics), ("--preflight", args.preflight), ("--generations", args.generations)):
        inputs += output_rule.input_places(flag, [_split_label(raw)[1] for raw in given])
    return output_rule.RunPaths(inputs, [output_rule.Place("--output", args.output)])


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if not (args.shards or args.metrics or args.preflight or args.generations):
            raise ReportError("nothing to report: give --shards, --metrics, --preflight and/or --generations")
        if args.generations:
            from apps import compare_generations

            try:
                print(compare_generations.render_text(compare_generations.load_all(args.generations)))
            except compare_generations.GenerationsError as e:
                raise ReportError(str(e)) from None
            if args.output is None and not (args.shards or args.metrics or args.preflight):
                return 0
        if args.output is None:
            raise ReportError("--output FILE.html|FILE.md is required for --shards, --metrics and --preflight")
        _check_locations(args)
        batch_sizes = tuple(sorted(set(args.batch_size or ())))
        if any(b <= 0 for b in batch_sizes):
            raise ReportError(f"--batch-size must be positive, got {list(batch_sizes)}")
        if args.warmup_steps < 0:
            raise ReportError("--warmup-steps must be >= 0")
        if args.budget is not None and args.budget <= 0:
            raise ReportError("--budget must be positive")
        if not args.overwrite:
            from prepack.overwrite import refusal

            exists = refusal([args.output], "replace an existing report")
            if exists:
                raise ReportError(exists)
        config = ReportConfig(output=args.output, shards=tuple(args.shards), metrics=tuple(args.metrics),
                              preflight=tuple(args.preflight), batch_sizes=batch_sizes, budget=args.budget,
                              warmup_steps=args.warmup_steps, title=args.title, generations=tuple(args.generations))
        from apps.plots import matplotlib_missing

        if matplotlib_missing():
            raise ReportError(matplotlib_missing())
        written = write_report(config)
    except ReportError as e:
        print(f"prepack report: error: {e}", file=sys.stderr)
        return 2
    print("wrote " + ", ".join(written))
    return 0
