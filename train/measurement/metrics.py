"""The metrics JSONL of `prepack train` (and `--tensorboard`'s scalars), and its console progress lines.

One JSON line per optimizer step, then eval lines and one summary line:
  {"step", "micro_steps", "loss", "loss_mean", "grad_norm", "clipped", "learning_rate", "step_time_s", "tokens",
   "target_tokens", "target_tokens_per_s", "density", "tokens_per_s_per_chip", "mfu", ...}
`tokens_per_s_per_chip` and `mfu` (null where the chip's peak is unknown) come from train/measurement/mfu.py.
  {"eval": {"step", "loss", "loss_mean", "target_tokens", "batches", "time_s"}}
  {"eval_generate": {"step", "prompts", "exact_match", "reference_nll", ...}}  (--eval-generate: train/generation/eval_generate.py)
`loss_mean` names what `loss` is: "token" (the mean over the batch's target tokens) or
"example" (the mean of its examples' token means; those records add `token_loss`, the token
mean of the same batch, and `device_examples`, the examples the loss counted: fractional when
a split example's pieces fall in different batches).
  {"summary": {...}}
The run's objective (train/objectives/) says what else its records hold: a DPO run's `loss` is
the DPO loss (its `loss_mean` "pair": the mean over the step's pairs), and its step and eval
records add TRL's names at the top level (`rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`,
train/objectives/dpo_metrics.py) and `device_pairs`; `examples` counts pairs.
`grad_norm` is the global norm before clipping, `clipped` whether --max-grad-norm scaled it,
`learning_rate` the rate the step's update used. With --grad-accum-steps K a step trains K
micro-batches of batch_size rows: tokens and counts are the step's (K * B rows), `micro_steps`
counts micro-batches since the run began.

Steps are not synchronized one by one (that would stall an accelerator's queue): the records
are fetched from the device every --log-every steps (and before checkpoints and evals, and at
the end), and step_time_s is the fetched window's wall time per step, input wait included;
step 1's is the time to its dispatch, which includes compilation (where --remat auto compiled
the step before the loop, that compile is added to it), and it is left out of the summary's
means and rates.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import numpy as np

from prepack.storage import new_file, places
from train import objectives
from train.measurement import divergence
from train.measurement.mfu import Throughput


def batch_counts(batch: Mapping[str, np.ndarray], segments_per_example: int = 1) -> dict[str, int]:
    """Host-side counts of one [B, L] batch (numpy, before it goes to the device); an example is
    `segments_per_example` segments of a row (the objective's: a preference pair's two sides are one)."""
    seg = np.asarray(batch["segment_ids"])
    loss_mask = np.asarray(batch["loss_mask"])
    length = seg.shape[-1]
    rows = seg.size // length  # [B, L], or [B, K, L]: K micro-batches of B rows
    return {
        "rows": int(rows),
        "seq_len": int(length),
        "tokens": int(np.count_nonzero(seg)),
        # What the loss counts: input_mask[..., 1:] (column 0 can never be predicted).
        "target_tokens": int(np.count_nonzero(loss_mask[..., 1:])),
        "examples": int((seg.max(axis=-1) // segments_per_example).sum()),
        **({"target_tokens_by_source": np.bincount(np.asarray(batch["source_ids"])[..., 1:][loss_mask[..., 1:] != 0],
                                                   minlength=1).tolist()} if "source_ids" in batch else {}),
    }


def drop_records_after(path: str, step: int) -> int:
    """Removes the step and eval records after `step` from a metrics JSONL (atomically); returns how many.

    A run that resumes from step k redoes the steps after k that an interrupted run had
    already logged; without this the file would hold two records for those steps.
    """
    if not os.path.exists(path):
        return 0
    kept, dropped = [], 0
    with open(path) as f:
        for line in f:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                kept.append(line)  # not ours to judge; keep it
                continue
            at = record.get("eval", {}).get("step") if isinstance(record.get("eval"), dict) else record.get("step")
            if isinstance(at, int) and at > step and "summary" not in record:
                dropped += 1
            else:
                kept.append(line)
    if dropped:
        with new_file.new_file(path, "w") as f:
            f.writelines(kept)
    return dropped


def by_source_record(names: list[str], counts: Mapping[str, Any], aux: Mapping[str, Any]) -> dict[str, Any]:
    """A step's loss_by_source (None for a source with no target in the batch, or when the loss
    gives no per-source sums) and target_tokens_by_source, name -> value."""
    host = list(counts.get("target_tokens_by_source", [])) + [0] * (len(names) + 1)
    nll, targets = aux.get("nll_by_source"), aux.get("targets_by_source")
    loss = {}
    for i, name in enumerate(names, start=1):
        t = float(targets[i]) if targets is not None else 0.0
        loss[name] = divergence.finite_or_none(float(nll[i]) / t) if nll is not None and t > 0 else None
    return {"loss_by_source": loss, "target_tokens_by_source": {name: int(host[i]) for i, name in enumerate(names, start=1)}}


def process_age_s() -> float | None:
    """Seconds since this process started, from Linux's /proc (10 ms ticks); None where there is none."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            after_name = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces: fields 3.. follow ")"
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
        # field 22: starttime, in ticks since boot; both clocks tick in hundredths
        return round(uptime - int(after_name[19]) / os.sysconf("SC_CLK_TCK"), 2)
    except (OSError, ValueError, IndexError):
        return None


def window_step_times(start: float, dispatched: list[float], end: float, first: bool) -> list[float]:
    """Each step's share of a fetched window [start, end]: the window's mean, except that a
    window opening the run gives its first step the time up to that step's dispatch (the jit
    compile happens in that call) and shares the rest among the others."""
    n = len(dispatched)
    if first and n > 1:
        head = dispatched[0] - start
        return [head] + [(end - dispatched[0]) / (n - 1)] * (n - 1)
    return [(end - start) / n] * n


class TensorBoard:
    """--tensorboard DIR: the JSONL's figures as TensorBoard scalars (tensorboardX), written at each fetch."""

    SCALARS = ("loss", "token_loss", "grad_norm", "learning_rate", "clipped", "step_time_s", "target_tokens_per_s",
               "tokens_per_s", "density", "target_density", "input_wait_s")

    def __init__(self, logdir: str, objective_scalars: tuple[str, ...] = ()):
        """objective_scalars: the objective's own step fields (its metric names), after SCALARS."""
        from tensorboardX import SummaryWriter  # here: a missing package is found before any work

        logdir = places.resolved(logdir)  # the place the output rule judged
        self._make_writer = lambda: SummaryWriter(logdir=logdir)
        self._writer: Any = None
        self.scalars = self.SCALARS + tuple(objective_scalars)

    @property
    def writer(self) -> Any:
        """tensorboardX's writer, made at the first scalar: it creates the folder and an event
        file at once, and a run that dies before step 1 should leave neither."""
        if self._writer is None:
            self._writer = self._make_writer()
        return self._writer

    def step(self, record: Mapping[str, Any]) -> None:
        for key in self.scalars:
            value = record.get(key)
            if isinstance(value, (int, float)) and value is not None:
                self.writer.add_scalar(f"train/{key}", float(value), record["step"])
        for name, value in (record.get("loss_by_source") or {}).items():
            if value is not None:
                self.writer.add_scalar(f"train/loss_by_source/{name}", float(value), record["step"])

    def eval(self, record: Mapping[str, Any]) -> None:
        if record.get("loss") is not None:
            self.writer.add_scalar("eval/loss", float(record["loss"]), record["step"])

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


class MetricsRecorder:
    """Collects per-step numbers and writes the JSONL, flushed at every fetch (so a crash keeps them).

    Steps are not waited for: the trainer hands over each step's device results as it dispatches
    it (`step_dispatched`) and the recorder reads them from the device only when asked (`fetch`:
    every `log_every` steps, before checkpoints and evals, at the end). A fetched window of steps
    gets its wall time shared out: step 1's is the time to its dispatch (the compile happens
    there), the others get the window's mean."""

    def __init__(
        self,
        path: str | None,
        static: Mapping[str, Any] | None = None,
        log_every: int = 10,
        out: TextIO | None = None,
        resume_from: int | None = None,
        resume_note: Mapping[str, Any] | None = None,
        last_step: int | None = None,
        nan_policy: str = divergence.STOP,
        throughput: Throughput | None = None,
        grad_accum_steps: int = 1,
        tensorboard: str | None = None,
        objective: objectives.Objective = objectives.DEFAULT,
    ):
        """resume_from=k: the run continues after step k of a checkpoint; step numbers go on from k+1
        and the JSONL is appended to (its records of steps after k, which the resumed run redoes,
        are dropped first, so each step appears once). objective: the run's (train/objectives/), which
        says what an example is, its records' own fields and its part of the console line."""
        self.path = places.resolved(path) if path else path  # the place the output rule judged (train/run_config/outputs.py)
        self.static = dict(static or {})
        # A mixture set's source names, 1..N in the mixture's order: each step then logs
        # loss_by_source and target_tokens_by_source (name -> value).
        self.source_names: list[str] = list(self.static.pop("source_names", None) or [])
        self.log_every = log_every
        self.last_step = last_step  # printed even when not a multiple of log_every
        self.nan_policy = nan_policy
        self.grad_accum_steps = grad_accum_steps
        self.stopped: dict[str, Any] | None = None  # why the run ended early (summary["stopped"])
        self.out = out if out is not None else sys.stderr
        self.throughput = throughput or Throughput()
        self.objective = objective
        self._model_flops: list[float | None] = []  # per step, for the summary's mfu
        self.first_step = (resume_from or 0) + 1
        # Functions of a finished step record returning more fields for it: each row is
        # extended when its step time is known.
        self.row_fields: list[Callable[[Mapping[str, Any]], Mapping[str, Any]]] = []
        # The JSONL is opened at its first record (`_open`): a run that dies before it (out of
        # memory while compiling) leaves no empty file, and no old one replaced.
        self._file: TextIO | None = None
        self._appends = bool(resume_from)
        self._closed = False
        if self.path and resume_from:
            dropped = drop_records_after(self.path, resume_from)
            self._write({"resume": {"from_step": resume_from, "dropped_records": dropped, **dict(resume_note or {})}})
        self._board = TensorBoard(tensorboard, objective.metric_names) if tensorboard else None
        self.static_extra: dict[str, Any] = {}  # summary-only facts learnt during the run
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self.fetches = 0
        self.eval_generations: list[dict[str, Any]] = []  # --eval-generate records
        self._clock: float | None = None
        self._window_start: float | None = None
        self._pending: dict[str, Any] | None = None
        self._unfetched: list[tuple[dict[str, Any], Any, float]] = []  # (host counts, device aux, dispatch end)
        self._eval_acc: list[tuple[float, float, float, float]] = []
        self._eval_sums: dict[str, float] = {}  # the eval batches' sums of the objective's own metrics
        self.started = time.perf_counter()
        # Seconds spent compiling the step before the loop (--remat auto's plan compiles the
        # executable step 1 runs): step 1's time includes them, as it would the compile itself.
        self.compiled_before_s = 0.0
        # The process's age at step 1's dispatch: what the user waited from the command to step 1
        # (imports, weights, the compile or the cache's load, wherever they ran).
        self.launch_to_first_step_s: float | None = None

    def charge_first_step(self, seconds: float) -> None:
        """Time spent before the loop on step 1's behalf (its compile), added to step 1's time."""
        self.compiled_before_s += seconds

    def _write(self, record: Mapping[str, Any], flush: bool = True) -> None:
        if not self.path or self._closed:
            return
        line = json.dumps(record) + "\n"
        if self._file is None:
            self._file = self._open(line)
        else:
            self._file.write(line)
        if flush:
            self._file.flush()

    def _open(self, first_line: str) -> TextIO:
        """The JSONL, opened with its first record written. A resumed run appends to its own
        file (train/run_config/outputs.py checked before any work that it has no other name and
        is no input); otherwise the file is new (prepack/storage/new_file.py), renamed into place
        once it holds the record: an old file, or another name of it, is never written into."""
        assert self.path
        if self._appends and os.path.exists(self.path):
            f = open(self.path, "a")
            f.write(first_line)
            return f
        fd, tmp = new_file.create_beside(self.path)
        f = os.fdopen(fd, "w")
        try:
            f.write(first_line)
            f.flush()
            os.replace(tmp, self.path)
        except BaseException:
            f.close()
            with contextlib.suppress(OSError):
                os.remove(tmp)
            raise
        return f

    def reset_clock(self) -> None:
        """Time not charged to any step (an eval, the compile's announcement) ends here."""
        self._clock = self._window_start = time.perf_counter()

    @property
    def dispatched(self) -> int:
        """Steps handed over in this process, fetched or not."""
        return len(self.steps) + len(self._unfetched)

    def next_step(self) -> int:
        return self.first_step + self.dispatched

    def batch_arrived(self, batch: Mapping[str, np.ndarray]) -> None:
        now = time.perf_counter()
        counts = batch_counts(batch, self.objective.segments_per_example)
        counts["input_wait_s"] = now - (self._clock if self._clock is not None else now)
        counts["model_flops"] = self.throughput.batch_flops(batch)
        self._pending = counts

    def step_dispatched(self, aux: Mapping[str, Any]) -> None:
        """The step's results as device arrays; nothing waits for them here."""
        now = time.perf_counter()
        if self.launch_to_first_step_s is None and not self.steps and not self._unfetched:
            self.launch_to_first_step_s = process_age_s()
        if self._window_start is None:
            self._window_start = self.started
        self._unfetched.append((self._pending or {}, aux, now))
        self._pending = None
        self._clock = now

    def wants_fetch(self, step: int) -> bool:
        """The progress steps: the first, every log_every, the last (log_every 0: none but the end)."""
        return bool(self.log_every) and (step % self.log_every == 0 or step in (self.first_step, self.last_step))

    def step_done(self, aux: Mapping[str, Any]) -> None:
        """A step waited for: dispatched and fetched at once."""
        self.step_dispatched(aux)
        self.fetch()

    def fetch(self) -> dict[str, Any] | None:
        """Reads the unfetched steps' results from the device (waiting for them), writes their
        records and prints the progress line of the window's last step and of every non-finite
        step. Under --nan-policy stop, the records end at the first non-finite step, which is
        returned (the caller stops the run); None otherwise."""
        if not self._unfetched or self.stopped is not None:
            self._unfetched = []
            return None
        import jax

        window, self._unfetched = self._unfetched, []
        host_aux = jax.device_get([aux for _, aux, _ in window])
        now = time.perf_counter()
        start = self._window_start if self._window_start is not None else self.started
        first = not self.steps
        times = window_step_times(start, [t for _, _, t in window], now, first=first)
        if first:
            times[0] += self.compiled_before_s
        self._window_start = self._clock = now
        self.fetches += 1
        stop = None
        for (counts, _, _), aux, step_time in zip(window, host_aux, times):
            record = self._record(counts, aux, step_time)
            self.steps.append(record)
            self._write(record, flush=False)
            if self._board is not None:
                self._board.step(record)
            if record.get("nonfinite"):
                self._print(record)
                if self.nan_policy == divergence.STOP:
                    stop = record
                    self.stop(record["step"], record["nonfinite"])
                    break
        if stop is None and self.log_every:
            self._print(self.steps[-1])
        if self._file is not None:
            self._file.flush()
        if self._board is not None:
            self._board.flush()
        return stop

    def _record(self, pending: Mapping[str, Any], aux: Mapping[str, Any], step_time: float) -> dict[str, Any]:
        cells = pending.get("rows", 0) * pending.get("seq_len", 0)
        target = pending.get("target_tokens", 0)
        tokens = pending.get("tokens", 0)
        step = self.first_step + len(self.steps)
        record = {
            "step": step,
            "micro_steps": step * self.grad_accum_steps,  # micro-batches trained since the start of the run
            "loss": divergence.finite_or_none(aux["loss"]),
            "grad_norm": divergence.finite_or_none(aux["grad_norm"]) if "grad_norm" in aux else None,
            "learning_rate": float(aux["learning_rate"]) if "learning_rate" in aux else None,
            "clipped": bool(aux["clipped"]) if "clipped" in aux else None,
            "step_time_s": step_time,
            "tokens": tokens,
            "target_tokens": target,
            "target_tokens_per_s": target / step_time if step_time > 0 else 0.0,
            "tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "density": tokens / cells if cells else 0.0,
            "target_density": target / cells if cells else 0.0,
            "examples": pending.get("examples", 0),
            "input_wait_s": pending.get("input_wait_s", 0.0),
            # Cross-check: the target count the loss saw on the device equals the host's count.
            "device_target_tokens": int(round(float(aux["target_tokens"]))),
            **self.throughput.fields(tokens, step_time, pending.get("model_flops")),
        }
        self._model_flops.append(pending.get("model_flops"))
        if "examples" in aux:  # --loss-mean example: the token mean of the same batch, to compare
            target_sum = float(aux["target_tokens"])
            record["token_loss"] = divergence.finite_or_none(float(aux["nll_sum"]) / target_sum) if target_sum > 0 else None
            record["device_examples"] = float(aux["examples"])
        reason = divergence.nonfinite_reason({"loss": aux["loss"], "grad_norm": aux.get("grad_norm")}, aux.get("lora_finite"))
        if reason:
            record["nonfinite"] = reason
            # apply_if_finite rejects updates with non-finite gradients (train/step/optimizer.py); an
            # update that overflowed finite values was applied.
            record["skipped"] = (self.nan_policy == divergence.SKIP_STEP
                                 and divergence.nonfinite_reason({"loss": aux["loss"], "grad_norm": aux.get("grad_norm")}) is not None)
        record.update(self.objective.step_fields(aux))
        if self.source_names:
            record.update(by_source_record(self.source_names, pending, aux))
        for fields in self.row_fields:
            record.update(fields(record))
        record.update(self.static)
        return record

    def _print(self, record: Mapping[str, Any]) -> None:
        reason = record.get("nonfinite")
        loss = f"{record['loss']:.4f}" if record["loss"] is not None else f"non-finite ({reason})"
        kind = self.objective.loss_label(str(self.static.get("loss_mean")))
        lr = f"  lr {record['learning_rate']:.3g}" if record.get("learning_rate") is not None else ""
        print(
            f"step {record['step']}: loss {loss}{kind}  {record['step_time_s']:.3f}s  "
            f"{record['target_tokens_per_s']:.0f} target tok/s  density {record['density']:.3f}{lr}"
            + self.objective.progress(record)
            + ("  (update skipped: --nan-policy skip-step)" if record.get("skipped") else ""),
            file=self.out,
            flush=True,
        )

    def stop(self, step: int, reason: str) -> None:
        """The run ends here (--nan-policy stop); the summary line records why."""
        self.stopped = {"step": step, "reason": reason, "nan_policy": self.nan_policy}

    def eval_batch_done(self, aux: Mapping[str, Any]) -> None:
        # The sums the loss's mean divides, so the eval loss is that mean over the whole set.
        weighted, weights = self.objective.eval_loss_terms(aux)
        self.objective.add_eval_sums(self._eval_sums, aux)
        self._eval_acc.append((weighted, weights, float(aux["target_tokens"]), float(aux["loss"])))

    def eval_done(self, elapsed: float) -> None:
        if not self._eval_acc:
            return
        nll, weights, targets, losses = (np.array(v) for v in zip(*self._eval_acc))
        record = {
            "step": self.first_step - 1 + len(self.steps),
            # Over the whole eval set, by the run's --loss-mean: token-weighted, or example-weighted
            # (Tunix's own eval loss is a mean of batch means).
            "loss": divergence.finite_or_none(nll.sum() / max(weights.sum(), 1e-8)),
            **({"loss_mean": self.static["loss_mean"]} if "loss_mean" in self.static else {}),
            "mean_batch_loss": float(losses.mean()),
            "target_tokens": int(targets.sum()),
            "batches": len(losses),
            "time_s": elapsed,
            **self.objective.eval_fields(self._eval_sums),
        }
        self._eval_acc, self._eval_sums = [], {}
        self.evals.append(record)
        self._write({"eval": record})
        if self._board is not None:
            self._board.eval(record)
            self._board.flush()
        print(f"eval after step {record['step']}: loss {record['loss'] if record['loss'] is None else format(record['loss'], '.4f')} over {record['target_tokens']} target tokens", file=self.out)

    def eval_generate_done(self, record: Mapping[str, Any]) -> None:
        """--eval-generate: one scored generation of the held-out prompts (train/generation/eval_generate.py)."""
        self.eval_generations.append(dict(record))
        self._write({"eval_generate": dict(record)})
        rate = lambda key: "-" if record.get(key) is None else f"{record[key]:.1%}"  # noqa: E731
        nll = record.get("reference_nll")
        calls = f", valid calls {rate('valid_call_rate')}, full calls {rate('full_call_accuracy')}" \
            if record.get("valid_call_rate") is not None else ""
        print(f"eval-generate after step {record['step']}: exact match {rate('exact_match')} of {record['prompts']} prompts, "
              f"reference NLL {'-' if nll is None else format(nll, '.3f')}{calls} ({record['time_s']:.1f} s)",
              file=self.out, flush=True)
        self.reset_clock()  # its time is not the next step's

    def summary(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        steps = self.steps
        timed = steps[1:]  # step 1 carries the compile
        times = np.array([s["step_time_s"] for s in timed]) if timed else np.array([])
        out: dict[str, Any] = {
            "steps": len(steps),  # in this process (a resumed run starts at first_step)
            "first_step": self.first_step,
            "grad_accum_steps": self.grad_accum_steps,
            "micro_steps": len(steps) * self.grad_accum_steps,  # micro-batches trained in this process
            "clipped_steps": sum(1 for s in steps if s.get("clipped")),
            "final_learning_rate": steps[-1].get("learning_rate") if steps else None,
            "fetches": self.fetches,  # how often the host waited for the device's step results
            "tokens": int(sum(s["tokens"] for s in steps)),
            "target_tokens": int(sum(s["target_tokens"] for s in steps)),
            "examples": int(sum(s["examples"] for s in steps)),
            "first_loss": steps[0]["loss"] if steps else None,
            "final_loss": steps[-1]["loss"] if steps else None,  # None when not finite
            "skipped_steps": sum(1 for s in steps if s.get("skipped")),
            "stopped": self.stopped,
            "first_step_time_s": steps[0]["step_time_s"] if steps else None,
            "launch_to_first_step_s": self.launch_to_first_step_s,
            "timed_steps": len(timed),
            "mean_step_time_s": float(times.mean()) if len(times) else None,
            "median_step_time_s": float(np.median(times)) if len(times) else None,
            "p10_step_time_s": float(np.percentile(times, 10)) if len(times) else None,
            "p90_step_time_s": float(np.percentile(times, 90)) if len(times) else None,
            "target_tokens_per_s": float(sum(s["target_tokens"] for s in timed) / times.sum()) if len(times) else None,
            "tokens_per_s": float(sum(s["tokens"] for s in timed) / times.sum()) if len(times) else None,
            **self._throughput_summary(timed, float(times.sum()) if len(times) else 0.0),
            "mean_density": float(np.mean([s["density"] for s in steps])) if steps else None,
            "mean_target_density": float(np.mean([s["target_density"] for s in steps])) if steps else None,
            "mean_input_wait_s": float(np.mean([s["input_wait_s"] for s in timed])) if timed else None,
            "eval_loss": self.evals[-1]["loss"] if self.evals else None,
            "evals": self.evals,
            **({"eval_generate": self.eval_generations[-1]} if self.eval_generations else {}),
            "wall_time_s": time.perf_counter() - self.started,
        }
        out.update(self.static)
        out.update(self.static_extra)
        out.update(extra or {})
        return out

    def _throughput_summary(self, timed: list[dict[str, Any]], seconds: float) -> dict[str, float | None]:
        """tokens_per_s_per_chip and mfu over the timed steps (null without any)."""
        if not timed or seconds <= 0:
            return {"tokens_per_s_per_chip": None, "mfu": None}
        flops = self._model_flops[1:]
        total = None if any(f is None for f in flops) else float(sum(flops))
        return self.throughput.fields(sum(s["tokens"] for s in timed), seconds, total)

    def close(self, summary: Mapping[str, Any]) -> None:
        self._write({"summary": dict(summary)})
        self._closed = True
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._board is not None:
            self._board.close()
            self._board = None
