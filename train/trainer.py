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

Checkpoints (cfg.checkpoint_dir, train/checkpointing.py): Tunix's own CheckpointManager
saves the LoRA params and optimizer state, our wrapper adds the loader state for the same
step; a run started on a folder holding a checkpoint of the same run resumes from its
latest step with exactly the next batch (seeked, not re-read), numbering steps on and
appending to the metrics JSONL. cfg.save_lora exports the adapters as safetensors at the end.
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

from train import checkpointing

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
    # Checkpoints (train/checkpointing.py): LoRA params + optimizer state through Tunix, plus the
    # loader state, every checkpoint_every steps and at the last one; a run resumes from the latest.
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = 100
    checkpoint_keep: int = 3  # Orbax max_to_keep
    save_lora: str | None = None  # safetensors export of the LoRA params at the end


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
    ):
        """resume_from=k: the run continues after step k of a checkpoint; step numbers go on from k+1
        and the JSONL is appended to (its records of steps after k, which the resumed run redoes,
        are dropped first, so each step appears once)."""
        self.path = path
        self.static = dict(static or {})
        self.log_every = log_every
        self.out = out if out is not None else sys.stderr
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
            "step": self.first_step + len(self.steps),
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
            "step": self.first_step - 1 + len(self.steps),
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
            "steps": len(steps),  # in this process (a resumed run starts at first_step)
            "first_step": self.first_step,
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
            if input_data is checkpointing.PLACEHOLDER:
                # Tunix discards these itself after a restore (checkpointing.ResumableStream); one
                # reaching the step means its skip logic changed, and the data would be misaligned.
                raise TrainError(
                    "Tunix handed a skipped-batch placeholder to the train step: its post-restore skip no longer "
                    "matches train/checkpointing.py's ResumableStream; refusing to train on misaligned data"
                )
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
    checkpoint: checkpointing.CheckpointDir | None = None
    policy: checkpointing.EveryNStepsAndLast | None = None
    resumed_step: int = 0  # the checkpoint step Tunix restored (0: a fresh start)
    base_weights: dict[str, Any] | None = None  # {"source", "fingerprint"} when checkpointing or exporting


def run_identity(cfg: TrainConfig, spec: Any, config: Any, view: Any) -> dict[str, Any]:
    """What a resumed run must share with the checkpoint (see checkpointing.IDENTITY_LABELS)."""
    import jax
    import jax.numpy as jnp

    from loaders.dataset import shard_set_id
    from train import models

    return {
        "model": cfg.model,
        "dtype": jnp.dtype(getattr(config, "param_dtype", None) or jnp.float32).name,
        "vocab_size": models.config_vocab_size(config),
        "config_overrides": dict(cfg.config_overrides or {}),
        "lora_rank": cfg.lora_rank,
        "lora_alpha": float(cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank),
        "lora_module_path": spec.lora_module_path,
        "shard_set": shard_set_id(view),
        "seed": cfg.seed,
        "batch_size": cfg.batch_size,
        "processes": jax.process_count(),
        # inject_hyperparams keeps the learning rate in the optimizer state, so a restore would
        # silently bring back the old one; the loss changes what the gradients mean.
        "learning_rate": cfg.learning_rate,
        "loss": cfg.loss,
    }


def setup(cfg: TrainConfig, out: TextIO | None = None) -> Setup:
    """Builds the model, LoRA and trainer; with cfg.checkpoint_dir, Tunix restores the latest checkpoint here."""
    import jax
    from flax import nnx
    from tunix.sft import peft_trainer

    import loaders
    from train import loss as loss_lib
    from train import model_inputs, models, precision
    from train import optimizer as optimizer_lib

    if cfg.steps < 1:
        raise TrainError(f"--steps must be positive, got {cfg.steps}")
    if cfg.batch_size < 1:
        raise TrainError(f"--batch-size must be positive, got {cfg.batch_size}")
    if cfg.checkpoint_every is not None and cfg.checkpoint_every < 1:
        raise TrainError(f"--checkpoint-every must be positive, got {cfg.checkpoint_every}")
    if cfg.checkpoint_keep < 1:
        raise TrainError(f"--checkpoint-keep must be positive, got {cfg.checkpoint_keep}")
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
    model_config = models.resolve_config(cfg.model, vocab_size=vocab, dtype=cfg.dtype, config_overrides=cfg.config_overrides)
    model_vocab = models.config_vocab_size(model_config)
    for v, path in ((view, cfg.shards), (eval_view, cfg.eval_shards)):
        if v is not None:
            check_vocab(v.manifest.tokenizer, cfg.model, spec.family, model_vocab, path)

    ckpt = identity = None
    if cfg.checkpoint_dir:
        ckpt = checkpointing.CheckpointDir(cfg.checkpoint_dir, jax.process_index(), jax.process_count())
        ckpt.require_backend()
        identity = run_identity(cfg, spec, model_config, view)
        # Refuse another run's checkpoint now, before minutes of weight loading.
        ckpt.check_resumable(identity, info={"shards": cfg.shards})

    built = models.build_model(
        cfg.model, weights=cfg.weights, vocab_size=vocab, dtype=cfg.dtype,
        seed=cfg.seed, mesh=mesh, config_overrides=cfg.config_overrides,
    )
    base_params = models.count_params(built.model)
    base_weights = None
    if ckpt is not None or cfg.save_lora:
        base_weights = {"source": built.weights, "fingerprint": checkpointing.base_fingerprint(built.model)}
    if ckpt is not None:
        # Same base weights as the checkpoint's LoRA was trained on (a random seed, a GGUF, an HF folder).
        if ckpt.check_resumable(identity, base_weights, info={"shards": cfg.shards}) is None:
            ckpt.write_run(identity, base_weights, {"shards": cfg.shards, "weights": built.weights, "steps": cfg.steps})
    built.model = models.apply_lora(built.model, spec, rank=cfg.lora_rank, alpha=cfg.lora_alpha, seed=cfg.seed)
    models.shard_model(built.model, mesh)

    if cfg.loss == "masked":
        loss_fn = loss_lib.masked_loss_fn_with_aux
    elif cfg.loss == "tunix-default":
        loss_fn = _with_aux(loss_lib.tunix_default_loss_fn())
    else:
        raise TrainError(f"unknown loss {cfg.loss!r}; choose masked or tunix-default")
    loss_fn = precision.in_compute_dtype(loss_fn, models.parse_dtype(cfg.dtype, spec.default_dtype))

    static = {
        "model": cfg.model,
        "weights": built.weights,
        "packing": packing_kind(manifest),
        "batch_size": cfg.batch_size,
        "seq_len": manifest.max_length,
    }
    optimizer = optimizer_lib.adamw(cfg.learning_rate)
    policy = checkpointing.EveryNStepsAndLast(cfg.checkpoint_every, cfg.steps) if ckpt is not None else None
    training_config = peft_trainer.TrainingConfig(
        eval_every_n_steps=cfg.eval_every or cfg.steps,
        max_steps=cfg.steps,
        # Tunix's own checkpointing: it saves nnx.LoRAParam + optimizer state when the policy
        # says so and restores the latest step in the constructor below.
        checkpoint_root_directory=ckpt.tunix_root if ckpt is not None else None,
        checkpointing_options=checkpointing.checkpoint_options(policy, cfg.checkpoint_keep) if policy is not None else None,
        metrics_logging_options=None,  # in memory only; our JSONL is the record
        pbar_description=None,
    )
    trainer = _make_trainer_class()(built.model, optimizer, training_config)
    resumed = int(trainer.train_steps)
    if mesh is None:
        # Commit model and optimizer state to the device. jit keys its lowering on which inputs
        # are committed: all-uncommitted (a fresh run) compiles as all-committed (every later
        # step), but Orbax restores LoRA params and optimizer state committed beside uncommitted
        # base weights, and that mix compiled the step a second time at the next step
        # (measured: +3.8 s on the tiny CPU model, minutes for a real model on a TPU).
        device = jax.devices()[0]
        nnx.update(built.model, jax.device_put(nnx.state(built.model), device))
        nnx.update(trainer.optimizer, jax.device_put(nnx.state(trainer.optimizer), device))
    if resumed:
        print(f"resuming from step {resumed} of {ckpt.path}", file=out if out is not None else sys.stderr)
    recorder = MetricsRecorder(
        cfg.metrics_out, static=static, log_every=cfg.log_every, out=out,
        resume_from=resumed or None, resume_note={"checkpoint_dir": cfg.checkpoint_dir},
    )
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
    if ckpt is not None:
        extra.update({"checkpoint_dir": cfg.checkpoint_dir, "resumed_from_step": resumed})
    return Setup(cfg, view, eval_view, built, mesh, trainer, recorder, {**static, **extra},
                 checkpoint=ckpt, policy=policy, resumed_step=resumed, base_weights=base_weights)


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


def checkpointed_stream(s: Setup, train_ds: Iterable[Any]) -> checkpointing.ResumableStream:
    """The train iterable for a checkpointed run, positioned after the restored step without re-reading.

    Tunix (0.1.7) restores model and optimizer in its constructor, then discards
    trainer.iter_steps elements of the train iterable before training. We hand it that many
    placeholders followed by the loader iterator set to the saved state, so its skip costs
    nothing and does not move the data a second time. And we wrap its checkpoint manager so
    every save writes the loader state for that step first (checkpointing.DataStateCheckpoints).
    """
    assert s.checkpoint is not None and s.policy is not None
    it = iter(train_ds)
    k = s.resumed_step
    if s.trainer.iter_steps != k:
        # Gradient accumulation would make Tunix skip k * G elements; we never configure it.
        raise TrainError(f"Tunix restored {k} steps but will skip {s.trainer.iter_steps} batches; gradient accumulation is not supported here")
    if not k:
        stream = checkpointing.ResumableStream(it)
    else:
        state = s.checkpoint.load_data_state(k)
        if state is None:
            log.warning(
                "%s: no loader state for step %d; Tunix will re-read and skip %d batches (exact, since run.json "
                "pins shards, seed and batch size, but slower)", s.checkpoint.path, k, k,
            )
            stream = checkpointing.ResumableStream(it)
        else:
            try:
                it.set_state(state)
            except ValueError as e:
                raise checkpointing.CheckpointError(f"{s.checkpoint.data_path}: step {k}: {e}") from e
            stream = checkpointing.ResumableStream(it, consumed=k, placeholders=s.trainer.iter_steps)
    s.trainer.checkpoint_manager = checkpointing.DataStateCheckpoints(
        s.trainer.checkpoint_manager, s.checkpoint, stream, s.policy, keep=s.config.checkpoint_keep
    )
    return stream


def export_lora(s: Setup, path: str) -> dict[str, str]:
    """--save-lora: the trained LoRA parameters and what they belong to, as one safetensors file."""
    from loaders.dataset import shard_set_id

    cfg = s.config
    base = s.base_weights or {}
    return checkpointing.save_lora(s.built.model, path, {
        "model": cfg.model,
        "lora_alpha": float(cfg.lora_alpha if cfg.lora_alpha is not None else 2 * cfg.lora_rank),
        "lora_module_path": s.built.spec.lora_module_path,
        "base_weights": base.get("source"),
        "base_fingerprint": base.get("fingerprint"),
        "vocab_size": s.built.vocab_size,
        "step": int(s.trainer.train_steps),
        "shards": cfg.shards,
        "shard_set": shard_set_id(s.view),
        "seed": cfg.seed,
    })


def execute(cfg: TrainConfig, out: TextIO | None = None) -> tuple[Setup, dict[str, Any]]:
    """Trains as configured; returns the Setup (its model is the trained one) and the summary."""
    import contextlib

    s = setup(cfg, out=out)
    context = s.mesh if s.mesh is not None else contextlib.nullcontext()
    try:
        if s.resumed_step >= cfg.steps:
            print(f"checkpoint step {s.resumed_step} >= --steps {cfg.steps}: nothing to train", file=out if out is not None else sys.stderr)
        else:
            train_ds, eval_ds = datasets(s)
            if s.checkpoint is not None:
                train_ds = checkpointed_stream(s, train_ds)
            with context:
                s.trainer.train(train_ds, eval_ds)
        if cfg.save_lora:
            meta = export_lora(s, cfg.save_lora)
            s.recorder.static_extra["lora_export"] = {"path": cfg.save_lora, "step": int(meta["step"]), "rank": int(meta["lora_rank"])}
    finally:
        # Tunix's close() already waited for in-flight saves after a normal end; after an
        # exception it was never called, and the last save may still be writing.
        s.trainer.checkpoint_manager.close()
        if isinstance(s.trainer.checkpoint_manager, checkpointing.DataStateCheckpoints):
            s.recorder.static_extra["checkpoints_saved"] = s.trainer.checkpoint_manager.saved_steps
        summary = s.recorder.summary(extra={k: v for k, v in s.static.items() if k not in s.recorder.static})
        s.recorder.close(summary)
    return s, summary


def run(cfg: TrainConfig, out: TextIO | None = None) -> dict[str, Any]:
    """Trains as configured; returns the summary (also the JSONL's last line)."""
    return execute(cfg, out=out)[1]
