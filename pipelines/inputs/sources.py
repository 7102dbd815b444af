"""Input specs -> read tasks, resolved in the launcher before the pipeline starts.

Everything that can be checked up front is checked here, so a typo in a path,
an unreachable Hub or an unprepared TFDS dataset fails in seconds with one
clear line instead of after workers have started. The result is a list of
`ReadTask`s: one per file, per byte range of a large plain JSONL file, or per
row range of a Hugging Face / TFDS split: small picklable values that the read
DoFn turns into records (readers.py).

Spec grammar (one --input):
  PATH or GLOB            .jsonl/.json/.parquet/.arrow files, local or gs://
                          (.gz/.bz2/.zst/.deflate compressed JSON(L) too)
  DIR or DIR:SPLIT        a local folder written by datasets' save_to_disk
  hf:NAME[:CONFIG][:SPLIT]  datasets.load_dataset (needs the network unless HF_HUB_OFFLINE=1)
  tfds:NAME[:SPLIT]       tfds.data_source (array_record datasets, no TensorFlow); NAME may
                          carry /config and :version, e.g. tfds:my_ds/cfg:1.0.0:train
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Sequence
from typing import Any

from pipelines.wire.records import TaskMeta
from prepack.storage import location_problem, match
from prepack.storage.patterns import PatternError, has_wildcard, literal_head

FILE_KINDS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".zst", ".deflate", ".lzma")
KNOWN_SPLITS = ("train", "validation", "valid", "test", "dev", "eval")
ROWS_PER_TASK = 50_000  # Hugging Face / TFDS row ranges per read task
# Plain (uncompressed) JSONL files are read in byte ranges, so that workers read and parse a big
# file side by side instead of one worker reading it and every record crossing a shuffle. The
# range size depends on the file's size alone: the split, and the example ids it implies, are the
# same on every run and for any number of workers.
JSONL_RANGES_PER_FILE = 64
JSONL_RANGE_MIN_BYTES = 1 << 20
JSONL_RANGE_MAX_BYTES = 64 << 20
# A task that may hold more input than this (a whole big compressed or non-JSONL file) makes the
# job reshuffle records after reading, so one worker does not tokenize it alone.
SPREAD_TASK_BYTES = 64 << 20
COMPRESSION_FACTOR = 8  # assumed for compressed files (and Parquet) when sizing that decision
EST_BYTES_PER_RECORD = 256  # only to size hash sub-buckets; a deterministic function of the input


class InputError(ValueError):
    """An input that cannot be read; raised before any pipeline work."""

    input_index: int | None = None  # which of the specs (resolve_inputs sets it)


@dataclasses.dataclass(frozen=True)
class ReadTask:
    """One unit of reading: a file, or a row range of a dataset split."""

    task_index: int
    input_index: int
    kind: str  # jsonl | json | parquet | arrow | hf_disk | hf_hub | tfds
    path: str  # file path; dataset folder; hub or TFDS name
    name: str  # stable name inside the input (relative path, or split), used in example ids
    size: int = 0  # bytes, for files
    params: tuple[tuple[str, Any], ...] = ()  # split/config/data_dir/start/end for datasets
    # For files: (size, mtime in ns) locally, (size, generation) on gs://, as planned; re-checked
    # after a whole-file read (file_stamp).
    stamp: tuple[int, float] | None = None

    def param(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)

    @property
    def byte_range(self) -> tuple[int, int] | None:
        """[start, end) of a plain JSONL file this task reads, None for a whole file or a dataset."""
        return (self.param("start"), self.param("end")) if self.kind == "jsonl" and self.params else None

    @property
    def id_name(self) -> str:
        """The name example ids use: a byte range's records are numbered within the range,
        so its ids carry the range's start ('data.jsonl@1048576/17')."""
        rng = self.byte_range
        return self.name if rng is None else f"{self.name}@{rng[0]}"

    def may_exceed(self, limit: int) -> bool:
        """Whether this task may read more than `limit` bytes of (uncompressed) input."""
        if self.kind in ("hf_disk", "hf_hub", "tfds"):
            return False  # row ranges of ROWS_PER_TASK
        rng = self.byte_range
        if rng is not None:
            return rng[1] - rng[0] > limit
        # Parquet compresses its columns itself.
        compressed = self.path.lower().endswith(COMPRESSED_SUFFIXES) or self.kind == "parquet"
        return self.size * (COMPRESSION_FACTOR if compressed else 1) > limit


def jsonl_range_bytes(size: int) -> int:
    """Bytes per read range of a plain JSONL file of `size` bytes."""
    return min(JSONL_RANGE_MAX_BYTES, max(JSONL_RANGE_MIN_BYTES, -(-size // JSONL_RANGES_PER_FILE)))


def _file_tasks(first_task: int, index: int, kind: str, path: str, name: str, size: int,
                stamp: tuple[int, float] | None = None) -> list[ReadTask]:
    step = jsonl_range_bytes(size)
    if kind != "jsonl" or path.lower().endswith(COMPRESSED_SUFFIXES) or size <= step:
        return [ReadTask(first_task, index, kind, path, name, size, stamp=stamp)]
    return [ReadTask(first_task + i, index, kind, path, name, size, (("end", min(size, start + step)), ("start", start)), stamp)
            for i, start in enumerate(range(0, size, step))]


def regular_file_stamp(path: str, shown: str) -> tuple[int, float]:
    """(size, mtime ns) of a local input; raises InputFileError, before anything opens it,
    unless it is a regular file (a symlink to one is fine): a FIFO or a device (/dev/zero)
    would block or never end."""
    import stat

    from pipelines.faults.failures import InputFileError

    try:
        st = os.stat(path)  # follows symlinks: what a read would open
    except OSError as e:
        raise InputFileError(f"{shown}: cannot read {path!r} ({e.strerror or e})") from e
    if not stat.S_ISREG(st.st_mode):
        what = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a character device" if stat.S_ISCHR(st.st_mode)
                else "a block device" if stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "not a file")
        target = f" (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
        raise InputFileError(f"{shown}: {path!r}{target} is {what}, not a regular file; only regular files and "
                             "gs:// objects are inputs: copy the data into a file")
    return st.st_size, st.st_mtime_ns


def file_stamp(path: str) -> tuple[int, float]:
    """The stamp a file has now (see ReadTask.stamp)."""
    if path.startswith("gs://"):
        from prepack.storage import object_stamp

        return object_stamp(path)
    return regular_file_stamp(path, path)


@dataclasses.dataclass(frozen=True)
class ResolvedInput:
    index: int
    spec: str
    kind: str  # files | hf_disk | hf_hub | tfds
    est_records: int
    fingerprint: str | None = None  # known up front for datasets; files are hashed while read
    info: tuple[tuple[str, Any], ...] = ()

    def describe(self) -> dict[str, Any]:
        return {"spec": self.spec, "kind": self.kind, **dict(self.info)}


def _glob_base(pattern: str) -> str:
    """The folder part of a pattern before its first wildcard: names are made relative to it."""
    head = literal_head(pattern)
    return head[: head.rfind("/") + 1] if "/" in head else ""


def file_kind(path: str) -> str | None:
    lower = path.lower()
    for suffix in COMPRESSED_SUFFIXES:
        if lower.endswith(suffix):
            lower = lower[: -len(suffix)]
            break
    return FILE_KINDS.get(os.path.splitext(lower)[1])


def resolve_inputs(specs: Sequence[str], tfds_data_dir: str | None = None) -> tuple[list[ResolvedInput], list[ReadTask]]:
    """Checks every input and lists the read tasks. Raises InputError naming the spec."""
    resolved: list[ResolvedInput] = []
    tasks: list[ReadTask] = []
    for index, spec in enumerate(specs):
        try:
            r, t = _resolve_one(index, spec, tfds_data_dir, len(tasks))
        except InputError as e:
            e.input_index = index
            raise
        resolved.append(r)
        tasks.extend(t)
    return resolved, tasks


_URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _resolve_one(index: int, spec: str, tfds_data_dir: str | None, first: int) -> tuple[ResolvedInput, list[ReadTask]]:
    if spec.startswith("hf:"):
        local = _split_local_dataset(spec[3:])
        if local is not None:
            return _resolve_hf_disk(index, spec, *local, first_task=first)
        return _resolve_hf_hub(index, spec, spec[3:], first_task=first)
    if spec.startswith("tfds:"):
        return _resolve_tfds(index, spec, spec[5:], tfds_data_dir, first_task=first)
    if spec.startswith("gs://") and location_problem(spec):
        raise InputError(f"input {location_problem(spec)}")
    if _URL_SCHEME.match(spec) and not spec.startswith("gs://"):
        raise InputError(f"input {spec!r}: only local paths and gs:// are read, not {spec.split('://')[0]}://; "
                         "copy the files to gs:// or a local disk")
    local = None if spec.startswith("gs://") else _split_local_dataset(spec)
    if local is not None:
        return _resolve_hf_disk(index, spec, *local, first_task=first)
    return _resolve_files(index, spec, first_task=first)


def task_metas(inputs: Sequence[ResolvedInput], tasks: Sequence[ReadTask]) -> tuple[TaskMeta, ...]:
    """What workers need to name each task's records (example ids, dead-letter sources)."""
    return tuple(TaskMeta(t.input_index, inputs[t.input_index].spec, t.path, t.id_name,
                          t.byte_range[0] if t.byte_range else None) for t in tasks)


# ----------------------------------------------------------------------------- files


def _resolve_files(index: int, spec: str, first_task: int) -> tuple[ResolvedInput, list[ReadTask]]:
    if not spec.startswith("gs://") and os.path.isdir(spec):
        raise InputError(
            f"input {spec!r} is a folder but not a save_to_disk dataset (no state.json or dataset_dict.json); "
            f"give a file or a glob such as '{os.path.join(spec, '*.jsonl')}'"
        )
    try:
        matches = match(spec)
    except PatternError as e:  # no path can match it: said in words
        raise InputError(f"input {e}") from None  # "input pattern '...': its character class ..."
    except Exception as e:  # the storage's own: no such bucket, no access or credentials, unreachable
        raise InputError(f"input {spec!r}: cannot list it ({type(e).__name__}: {e})") from e
    files = sorted(m for m in matches if not m[0].endswith("/"))
    if not files:
        what = "the pattern matches no file" if has_wildcard(spec) else "no such file"
        raise InputError(f"input {spec!r}: {what}")
    base = _glob_base(spec) if has_wildcard(spec) else os.path.dirname(spec)
    tasks = []
    total = 0
    for path, size in files:
        kind = file_kind(path)
        if kind is None:
            raise InputError(
                f"input {spec!r}: cannot tell the file format of {path!r}; expected one of "
                f"{', '.join(sorted(FILE_KINDS))} (optionally compressed: {', '.join(COMPRESSED_SUFFIXES)})"
            )
        if path.startswith("gs://"):
            stamp = file_stamp(path)  # (size, generation): one metadata request per object, when planned
        else:
            from pipelines.faults.failures import InputFileError

            try:
                stamp = regular_file_stamp(path, f"input {spec!r}")  # before open: a FIFO would block it
                size = stamp[0]
                with open(path, "rb") as f:
                    f.read(1)
            except InputFileError as e:
                raise InputError(str(e)) from e
            except OSError as e:
                raise InputError(f"input {spec!r}: cannot read {path!r} ({e.strerror or e})") from e
        name = path[len(base):] if base and path.startswith(base) else os.path.basename(path)
        tasks += _file_tasks(first_task + len(tasks), index, kind, path, name.lstrip("/"), size, stamp)
        total += size
    est = max(1, math.ceil(total / EST_BYTES_PER_RECORD))
    return ResolvedInput(index, spec, "files", est, None, (("files", len(files)), ("bytes", total))), tasks


# ----------------------------------------------------------------------------- save_to_disk folders


def _split_local_dataset(target: str) -> tuple[str, str | None] | None:
    """(folder, split) when `target` is a local save_to_disk folder, optionally ':SPLIT'."""
    candidates = [(target, None)]
    if ":" in target:
        folder, split = target.rsplit(":", 1)
        candidates.append((folder, split))
    for folder, split in candidates:
        if os.path.isdir(folder) and any(
            os.path.exists(os.path.join(folder, marker)) for marker in ("state.json", "dataset_dict.json")
        ):
            return folder, split
    return None


def _row_range_tasks(index: int, kind: str, path: str, name: str, num_rows: int, first_task: int, **params: Any) -> list[ReadTask]:
    tasks = []
    for start in range(0, num_rows, ROWS_PER_TASK):
        end = min(num_rows, start + ROWS_PER_TASK)
        task_params = tuple(sorted({**params, "start": start, "end": end}.items()))
        tasks.append(ReadTask(first_task + len(tasks), index, kind, path, name, 0, task_params))
    return tasks


def _resolve_hf_disk(index: int, spec: str, folder: str, split: str | None, first_task: int) -> tuple[ResolvedInput, list[ReadTask]]:
    try:
        import datasets
    except ImportError as e:
        raise InputError(f"input {spec!r}: reading a save_to_disk folder needs the 'datasets' package ({e})") from e
    folder = os.path.abspath(folder)
    try:
        loaded = datasets.load_from_disk(folder)
    except Exception as e:
        raise InputError(f"input {spec!r}: load_from_disk failed ({type(e).__name__}: {e})") from e
    ds, split_name = _pick_split(spec, loaded, split)
    tasks = _row_range_tasks(index, "hf_disk", folder, split_name or "data", len(ds), first_task, split=split_name)
    info = (("rows", len(ds)), ("split", split_name), ("columns", list(ds.column_names)))
    return ResolvedInput(index, spec, "hf_disk", max(1, len(ds)), f"datasets:{ds._fingerprint}", info), tasks


def _pick_split(spec: str, loaded: Any, split: str | None) -> tuple[Any, str | None]:
    import datasets

    if isinstance(loaded, datasets.DatasetDict):
        names = sorted(loaded)
        if split is None:
            if len(names) == 1:
                split = names[0]
            elif "train" in loaded:
                split = "train"
            else:
                raise InputError(f"input {spec!r}: the dataset has splits {names}; name one as {spec}:SPLIT")
        if split not in loaded:
            raise InputError(f"input {spec!r}: no split {split!r}; the dataset has {names}")
        return loaded[split], split
    if split is not None:
        raise InputError(f"input {spec!r}: the folder holds a single Dataset, not a DatasetDict; drop ':{split}'")
    return loaded, None


# ----------------------------------------------------------------------------- Hugging Face Hub


def parse_hf_spec(target: str) -> tuple[str, str | None, str]:
    """hf:NAME[:CONFIG][:SPLIT] -> (name, config, split). With one extra part it is a
    split when it looks like one (train, test, validation, or a slice), else a config."""
    parts = target.split(":")
    if not parts[0]:
        raise InputError("input 'hf:': give a dataset name, e.g. hf:OpenAssistant/oasst1:train")
    if len(parts) == 1:
        return parts[0], None, "train"
    if len(parts) == 2:
        extra = parts[1]
        if extra in KNOWN_SPLITS or "[" in extra or extra.split("[")[0] in KNOWN_SPLITS:
            return parts[0], None, extra
        return parts[0], extra or None, "train"
    if len(parts) == 3:
        return parts[0], parts[1] or None, parts[2] or "train"
    raise InputError(f"input 'hf:{target}': expected hf:NAME[:CONFIG][:SPLIT]")


def _hub_offline() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on") for v in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"))


def _resolve_hf_hub(index: int, spec: str, target: str, first_task: int) -> tuple[ResolvedInput, list[ReadTask]]:
    name, config, split = parse_hf_spec(target)
    try:
        import datasets
    except ImportError as e:
        raise InputError(f"input {spec!r}: needs the 'datasets' package ({e})") from e
    if not _hub_offline():
        # A quick probe: datasets itself retries for ~30 s before giving up offline.
        try:
            import huggingface_hub

            huggingface_hub.HfApi().dataset_info(name, timeout=15)
        except Exception as e:
            kind = type(e).__name__
            if "NotFound" in kind or "Gated" in kind or "401" in str(e) or "404" in str(e):
                raise InputError(f"input {spec!r}: the Hugging Face Hub has no accessible dataset {name!r} ({kind})") from e
            raise InputError(
                f"input {spec!r}: cannot reach the Hugging Face Hub ({kind}: {e}). hf: inputs need the network; "
                f"set HF_HUB_OFFLINE=1 to use a cached copy, or save the dataset with save_to_disk/to_parquet "
                f"and pass that path"
            ) from e
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:
        raise InputError(f"input {spec!r}: load_dataset({name!r}, {config!r}, split={split!r}) failed ({type(e).__name__}: {e})") from e
    tasks = _row_range_tasks(index, "hf_hub", name, split, len(ds), first_task, config=config, split=split)
    info = (("rows", len(ds)), ("name", name), ("config", config), ("split", split), ("columns", list(ds.column_names)))
    return ResolvedInput(index, spec, "hf_hub", max(1, len(ds)), f"datasets:{ds._fingerprint}", info), tasks


# ----------------------------------------------------------------------------- TFDS

_VERSION = re.compile(r"^\d+\.\d+\.\d+$")


def parse_tfds_spec(target: str) -> tuple[str, str]:
    """tfds:NAME[:SPLIT] -> (name, split); NAME may end in :X.Y.Z (a version)."""
    if not target:
        raise InputError("input 'tfds:': give a dataset name, e.g. tfds:my_dataset:train")
    parts = target.split(":")
    if len(parts) == 1 or _VERSION.match(parts[-1]):
        return target, "train"
    return ":".join(parts[:-1]), parts[-1] or "train"


def _resolve_tfds(index: int, spec: str, target: str, data_dir: str | None, first_task: int) -> tuple[ResolvedInput, list[ReadTask]]:
    name, split = parse_tfds_spec(target)
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise InputError(f"input {spec!r}: needs the 'tensorflow-datasets' package ({e})") from e
    try:
        source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
        num_rows = len(source)
        builder = tfds.builder(name, data_dir=data_dir)
        version = str(builder.info.version)
        files = sorted(os.path.basename(str(f)) for f in builder.info.splits[split].filenames)
    except Exception as e:
        raise InputError(
            f"input {spec!r}: cannot open TFDS dataset {name!r} split {split!r}"
            f"{' in ' + data_dir if data_dir else ''} ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}). "
            f"It must be prepared in array_record format (tfds build --file_format=array_record) "
            f"and is read without TensorFlow"
        ) from e
    import hashlib

    fingerprint = hashlib.sha256(repr((name, version, split, num_rows, files)).encode()).hexdigest()
    tasks = _row_range_tasks(index, "tfds", name, split, num_rows, first_task, split=split, data_dir=data_dir)
    info = (("rows", num_rows), ("name", name), ("split", split), ("version", version))
    return ResolvedInput(index, spec, "tfds", max(1, num_rows), f"tfds-metadata:{fingerprint}", info), tasks
