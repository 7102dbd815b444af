"""LoRA SFT with Tunix's PeftTrainer on a pre-packed shard set (packed or one example per row).

Wiring (google-tunix 0.1.7, see ../shared/research/tunix.md):
- data: loaders.make_dataset -> dicts of int32 [B, L] numpy arrays; the trainer
  consumes them as they are (Tunix does no batching or collation).
- gen_model_input_fn (train/model_inputs.py) runs inside the jitted step and builds
  the block-causal mask on the device; the loss (train/loss.py) is the token mean
  of the masked NLL, returning its sum and token count as aux.
- mesh: `--mesh fsdp=F,tp=T` makes a ('fsdp', 'tp') mesh. Tunix shards each batch
  along 'fsdp' and pre-shards the optimizer only when the mesh is active through the
  legacy `with mesh:` context (jax.set_mesh leaves pxla's thread-local mesh empty in
  jax 0.10.2), so training runs inside `with mesh:`.

Metrics: one JSON line per optimizer step, then eval lines and one summary line:
  {"step", "loss", "step_time_s", "tokens", "target_tokens", "target_tokens_per_s", "density", ...}
  {"eval": {"step", "loss", "target_tokens", "batches", "time_s"}}
  {"summary": {...}}
Every step is synchronized (the loss's aux is awaited) so that step_time_s is the
wall time from the previous step's end to this one's, input wait included; step 1
includes compilation and is left out of the summary's means and rates.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TextIO

import numpy as np

log = logging.getLogger(__name__)

MESH_AXES = ("fsdp", "tp")


class TrainError(ValueError):
    """A training run that cannot start as configured; the message says what to change."""


@dataclasses.dataclass
class TrainConfig:
    shards: str
    model: str = "tiny"
    lora_rank: int = 8
    lora_alpha: float | None = None  # default 2 * rank
    batch_size: int = 8  # global rows per step
    steps: int = 100
    learning_rate: float = 1e-4
    seed: int = 0
    mesh: str | None = None  # "fsdp=F,tp=T"
    eval_shards: str | None = None
    eval_every: int | None = None  # default: only before the first and after the last step
    eval_batches: int | None = None  # default: one pass over the eval set
    weights: str | None = None  # HF safetensors folder, "random", "gguf"; see train/models.py
    dtype: str | None = None  # parameter dtype; default per model (bf16 real, f32 tiny)
    metrics_out: str | None = None
    loss: str = "masked"  # "masked" (train/loss.py) or "tunix-default" (for comparisons)
    read_threads: int = 4
    config_overrides: dict[str, Any] | None = None  # e.g. {"sliding_window_size": 4} for tests
    log_every: int = 10  # console progress line every N steps (0: none)


# ----------------------------------------------------------------------------- mesh


def parse_mesh(spec: str | None) -> dict[str, int] | None:
    """'fsdp=2,tp=1' -> {'fsdp': 2, 'tp': 1}; missing axes default to 1."""
    if not spec:
        return None
    sizes = {axis: 1 for axis in MESH_AXES}
    for part in spec.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in MESH_AXES:
            raise TrainError(f"--mesh {spec!r}: expected comma-separated fsdp=N,tp=M")
        try:
            sizes[key] = int(value)
        except ValueError:
            raise TrainError(f"--mesh {spec!r}: {key} size {value!r} is not an integer") from None
        if sizes[key] < 1:
            raise TrainError(f"--mesh {spec!r}: sizes must be positive")
    return sizes


def make_mesh(sizes: Mapping[str, int] | None, batch_size: int) -> Any:
    if sizes is None:
        return None
    import jax

    if batch_size % sizes["fsdp"]:
        # Tunix would silently replicate the batch instead of sharding it.
        raise TrainError(f"--batch-size {batch_size} must be divisible by fsdp={sizes['fsdp']}")
    needed = sizes["fsdp"] * sizes["tp"]
    if needed != jax.device_count():
        raise TrainError(
            f"--mesh fsdp={sizes['fsdp']},tp={sizes['tp']} needs {needed} devices; {jax.device_count()} are visible"
            + (" (on CPU, --cpu-devices N fakes N devices)" if jax.default_backend() == "cpu" else "")
        )
    return jax.make_mesh(
        (sizes["fsdp"], sizes["tp"]), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2
    )


# ----------------------------------------------------------------------------- vocab check


def check_vocab(tokenizer: Mapping[str, Any], model_name: str, family: str, model_vocab: int, source: str) -> None:
    """Refuses shards whose token ids can fall outside the model's embedding."""
    vocab = tokenizer.get("vocab_size")
    name = str(tokenizer.get("name") or "?")
    if vocab is None:
        log.warning("%s: manifest has no tokenizer vocab_size; cannot check it against %s", source, model_name)
        return
    if int(vocab) > model_vocab:
        raise TrainError(
            f"{source}: the shards were tokenized with {name!r} (vocab_size {vocab:,}), but {model_name} has "
            f"{model_vocab:,} embedding rows, so ids >= {model_vocab:,} would index past it. Pack with "
            f"{model_name}'s tokenizer, or train a model whose vocabulary covers {name!r}."
        )
    other = {"gemma3": "qwen", "qwen3": "gemma"}[family]
    if other in name.lower():
        raise TrainError(
            f"{source}: the shards were tokenized with {name!r}, a {other} tokenizer, but {model_name} is a "
            f"{family} model: the ids would mean other tokens. Pack with {model_name}'s tokenizer."
        )


def packing_kind(manifest: Any) -> str:
    """'packed' or 'unpacked' (one example per row), for the metrics and the report."""
    mode = str(getattr(manifest, "packing", "") or "").lower()
    if mode in ("none", "unpacked", "no-pack", "nopack", "one-per-row", "one_per_row"):
        return "unpacked"
    stats = getattr(manifest, "stats", {}) or {}
    if stats.get("examples_written") is not None and stats.get("examples_written") == manifest.num_rows:
        return "unpacked"
    return "packed"


# ----------------------------------------------------------------------------- metrics


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
    }


class MetricsRecorder:
    """Collects per-step numbers and writes the JSONL (flushed per line, so a crash keeps them)."""

    def __init__(self, path: str | None, static: Mapping[str, Any] | None = None, log_every: int = 10, out: TextIO | None = None):
        self.path = path
        self.static = dict(static or {})
        self.log_every = log_every
        self.out = out if out is not None else sys.stderr
        self._file: TextIO | None = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._file = open(path, "w")
        self.static_extra: dict[str, Any] = {}  # summary-only facts learnt during the run
        self.steps: list[dict[str, Any]] = []
        self.evals: list[dict[str, Any]] = []
        self._clock: float | None = None
        self._pending: dict[str, Any] | None = None
        self._eval_acc: list[tuple[float, float, float]] = []
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
            "step": len(self.steps) + 1,
            "loss": float(aux["loss"]),
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
        }
        record.update(self.static)
        self.steps.append(record)
        self._write(record)
        if self.log_every and (record["step"] % self.log_every == 0 or record["step"] == 1):
            print(
                f"step {record['step']}: loss {record['loss']:.4f}  {step_time:.3f}s  "
                f"{record['target_tokens_per_s']:.0f} target tok/s  density {record['density']:.3f}",
                file=self.out,
            )

    def eval_batch_done(self, aux: Mapping[str, Any]) -> None:
        self._eval_acc.append((float(aux["nll_sum"]), float(aux["target_tokens"]), float(aux["loss"])))

    def eval_done(self, elapsed: float) -> None:
        if not self._eval_acc:
            return
        nll, targets, losses = (np.array(v) for v in zip(*self._eval_acc))
        record = {
            "step": len(self.steps),
            # Token-weighted over the whole eval set (Tunix's own eval loss is a mean of batch means).
            "loss": float(nll.sum() / max(targets.sum(), 1e-8)),
            "mean_batch_loss": float(losses.mean()),
            "target_tokens": int(targets.sum()),
            "batches": len(losses),
            "time_s": elapsed,
        }
        self._eval_acc = []
        self.evals.append(record)
        self._write({"eval": record})
        print(f"eval after step {record['step']}: loss {record['loss']:.4f} over {record['target_tokens']} target tokens", file=self.out)

    def summary(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        steps = self.steps
        timed = steps[1:]  # step 1 carries the compile
        times = np.array([s["step_time_s"] for s in timed]) if timed else np.array([])
        out: dict[str, Any] = {
            "steps": len(steps),
            "tokens": int(sum(s["tokens"] for s in steps)),
            "target_tokens": int(sum(s["target_tokens"] for s in steps)),
            "examples": int(sum(s["examples"] for s in steps)),
            "first_loss": steps[0]["loss"] if steps else None,
            "final_loss": steps[-1]["loss"] if steps else None,
            "first_step_time_s": steps[0]["step_time_s"] if steps else None,
            "timed_steps": len(timed),
            "mean_step_time_s": float(times.mean()) if len(times) else None,
            "median_step_time_s": float(np.median(times)) if len(times) else None,
            "p10_step_time_s": float(np.percentile(times, 10)) if len(times) else None,
            "p90_step_time_s": float(np.percentile(times, 90)) if len(times) else None,
            "target_tokens_per_s": float(sum(s["target_tokens"] for s in timed) / times.sum()) if len(times) else None,
            "tokens_per_s": float(sum(s["tokens"] for s in timed) / times.sum()) if len(times) else None,
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

    def close(self, summary: Mapping[str, Any]) -> None:
        self._write({"summary": dict(summary)})
        if self._file is not None:
            self._file.close()
            self._file = None


# ----------------------------------------------------------------------------- trainer


def _make_trainer_class() -> type:
    """PeftTrainer with per-step metrics; built lazily so importing this module stays light."""
    from tunix.sft import metrics_logger as tunix_metrics
    from tunix.sft import peft_trainer

    from train.model_inputs import device_fields

    class PackedPeftTrainer(peft_trainer.PeftTrainer):
        """Adds host-side batch counts and synchronized step timing through Tunix's override points."""

        recorder: MetricsRecorder

        vocab_size: int

        def _prepare_inputs(self, input_data: Any) -> Any:
            # Runs on the host, before Tunix shards the batch: count here, send only what the device needs.
            top = int(np.max(input_data["input_ids"]))
            if top >= self.vocab_size or int(np.min(input_data["input_ids"])) < 0:
                # An out-of-range id would not fail on the device: the embedding gather returns NaN/clamped rows.
                raise TrainError(
                    f"a batch holds token id {top}, outside the model's {self.vocab_size:,}-row embedding; "
                    "the shards do not match the model's tokenizer"
                )
            if self._mode == tunix_metrics.Mode.TRAIN:
                self.recorder.batch_arrived(input_data)
            return device_fields(input_data)

        def _post_process_train_step(self, aux: Any) -> None:
            import jax

            # Waiting here makes step_time_s the real step time (Tunix otherwise keeps 2 steps in flight).
            aux = jax.device_get(jax.block_until_ready(aux))
            self.recorder.step_done(aux)

        def _post_process_eval_step(self, aux: Any) -> None:
            import jax

            self.recorder.eval_batch_done(jax.device_get(aux))

        def _run_eval(self, eval_ds: Iterable[Any], eval_step_fn: Any) -> None:
            start = time.perf_counter()
            super()._run_eval(eval_ds, eval_step_fn)
            self.recorder.eval_done(time.perf_counter() - start)
            self.recorder.reset_clock()  # eval time is not the next step's

        def train(self, train_ds: Iterable[Any], eval_ds: Iterable[Any] | None = None, *args: Any, **kwargs: Any) -> None:
            from jax.interpreters import pxla

            # What Tunix will shard batches over: empty unless a mesh is active through `with mesh:`.
            mesh = pxla.thread_resources.env.physical_mesh
            self.recorder.static_extra["active_mesh"] = None if mesh.empty else dict(mesh.shape)
            self.recorder.reset_clock()
            super().train(train_ds, eval_ds, *args, **kwargs)

    return PackedPeftTrainer


class _Take:
    """Re-iterable first-n view of a re-iterable dataset (Tunix re-iterates eval_ds at every eval)."""

    def __init__(self, ds: Iterable[Any], n: int | None):
        self.ds, self.n = ds, n

    def __iter__(self) -> Iterator[Any]:
        return itertools.islice(iter(self.ds), self.n)


def _with_aux(loss_fn: Any) -> Any:
    """Wraps a scalar loss (Tunix's default) so that the trainer's aux-based metrics still work."""
    import jax.numpy as jnp

    def wrapped(model: Any, input_tokens: Any, input_mask: Any, positions: Any, attention_mask: Any) -> Any:
        loss = loss_fn(model, input_tokens, input_mask, positions, attention_mask)
        targets = jnp.sum(input_mask[:, 1:]).astype(jnp.float32)
        return loss, {"loss": loss, "nll_sum": loss * targets, "target_tokens": targets}

    return wrapped


@dataclasses.dataclass
class Setup:
    """Everything a run needs, built once (tests reuse it to drive steps by hand)."""

    config: TrainConfig
    view: Any
    eval_view: Any
    built: Any  # train.models.BuiltModel (LoRA applied)
    mesh: Any
    trainer: Any
    recorder: MetricsRecorder
    static: dict[str, Any]


def setup(cfg: TrainConfig, out: TextIO | None = None) -> Setup:
    import jax
    import optax
    from flax import nnx
    from tunix.sft import peft_trainer

    import loaders
    from train import loss as loss_lib
    from train import model_inputs, models

    if cfg.steps < 1:
        raise TrainError(f"--steps must be positive, got {cfg.steps}")
    if cfg.batch_size < 1:
        raise TrainError(f"--batch-size must be positive, got {cfg.batch_size}")
    view = loaders.open_shards(cfg.shards)
    eval_view = loaders.open_shards(cfg.eval_shards) if cfg.eval_shards else None
    manifest = view.manifest
    if eval_view is not None and eval_view.manifest.max_length != manifest.max_length:
        raise TrainError(
            f"--eval-shards {cfg.eval_shards} has max_length {eval_view.manifest.max_length}, "
            f"--shards {cfg.shards} has {manifest.max_length}; pack both for the same length"
        )

    mesh = make_mesh(parse_mesh(cfg.mesh), cfg.batch_size)
    spec = models.get_spec(cfg.model)
    vocab = manifest.tokenizer.get("vocab_size")
    vocab = int(vocab) if vocab else None
    # Check the vocabularies on the config, before loading or drawing any weights.
    model_vocab = models.config_vocab_size(
        models.resolve_config(cfg.model, vocab_size=vocab, dtype=cfg.dtype, config_overrides=cfg.config_overrides)
    )
    for v, path in ((view, cfg.shards), (eval_view, cfg.eval_shards)):
        if v is not None:
            check_vocab(v.manifest.tokenizer, cfg.model, spec.family, model_vocab, path)
    built = models.build_model(
        cfg.model, weights=cfg.weights, vocab_size=vocab, dtype=cfg.dtype,
        seed=cfg.seed, mesh=mesh, config_overrides=cfg.config_overrides,
    )
    base_params = models.count_params(built.model)
    built.model = models.apply_lora(built.model, spec, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    models.shard_model(built.model, mesh)

    if cfg.loss == "masked":
        loss_fn = loss_lib.masked_loss_fn_with_aux
    elif cfg.loss == "tunix-default":
        loss_fn = _with_aux(loss_lib.tunix_default_loss_fn())
    else:
        raise TrainError(f"unknown loss {cfg.loss!r}; choose masked or tunix-default")

    static = {
        "model": cfg.model,
        "weights": built.weights,
        "packing": packing_kind(manifest),
        "batch_size": cfg.batch_size,
        "seq_len": manifest.max_length,
    }
    recorder = MetricsRecorder(cfg.metrics_out, static=static, log_every=cfg.log_every, out=out)
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=cfg.learning_rate)
    training_config = peft_trainer.TrainingConfig(
        eval_every_n_steps=cfg.eval_every or cfg.steps,
        max_steps=cfg.steps,
        checkpoint_root_directory=None,
        metrics_logging_options=None,  # in memory only; our JSONL is the record
        pbar_description=None,
    )
    trainer = _make_trainer_class()(built.model, optimizer, training_config)
    trainer.recorder = recorder
    trainer.vocab_size = built.vocab_size
    trainer.with_gen_model_input_fn(model_inputs.make_gen_model_input_fn())
    trainer.with_loss_fn(loss_fn, has_aux=True)
    extra = {
        "shards": cfg.shards,
        "manifest_packing": getattr(manifest, "packing", None),
        "lora_rank": cfg.lora_rank,
        "learning_rate": cfg.learning_rate,
        "params": base_params,
        "lora_params": models.count_params(built.model, nnx.LoRAParam),
        "vocab_size": built.vocab_size,
        "mesh": cfg.mesh,
        "devices": jax.device_count(),
        "platform": jax.default_backend(),
        "device_kind": jax.devices()[0].device_kind,
        "loss_fn": cfg.loss,
    }
    return Setup(cfg, view, eval_view, built, mesh, trainer, recorder, {**static, **extra})


def datasets(s: Setup) -> tuple[Any, Any]:
    import jax

    import loaders

    cfg = s.config
    procs = jax.process_count()
    if cfg.batch_size % procs:
        raise TrainError(f"--batch-size {cfg.batch_size} must be divisible by the {procs} processes")
    per_host = cfg.batch_size // procs
    train_ds = loaders.make_dataset(
        s.view, per_host, cfg.seed, jax.process_index(), procs, None, read_threads=cfg.read_threads
    )
    eval_ds = None
    if s.eval_view is not None:
        try:
            eval_ds = loaders.make_dataset(s.eval_view, per_host, cfg.seed, jax.process_index(), procs, 1, read_threads=cfg.read_threads)
        except ValueError as e:
            raise TrainError(f"--eval-shards {cfg.eval_shards}: {e}") from e
        eval_ds = _Take(eval_ds, cfg.eval_batches)
    return train_ds, eval_ds


def run(cfg: TrainConfig, out: TextIO | None = None) -> dict[str, Any]:
    """Trains as configured; returns the summary (also the JSONL's last line)."""
    import contextlib

    s = setup(cfg, out=out)
    train_ds, eval_ds = datasets(s)
    context = s.mesh if s.mesh is not None else contextlib.nullcontext()
    try:
        with context:
            s.trainer.train(train_ds, eval_ds)
    finally:
        summary = s.recorder.summary(extra={k: v for k, v in s.static.items() if k not in s.recorder.static})
        s.recorder.close(summary)
    return summary
