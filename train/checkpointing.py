"""Checkpoints that resume exactly, and the LoRA export, for `prepack train`.

Layout of `--checkpoint-dir DIR` (a local folder, a gcsfuse mount or gs://):

    DIR/run.json                          what the run is (model, LoRA, base weights, data, optimizer);
                                          a resume must match it (checked before any weight is read)
    DIR/tunix/<step>/model_params         Tunix's own CheckpointManager (TrainingConfig.checkpoint_root_directory):
    DIR/tunix/<step>/optimizer_state        only the nnx.LoRAParam values when LoRA is on, and the optimizer state
    DIR/data/process_<i>-of-<n>.json      each host's loader state (loaders' get_state JSON) after <step> batches,
                                          for the most recent checkpoint steps

Saving. Tunix saves inside its train loop, after every optimizer step, whenever the
Orbax save-decision policy says so; ours (`EveryNStepsAndLast`) says "every N steps and
the last step". The trainer's `checkpoint_manager` is wrapped (`DataStateCheckpoints`) so
that each save first writes the loader state for that step, then lets Tunix save the
weights: a step that Orbax has committed always has its loader state on disk (the other
order could leave a committed step without one if the process died between the two).

Resuming. PeftTrainer restores the latest step in its constructor and then, in train(),
re-reads and discards `iter_steps` batches from a fresh iterator (its TODO says so: it
skips rather than restores the iterator). Our loader can seek instead (`set_state`), which
costs nothing however far the run got. To keep Tunix's loop unchanged and still not re-read
anything, the trainer is handed a `ResumableStream`: `iter_steps` placeholders first (what
Tunix's skip discards, read from nowhere), then the loader iterator already positioned after
the restored step. Tunix therefore sees the same number of elements it expects to skip and the
first real batch it trains on is exactly the one that followed the checkpoint. Should a
future Tunix stop skipping, a placeholder would reach the step and the trainer refuses it
(train/trainer.py) instead of training on the wrong batch. If a step has no saved loader
state (a checkpoint written by something else), the stream starts at batch 0 with no
placeholders and Tunix's own skipping positions it: slower, still exact, since the order is
a function of (shard set, seed, batch size, hosts), all of which run.json pins.

Not covered: Orbax's save-on-preemption policy (it would save at a step our loader state
was not written for, and needs jax.distributed's preemption service); periodic checkpoints
bound the lost work instead. Changing the number of hosts between save and resume is
refused by the loader.

LoRA export (`save_lora` / `load_lora`): one safetensors file with every nnx.LoRAParam,
named by its module path (`layers.0.attn.q_proj.w_lora_a`, `..._lora_b`), and string
metadata: model, rank, alpha, module regex, dtype, base-weights source and fingerprint,
step. `load_lora(model, path)` puts them into a freshly built LoRA model with the same
shapes and refuses another rank, other module paths or other base weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from loaders import storage

log = logging.getLogger(__name__)

RUN_FORMAT = 1
DATA_FORMAT = 1
LORA_FORMAT = "prepack-lora"
LORA_FORMAT_VERSION = "1"
# Elements taken from the first row of every base weight for the fingerprint.
FINGERPRINT_VALUES = 16

# run.json fields a resume must match, with the words used in error messages. Anything else
# (--steps, --checkpoint-every, eval settings, --mesh, read threads, metrics path) may change.
IDENTITY_LABELS: dict[str, str] = {
    "model": "model",
    "dtype": "parameter dtype",
    "vocab_size": "vocabulary size",
    "config_overrides": "model config overrides",
    "lora_rank": "LoRA rank",
    "lora_alpha": "LoRA alpha",
    "lora_module_path": "LoRA module paths",
    "shard_set": "shard set (content id)",
    "seed": "seed",
    "batch_size": "batch size",
    "processes": "number of processes",
    "learning_rate": "learning rate",
    "loss": "loss",
}


class CheckpointError(ValueError):
    """A checkpoint or LoRA file that cannot be used as asked; the message says why and what to do."""


# ----------------------------------------------------------------------------- identity


def base_fingerprint(model: Any) -> str:
    """A short id of a model's base (non-LoRA) weights: paths, shapes, dtypes and sampled values.

    The values are the first FINGERPRINT_VALUES elements of the first row of every base
    parameter, gathered in one jitted call (one compile; a per-parameter eager slice would
    compile once per shape). Exact values, not sums, so it does not depend on the mesh.
    Tells apart different random seeds, checkpoints and dtypes; it is not a full checksum.
    """
    import jax
    import numpy as np
    from flax import nnx
    from jax.experimental import multihost_utils

    flat = sorted(
        ((".".join(map(str, path)), var.get_value()) for path, var in nnx.to_flat_state(nnx.state(model, nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))))),
        key=lambda kv: kv[0],
    )
    values = [v for _, v in flat]

    @jax.jit
    def sample(xs: list[Any]) -> list[Any]:
        return [x[(0,) * (x.ndim - 1)][:FINGERPRINT_VALUES] if x.ndim else x for x in xs]

    # Slices of sharded weights may themselves be sharded across hosts: gather those.
    heads = [h if h.is_fully_addressable else multihost_utils.process_allgather(h, tiled=True) for h in sample(values)]
    digest = hashlib.sha256()
    for (name, value), head in zip(flat, jax.device_get(heads)):
        digest.update(f"{name}|{tuple(value.shape)}|{value.dtype}|".encode())
        digest.update(np.ascontiguousarray(head).tobytes())
    return digest.hexdigest()[:16]


def _describe(value: Any) -> str:
    return repr(value) if isinstance(value, str) else json.dumps(value, sort_keys=True)


def identity_differences(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """'label: checkpoint X, now Y' for every identity field that differs."""
    out = []
    for key, label in IDENTITY_LABELS.items():
        if key in now and saved.get(key) != now.get(key):
            out.append(f"{label}: checkpoint {_describe(saved.get(key))}, now {_describe(now.get(key))}")
    return out


# ----------------------------------------------------------------------------- save policy


@dataclasses.dataclass(frozen=True)
class EveryNStepsAndLast:
    """Orbax SaveDecisionPolicy: save every `every` steps and at step `last`.

    The same `wants()` decides, in DataStateCheckpoints, whether to write the loader state
    before a save, so the two can never disagree about which steps are checkpoints.
    """

    every: int | None
    last: int

    def wants(self, step: int) -> bool:
        return step == self.last or (bool(self.every) and step % int(self.every) == 0)

    def should_save(self, step: Any, previous_steps: Sequence[Any], *, context: Any) -> bool:
        del previous_steps, context  # Orbax itself refuses steps <= its latest one
        return self.wants(int(step.step))


# ----------------------------------------------------------------------------- data stream


class _Placeholder:
    """What Tunix's post-restore skip consumes instead of re-read batches."""

    def __repr__(self) -> str:
        return "<batch skipped by Tunix after a restore; never read>"


PLACEHOLDER = _Placeholder()


class ResumableStream:
    """The train iterable handed to PeftTrainer.train: `placeholders` placeholders, then the loader iterator.

    `consumed` counts real batches since the start of the data stream (the restored step
    included), and the loader state after each of the last few is kept, so that a save for
    step s records the state after exactly s batches even when Tunix has already pulled the
    next batch (it reads one batch past max_steps before it stops, then saves in close()).
    """

    KEEP = 4

    def __init__(self, iterator: Any, *, consumed: int = 0, placeholders: int = 0):
        self._it = iterator
        self._placeholders = placeholders
        self.consumed = consumed
        self._states: dict[int, dict[str, Any]] = {consumed: iterator.get_state()}
        self._iterated = False

    def __iter__(self) -> Iterator[Any]:
        # Tunix calls iter() once per train(); a second pass would not restart the data.
        if self._iterated:
            raise RuntimeError("a ResumableStream is iterated once; build a new one for another train() call")
        self._iterated = True
        return self

    def __next__(self) -> Any:
        if self._placeholders:
            self._placeholders -= 1
            return PLACEHOLDER
        batch = next(self._it)
        self.consumed += 1
        self._states[self.consumed] = self._it.get_state()
        for old in [k for k in self._states if k <= self.consumed - self.KEEP]:
            del self._states[old]
        return batch

    def state_after(self, step: int) -> dict[str, Any]:
        try:
            return self._states[step]
        except KeyError:
            raise CheckpointError(
                f"no loader state recorded after batch {step} (have {sorted(self._states)}); "
                "the trainer saved a step the data stream did not reach"
            ) from None


# ----------------------------------------------------------------------------- the checkpoint folder


class CheckpointDir:
    """DIR/run.json, DIR/tunix (Tunix's Orbax root) and DIR/data (loader states)."""

    def __init__(self, path: str, process_index: int = 0, process_count: int = 1):
        path = str(path).rstrip("/")
        # Orbax refuses relative local paths ("Checkpoint path should be absolute").
        self.path = path if storage.is_gcs(path) else os.path.abspath(path)
        self.process_index = process_index
        self.process_count = process_count

    @property
    def tunix_root(self) -> str:
        return storage.join(self.path, "tunix")

    @property
    def run_path(self) -> str:
        return storage.join(self.path, "run.json")

    @property
    def data_path(self) -> str:
        return storage.join(self.path, f"data/process_{self.process_index}-of-{self.process_count}.json")

    def require_backend(self) -> None:
        """Orbax lists and renames gs:// folders through etils.epath, which needs gcsfs; say so up front."""
        if storage.is_gcs(self.path):
            try:
                import gcsfs  # noqa: F401
            except ImportError:
                raise CheckpointError(
                    f"--checkpoint-dir {self.path}: Orbax needs the gcsfs package for gs:// folders "
                    "(pip install gcsfs), or mount the bucket read-write with gcsfuse and pass the local path"
                ) from None

    def latest_step(self) -> int | None:
        """The newest finalized Orbax step (what Tunix will restore), without creating anything."""
        import orbax.checkpoint as ocp

        steps = ocp.utils.checkpoint_steps(self.tunix_root)
        return max(steps) if steps else None

    def read_run(self) -> dict[str, Any] | None:
        text = storage.read_text(self.run_path)
        if text is None:
            return None
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.run_path}: not valid JSON ({e})") from e

    def check_resumable(
        self, identity: Mapping[str, Any], base: Mapping[str, Any] | None = None, info: Mapping[str, Any] | None = None
    ) -> int | None:
        """Raises CheckpointError when DIR holds checkpoints of another run; returns the latest step (None: fresh).

        Called twice by the trainer: with the configuration alone before any weights are
        loaded (cheap, catches model/rank/data mismatches at once), then with the base
        weights' fingerprint once the base model is built, before Tunix restores anything.
        """
        step = self.latest_step()
        if step is None:
            return None
        saved = self.read_run()
        if saved is None:
            raise CheckpointError(
                f"--checkpoint-dir {self.path} holds checkpoints (latest step {step}) but no run.json: "
                "not written by prepack train; use another --checkpoint-dir"
            )
        if saved.get("format") != RUN_FORMAT:
            raise CheckpointError(f"{self.run_path}: format {saved.get('format')!r} is not supported (expected {RUN_FORMAT})")
        differ = identity_differences(saved.get("identity", {}), identity)
        if saved.get("identity", {}).get("shard_set") != identity.get("shard_set"):
            differ.append(f"shards: checkpoint read {saved.get('shards')!r}, now {(info or {}).get('shards')!r}")
        if base is not None:
            theirs = saved.get("base_weights", {})
            if theirs.get("fingerprint") != base.get("fingerprint"):
                differ.append(
                    f"base weights: checkpoint {theirs.get('source')!r} (fingerprint {theirs.get('fingerprint')}), "
                    f"now {base.get('source')!r} (fingerprint {base.get('fingerprint')})"
                )
        if differ:
            raise CheckpointError(
                f"--checkpoint-dir {self.path} holds a different run (latest step {step}), so it cannot be resumed: "
                + "; ".join(differ)
                + ". Resume with the checkpoint's settings, or use a new --checkpoint-dir."
            )
        return step

    def write_run(self, identity: Mapping[str, Any], base: Mapping[str, Any], info: Mapping[str, Any]) -> None:
        """Only process 0 writes run.json (every host computes the same identity)."""
        if self.process_index != 0:
            return
        record = {"format": RUN_FORMAT, "identity": dict(identity), "base_weights": dict(base), **dict(info)}
        storage.write_text(self.run_path, json.dumps(record, indent=1, sort_keys=True) + "\n")

    # -- loader states

    def _read_data(self) -> dict[str, Any]:
        text = storage.read_text(self.data_path)
        if text is None:
            return {"format": DATA_FORMAT, "states": {}}
        try:
            record = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{self.data_path}: not valid JSON ({e})") from e
        if record.get("format") != DATA_FORMAT:
            raise CheckpointError(f"{self.data_path}: format {record.get('format')!r} is not supported (expected {DATA_FORMAT})")
        return record

    def save_data_state(self, step: int, state: Mapping[str, Any], keep: int) -> None:
        """Adds this host's loader state for `step` (one small object rewritten atomically), keeping the newest `keep`."""
        record = self._read_data()
        states = record["states"]
        states[str(step)] = dict(state)
        for old in sorted(states, key=int)[:-keep]:
            del states[old]
        storage.write_text(self.data_path, json.dumps(record, indent=1, sort_keys=True) + "\n")

    def load_data_state(self, step: int) -> dict[str, Any] | None:
        return self._read_data()["states"].get(str(step))


class DataStateCheckpoints:
    """Tunix's CheckpointManager with the loader state written first for every step it will save.

    Delegation, not a copy: every call goes to Tunix's manager; `save` only adds the loader
    state beforehand when the shared policy wants that step (or Tunix forces a last save).
    """

    def __init__(self, inner: Any, ckpt: CheckpointDir, stream: ResumableStream, policy: EveryNStepsAndLast, keep: int):
        self._inner = inner
        self._ckpt = ckpt
        self._stream = stream
        self._policy = policy
        self._keep = keep
        self._closed = False
        self.saved_steps: list[int] = []

    def latest_step(self) -> int | None:
        return self._inner.latest_step()

    def save(self, step: int, model: Any, optimizer: Any = None, **kwargs: Any) -> bool:
        if kwargs.get("force") or self._policy.wants(step):
            latest = self._inner.latest_step()
            if latest is None or step > latest:
                # Keep one more loader state than Orbax keeps steps: the newest save may be in flight.
                self._ckpt.save_data_state(step, self._stream.state_after(step), keep=self._keep + 1)
        saved = bool(self._inner.save(step, model, optimizer, **kwargs))
        if saved:
            self.saved_steps.append(step)
        return saved

    def maybe_restore(self, *args: Any, **kwargs: Any) -> Any:
        return self._inner.maybe_restore(*args, **kwargs)

    def close(self) -> None:
        """Waits for in-flight saves; safe to call twice (Tunix's close, then ours on the way out)."""
        if not self._closed:
            self._closed = True
            self._inner.close()


def checkpoint_options(policy: EveryNStepsAndLast, keep: int) -> Any:
    import orbax.checkpoint as ocp

    # Async saves (Orbax's default) overlap the write with the next steps; Tunix's close()
    # waits for them. Only our policy decides: no initial save at step 1, no time-based saves.
    return ocp.CheckpointManagerOptions(save_decision_policy=policy, max_to_keep=keep)


# ----------------------------------------------------------------------------- LoRA export


def lora_tensors(model: Any) -> dict[str, Any]:
    """{module path.param name: value} of every nnx.LoRAParam, gathered to the host."""
    import jax
    import numpy as np
    from flax import nnx

    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
        value = var.get_value()
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            from jax.experimental import multihost_utils

            value = multihost_utils.process_allgather(value, tiled=True)
        out[".".join(map(str, path))] = np.asarray(jax.device_get(value))
    return out


def _lora_rank(tensors: Mapping[str, Any]) -> int | None:
    """qwix's A factors end in the rank: [..., in, rank]."""
    for name in sorted(tensors):
        if name.endswith("_lora_a"):
            return int(tensors[name].shape[-1])
    return None


def _write_bytes(path: str, data: bytes) -> None:
    if storage.is_gcs(path):
        bucket, _, key = path[len("gs://") :].partition("/")
        storage.gcs_client().bucket(bucket).blob(key).upload_from_string(data, content_type="application/octet-stream")
        return
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)  # a crash leaves the old file, never half a new one


def _read_bytes(path: str) -> bytes:
    if storage.is_gcs(path):
        bucket, _, key = path[len("gs://") :].partition("/")
        blob = storage.gcs_client().bucket(bucket).blob(key)
        if not blob.exists():
            raise CheckpointError(f"no LoRA file at {path}")
        return blob.download_as_bytes()
    if not os.path.isfile(path):
        raise CheckpointError(f"no LoRA file at {path}")
    with open(path, "rb") as f:
        return f.read()


def save_lora(model: Any, path: str, metadata: Mapping[str, Any]) -> dict[str, str]:
    """Writes the model's LoRA parameters to a safetensors file; returns the metadata written.

    metadata: model, lora_alpha, lora_module_path, base_weights, base_fingerprint, step, ...
    (values are stored as strings, JSON for non-strings). lora_rank and dtype are taken
    from the tensors. Only process 0 writes.
    """
    import jax
    import jax.numpy as jnp
    import safetensors.flax

    tensors = lora_tensors(model)
    if not tensors:
        raise CheckpointError("the model has no LoRA parameters to export")
    meta = {k: v if isinstance(v, str) else json.dumps(v) for k, v in metadata.items() if v is not None}
    meta.update({
        "format": LORA_FORMAT,
        "format_version": LORA_FORMAT_VERSION,
        "lora_rank": str(_lora_rank(tensors)),
        "dtype": str(next(iter(tensors.values())).dtype),
        "tensor_names": "module path + '.' + qwix param name (<kernel>_lora_a [.., in, rank], <kernel>_lora_b [rank, ..])",
    })
    if jax.process_index() == 0:
        # safetensors.flax keeps bfloat16 (the numpy writer has no bf16).
        data = safetensors.flax.save({k: jnp.asarray(v) for k, v in tensors.items()}, metadata=meta)
        _write_bytes(path, data)
    return meta


def _parse_safetensors_metadata(data: bytes, path: str) -> dict[str, str]:
    """The file's __metadata__ (the format: u64 little-endian header length, then a JSON header)."""
    try:
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
    except (struct.error, ValueError) as e:
        raise CheckpointError(f"{path}: not a safetensors file ({e})") from e
    return dict(header.get("__metadata__") or {})


def read_lora_metadata(path: str) -> dict[str, str]:
    """The metadata of a LoRA file written by save_lora (to rebuild the model it belongs to)."""
    data = _read_bytes(path)
    meta = _parse_safetensors_metadata(data, path)
    if meta.get("format") != LORA_FORMAT:
        raise CheckpointError(f"{path}: not a prepack LoRA export (metadata format {meta.get('format')!r})")
    return meta


def load_lora(
    model: Any,
    path: str,
    *,
    check_base: bool = True,
    expected: Mapping[str, Any] | None = None,
) -> dict[str, str]:
    """Sets a LoRA model's nnx.LoRAParam values from a save_lora file; returns its metadata.

    `model` is freshly built with the same LoRA (e.g. models.build_model + models.apply_lora
    with the file's model, rank and alpha). Refused, naming what differs: another rank,
    missing or extra module paths, other shapes, other base weights (fingerprint; pass
    check_base=False to apply anyway), or any `expected` metadata value (e.g.
    {"model": "gemma3-270m", "lora_alpha": 32.0}) that the file contradicts. Alpha is not a
    parameter (qwix keeps it in the provider), so only `expected` can check it. Values are
    cast to the model's dtype and placed with its shardings.
    """
    import jax
    import jax.numpy as jnp
    import safetensors.flax
    from flax import nnx

    data = _read_bytes(path)
    meta = _parse_safetensors_metadata(data, path)
    if meta.get("format") != LORA_FORMAT:
        raise CheckpointError(f"{path}: not a prepack LoRA export (metadata format {meta.get('format')!r})")
    for key, want in (expected or {}).items():
        have = meta.get(key)
        if have is None or (have != want and have != json.dumps(want)):
            raise CheckpointError(f"{path}: {key} is {have!r} in the file, expected {want!r}")
    loaded = safetensors.flax.load(data)

    state = nnx.state(model, nnx.LoRAParam)
    flat = {".".join(map(str, p)): var for p, var in nnx.to_flat_state(state)}
    if not flat:
        raise CheckpointError("the model has no LoRA parameters; apply LoRA (models.apply_lora) before load_lora")
    file_rank = int(meta["lora_rank"]) if meta.get("lora_rank", "None") != "None" else _lora_rank(loaded)
    model_rank = _lora_rank({k: v.get_value() for k, v in flat.items()})
    if file_rank != model_rank:
        raise CheckpointError(f"{path}: LoRA rank {file_rank} in the file, but the model's LoRA has rank {model_rank}")
    missing, extra = sorted(set(flat) - set(loaded)), sorted(set(loaded) - set(flat))
    if missing or extra:
        raise CheckpointError(
            f"{path}: LoRA module paths differ (file for model {meta.get('model')!r}): "
            f"{len(missing)} missing from the file {missing[:3]}, {len(extra)} not in the model {extra[:3]}"
        )
    for name, var in flat.items():
        if tuple(loaded[name].shape) != tuple(var.get_value().shape):
            raise CheckpointError(f"{path}: {name} has shape {tuple(loaded[name].shape)} in the file, {tuple(var.get_value().shape)} in the model")
    if check_base and meta.get("base_fingerprint"):
        mine = base_fingerprint(model)
        if mine != meta["base_fingerprint"]:
            raise CheckpointError(
                f"{path}: trained on other base weights ({meta.get('base_weights')!r}, fingerprint "
                f"{meta['base_fingerprint']}) than this model's (fingerprint {mine}); "
                "build the model with the same --model/--weights/--dtype/--seed, or pass check_base=False"
            )
    for name, var in flat.items():
        current = var.get_value()
        value = jnp.asarray(loaded[name], dtype=current.dtype)
        sharding = getattr(current, "sharding", None)
        var.set_value(jax.device_put(value, sharding) if sharding is not None else value)
    nnx.update(model, state)
    return meta
