"""The metrics JSONL of `prepack train` and its console progress lines.

One JSON line per optimizer step, then eval lines and one summary line:
  {"step", "loss", "loss_mean", "grad_norm", "step_time_s", "tokens", "target_tokens", "target_tokens_per_s", "density",
   "tokens_per_s_per_chip", "mfu", ...}
`tokens_per_s_per_chip` and `mfu` (null where the chip's peak is unknown) come from train/mfu.py.
  {"eval": {"step", "loss", "loss_mean", "target_tokens", "batches", "time_s"}}
`loss_mean` names what `loss` is: "token" (the mean over the batch's target tokens) or
"example" (the mean of its examples' token means; those records add `token_loss`, the token
mean of the same batch, and `device_examples`, the examples the loss counted: fractional when
a split example's pieces fall in different batches).
  {"summary": {...}}
Every step is synchronized (the loss's aux is awaited) so that step_time_s is the
wall time from the previous step's end to this one's, input wait included; step 1
includes compilation and is left out of the summary's means and rates.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np

from train import divergence
from train.mfu import Throughput


def batch_counts(batch: Mapping[str, np.ndarray]) -> dict[str, int]:
    """Host-side counts of one [B, L] batch (numpy, before it goes to the device)."""
    seg = np.asarray(batch["segment_ids"])
    loss_mask = np.asarray(batch["loss_mask"])
    rows, length = seg.shape
    return {
        "rows": int(rows),
        "seq_len": int(length),
        "tokens": int(np.count_nonzero(seg)),
        # What the loss counts: input_mask[:, 1:] (column 0 can never be predicted).
        "target_tokens": int(np.count_nonzero(loss_mask[:, 1:])),
        "examples": int(seg.max(axis=1).sum()),
        **({"target_tokens_by_source": np.bincount(np.asarray(batch["source_ids"])[:, 1:][loss_mask[:, 1:] != 0],
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
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, path)
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


class MetricsRecorder:
    """Collects per-step numbers and writes the JSONL (flushed per line, so a crash keeps them)."""

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
    ):
        """resume_from=k: the run continues after step k of a checkpoint; step numbers go on from k+1
        and the JSONL is appended to (its records of steps after k, which the resumed run redoes,
        are dropped first, so each step appears once)."""
        self.path = path
        self.static = dict(static or {})
        # A mixture set's source names, 1..N in the mixture's order: each step then logs
        # loss_by_source and target_tokens_by_source (name -> value).
        self.source_names: list[str] = list(self.static.pop("source_names", None) or [])
        self.log_every = log_every
        self.last_step = last_step  # printed even when not a multiple of log_every
        self.nan_policy = nan_policy
        self.stopped: dict[str, Any] | None = None  # why the run ended early (summary["stopped"])
        self.out = out if out is not None else sys.stderr
        self.throughput = throughput or Throughput()
        self._model_flops: list[float | None] = []  # per step, for the summary's mfu
        self.first_step = (resume_from or 0) + 1
        self._file: TextIO | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            if resume_from:
                dropped = drop_records_after(path, resume_from)
                self._file = open(path, "a")
                self._write({"resume": {"from_step": resume_from, "dropped_records": dropped, **dict(resume_note or {})}})
            else:
                self._file = open(path, "w")
        self.static_extra: dict[str, Any] = {}  # summary-only facts learnt during the run
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self._clock: float | None = None
        self._pending: dict[str, Any] | None = None
        self._eval_acc: list[tuple[float, float, float, float]] = []
        self.started = time.perf_counter()

    def _write(self, record: Mapping[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()

    def reset_clock(self) -> None:
        self._clock = time.perf_counter()

    def batch_arrived(self, batch: Mapping[str, np.ndarray]) -> None:
        now = time.perf_counter()
        counts = batch_counts(batch)
        counts["input_wait_s"] = now - (self._clock if self._clock is not None else now)
        counts["model_flops"] = self.throughput.batch_flops(batch)
        self._pending = counts

    def step_done(self, aux: Mapping[str, Any]) -> None:
        now = time.perf_counter()
        pending = self._pending or {}
        self._pending = None
        step_time = now - (self._clock if self._clock is not None else self.started)
        self._clock = now
        cells = pending.get("rows", 0) * pending.get("seq_len", 0)
        target = pending.get("target_tokens", 0)
        tokens = pending.get("tokens", 0)
        record = {
            "step": self.first_step + len(self.steps),
            "loss": divergence.finite_or_none(aux["loss"]),
            "grad_norm": divergence.finite_or_none(aux["grad_norm"]) if "grad_norm" in aux else None,
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
        reason = divergence.nonfinite_reason({"loss": aux["loss"], "grad_norm": aux.get("grad_norm")})
        if reason:
            record["nonfinite"] = reason
            # apply_if_finite rejects updates with non-finite gradients (train/optimizer.py).
            record["skipped"] = self.nan_policy == divergence.SKIP_STEP
        if self.source_names:
            record.update(by_source_record(self.source_names, pending, aux))
        record.update(self.static)
        self.steps.append(record)
        self._write(record)
        step = record["step"]
        if reason or (self.log_every and (step % self.log_every == 0 or step in (self.first_step, self.last_step))):
            loss = f"{record['loss']:.4f}" if record["loss"] is not None else f"non-finite ({reason})"
            kind = " (example mean)" if self.static.get("loss_mean") == "example" else ""
            print(
                f"step {step}: loss {loss}{kind}  {step_time:.3f}s  "
                f"{record['target_tokens_per_s']:.0f} target tok/s  density {record['density']:.3f}"
                + ("  (update skipped: --nan-policy skip-step)" if record.get("skipped") else ""),
                file=self.out,
                flush=True,
            )

    def stop(self, step: int, reason: str) -> None:
        """The run ends here (--nan-policy stop); the summary line records why."""
        self.stopped = {"step": step, "reason": reason, "nan_policy": self.nan_policy}

    def eval_batch_done(self, aux: Mapping[str, Any]) -> None:
        # The sums the loss's mean divides, so the eval loss is that mean over the whole set.
        if "examples" in aux:
            weighted, weights = float(aux["example_nll_sum"]), float(aux["examples"])
        else:
            weighted, weights = float(aux["nll_sum"]), float(aux["target_tokens"])
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
        }
        self._eval_acc = []
        self.evals.append(record)
        self._write({"eval": record})
        print(f"eval after step {record['step']}: loss {record['loss'] if record['loss'] is None else format(record['loss'], '.4f')} over {record['target_tokens']} target tokens", file=self.out)

    def summary(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        steps = self.steps
        timed = steps[1:]  # step 1 carries the compile
        times = np.array([s["step_time_s"] for s in timed]) if timed else np.array([])
        out: dict[str, Any] = {
            "steps": len(steps),  # in this process (a resumed run starts at first_step)
            "first_step": self.first_step,
            "tokens": int(sum(s["tokens"] for s in steps)),
            "target_tokens": int(sum(s["target_tokens"] for s in steps)),
            "examples": int(sum(s["examples"] for s in steps)),
            "first_loss": steps[0]["loss"] if steps else None,
            "final_loss": steps[-1]["loss"] if steps else None,  # None when not finite
            "skipped_steps": sum(1 for s in steps if s.get("skipped")),
            "stopped": self.stopped,
            "first_step_time_s": steps[0]["step_time_s"] if steps else None,
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
        if self._file is not None:
            self._file.close()
            self._file = None
