"""Worker side of reading: one ReadTask -> batches of raw records with their location.

A raw record is `(record_index, line, kind, payload)`:
- RAW_TEXT: payload is the bytes of one JSON text (a JSONL line). Decoding and
  parsing happen in the tokenizing step, so they run wherever the records are
  tokenized (after a reshuffle, when a big unsplittable file is read by one worker).
- RAW_OBJECT: payload is an already parsed record (JSON arrays, Parquet, Arrow,
  Hugging Face, TFDS rows).
- RAW_ERROR: payload is (reason, message, raw) for a record that is bad already
  at reading (undecodable TFDS text, an unparseable JSON array file).
`record_index` counts records from 0 within the task's file or split, or within
its byte range for a range of a JSONL file; `line` is the 1-based line (within
the range, for a range) for JSONL and 0 otherwise. A range's records are those
whose line starts inside it; the dead-letter writer turns range-relative
numbers into file numbers from every range's counts (FileDigest.lines).

File tasks also report a sha256 of the bytes they read: the inputs' content
fingerprint in the manifest, at no extra pass over JSONL.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from typing import Any

from pipelines.inputs import compressed, sources
from pipelines.faults import failpoints
from pipelines.faults.failures import InputFileError
from pipelines.inputs.limits import InputLimits
from pipelines.inputs.sources import ReadTask
from prepack.storage import open_stream

# orjson parses a record ~4x faster than json (~0.7 vs ~3 us on the sample records), and gives
# the same objects for every text it accepts, except integers beyond 64 bits (it returns a
# float): texts with a run of 19+ digits go to json, as does every text orjson rejects (NaN,
# Infinity, out-of-range floats, lone surrogates, invalid UTF-8, bad JSON), so results and
# error messages stay json's. Optional: without orjson, json parses everything.
try:
    from orjson import JSONDecodeError as _orjson_error
    from orjson import loads as _orjson_loads
except ImportError:  # pragma: no cover - orjson is not a declared dependency
    _orjson_loads = None
    _orjson_error = ValueError
_DIGITS_AS_ZERO = bytes.maketrans(b"0123456789", b"0" * 10)
_LONG_DIGITS = b"0" * 19  # in payload.translate(_DIGITS_AS_ZERO): a run of 19+ digits

RAW_TEXT, RAW_OBJECT, RAW_ERROR = 0, 1, 2
RAW_SNIPPET_CHARS = 500  # raw text kept in a dead-letter entry
READ_BLOCK = 4 << 20

RawRecord = tuple[int, int, int, Any]


class FileDigest:
    """sha256 and size of what a task read; for a JSONL byte range also the number of lines
    that start in it (blank ones included), which places the next range's lines in the file."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()
        self.num_bytes = 0
        self.lines: int | None = None

    def update(self, data: bytes) -> None:
        self._h.update(data)
        self.num_bytes += len(data)

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def snippet(raw: Any) -> str:
    """A short, always-JSON-safe rendering of a bad record for the dead letter."""
    if isinstance(raw, bytes):
        text = raw[: RAW_SNIPPET_CHARS * 4].decode("utf-8", errors="backslashreplace")
    elif isinstance(raw, str):
        text = raw
    else:
        try:
            text = json.dumps(raw, ensure_ascii=False, default=repr)
        except Exception:
            text = repr(raw)
    return text if len(text) <= RAW_SNIPPET_CHARS else text[:RAW_SNIPPET_CHARS] + "…"


def _file_blocks(task: ReadTask, limits: InputLimits) -> Iterator[bytes]:
    """The file's (decompressed) bytes, in blocks of at most READ_BLOCK (compressed.OUT_BLOCK);
    a truncated or corrupt compressed file raises InputFileError naming it (pipelines/inputs/compressed.py),
    never a shorter file, as does a file over a limit (pipelines/inputs/limits.py) or one that is
    not the file planned (another size or mtime, or not a regular file any more)."""
    failpoints.hit("input_read", "start")  # tests hold a worker here, mid-pipeline
    _check_unchanged(task)  # a local path that became a FIFO or a device is refused before open
    yield from _stream_blocks(task.path, limits)
    failpoints.hit("input_read", "whole_file")  # tests change the file here, after it was read
    _check_unchanged(task)


def _stream_blocks(path: str, limits: InputLimits) -> Iterator[bytes]:
    suffix = compressed.suffix_of(path)
    try:
        stream = open_stream(path)
    except OSError as e:  # a gs:// object stored compressed twice, no access: one line naming it
        said = str(e) if str(e).startswith(path) else f"{path}: cannot be read ({e.strerror or e})"
        raise InputFileError(said) from None
    with stream as f:
        if suffix is not None:
            yield from compressed.decompressed_blocks(f, path, suffix, limits=limits)
        else:
            produced = 0
            while True:
                block = f.read(READ_BLOCK)
                if not block:
                    break
                produced += len(block)
                limits.check_output(path, produced, None)
                yield block


def _check_unchanged(task: ReadTask) -> None:
    if task.stamp is None:  # a task made by hand (tests, preflight over a path): nothing planned to compare
        return
    now = sources.file_stamp(task.path)
    if tuple(now) != tuple(task.stamp):
        raise InputFileError(
            f"{task.path} changed while the job ran (size {task.stamp[0]:,} and "
            f"{'generation' if task.path.startswith('gs://') else 'mtime'} {task.stamp[1]} when planned, "
            f"now {now[0]:,} and {now[1]}); an input must not change while the job runs: run the job again on a copy")


def _read_all(task: ReadTask, digest: FileDigest, limits: InputLimits) -> bytes:
    chunks = []
    held = 0
    for block in _file_blocks(task, limits):
        digest.update(block)
        held += len(block)
        limits.check_whole_file(task.path, held)
        chunks.append(block)
    return b"".join(chunks)


def _jsonl_lines(data_blocks: Iterable[bytes], limit: int, skip_first: bool = False) -> Generator[tuple[int, bytes | None], None, int]:
    """(1-based line number, line) for every non-blank line, (number, None) for a line longer
    than `limit` bytes, whose bytes are dropped up to its newline instead of held; handles lines
    across blocks. skip_first: the text before the first newline is the end of a line that
    started earlier (a byte range): not counted. Returns the number of lines counted."""
    carry = b""
    over = False  # the line being read is already over the limit: drop its bytes
    number = 0
    for block in data_blocks:
        parts = block.split(b"\n")
        tail = parts.pop()
        if parts:
            head = parts[0]
            parts[0] = None if over or len(carry) + len(head) > limit else carry + head
            carry, over = b"", False
            for line in parts:
                if skip_first:
                    skip_first = False
                    continue
                number += 1
                if line is None or len(line) > limit:
                    yield number, None
                elif line.strip():
                    yield number, line
        if not over:
            if len(carry) + len(tail) > limit:
                carry, over = b"", True
            else:
                carry += tail
    if (carry or over) and not skip_first:  # the last line, without a newline
        number += 1
        if over:
            yield number, None
        elif carry.strip():
            yield number, carry
    return number


def _blocks(task: ReadTask, digest: FileDigest, limits: InputLimits) -> Iterator[bytes]:
    for block in _file_blocks(task, limits):
        digest.update(block)
        yield block


def _raw_lines(lines: Iterable[tuple[int, bytes | None]], limit: int) -> Iterator[RawRecord]:
    for index, (number, line) in enumerate(lines):
        if line is None:
            yield index, number, RAW_ERROR, ("too_large", f"the line is longer than {limit:,} bytes (--max-record-bytes); "
                                             "it was skipped unread", "")
        else:
            yield index, number, RAW_TEXT, line


def iter_jsonl(task: ReadTask, digest: FileDigest, limits: InputLimits = InputLimits()) -> Iterator[RawRecord]:
    limit = limits.max_record_bytes
    if task.byte_range is None:
        lines = _jsonl_lines(_blocks(task, digest, limits), limit)
    else:
        lines = _jsonl_range_lines(task, digest, limit)
    yield from _raw_lines(lines, limit)


_TAIL_BLOCK = 64 << 10  # first read past a range's end, for the rest of its last line (doubles)
RANGE_BUFFER_BYTES = 1 << 20  # what one gs:// request of a range read fetches: a range is read once, in small blocks


def _range_blocks(task: ReadTask, digest: FileDigest) -> Iterator[bytes]:
    """Bytes from the one before the range's start to the newline that ends the last line
    starting inside the range (or the end of the file); the digest gets exactly [start, end)."""
    start, end = task.byte_range
    pos = max(start - 1, 0)  # the byte before the range says whether a line starts at `start`
    if not task.path.startswith("gs://"):
        sources.regular_file_stamp(task.path, task.path)  # a FIFO would block the open
    with open_stream(task.path, RANGE_BUFFER_BYTES) as f:
        f.seek(0, os.SEEK_END)
        if f.tell() != task.size:
            raise InputFileError(f"{task.path} has {f.tell()} bytes, but had {task.size} when the job was planned; "
                               "an input must not change while the job runs")
        f.seek(pos)
        last = b"\n"
        while pos < end:
            block = f.read(min(READ_BLOCK, end - pos))
            if not block:
                raise InputFileError(f"{task.path} ended at byte {pos}, before {end}; it changed while the job ran")
            digest.update(memoryview(block)[max(start - pos, 0):])
            pos += len(block)
            last = block[-1:]
            yield block
        size = _TAIL_BLOCK
        while last != b"\n":
            block = f.read(size)
            if not block:
                return
            cut = block.find(b"\n")
            if cut != -1:
                yield block[: cut + 1]
                return
            yield block
            size = min(size * 2, READ_BLOCK)  # a bounded buffer, however long the line


def _jsonl_range_lines(task: ReadTask, digest: FileDigest, limit: int) -> Iterator[tuple[int, bytes | None]]:
    """(line number within the range, line) for every non-blank line that starts in the task's
    byte range [start, end); the last one may run past `end`. Streams the range in blocks."""
    skip_first = task.byte_range[0] > 0  # the line holding byte start - 1 began before the range
    digest.lines = yield from _jsonl_lines(_range_blocks(task, digest), limit, skip_first)


def iter_json(task: ReadTask, digest: FileDigest, limits: InputLimits = InputLimits()) -> Iterator[RawRecord]:
    return _json_records(_read_all(task, digest, limits), limits)


def _json_records(data: bytes, limits: InputLimits) -> Iterator[RawRecord]:
    try:
        parsed = json.loads(data)
    except RecursionError:
        yield 0, 0, RAW_ERROR, ("too_deeply_nested", "JSON nested too deeply to parse (over ~1,000 levels)", snippet(data))
        return
    except UnicodeDecodeError as e:
        yield 0, 0, RAW_ERROR, ("undecodable_bytes", f"the file is not UTF-8 ({e})", snippet(data))
        return
    except json.JSONDecodeError:
        # JSON Lines under a .json name (the same rule as `prepack preflight`).
        yield from _raw_lines(_jsonl_lines([data], limits.max_record_bytes), limits.max_record_bytes)
        return
    if isinstance(parsed, dict) and isinstance(parsed.get("data"), list):
        parsed = parsed["data"]
    if isinstance(parsed, dict):
        parsed = [parsed]  # a file holding one record
    if not isinstance(parsed, list):
        yield 0, 0, RAW_ERROR, ("malformed_json", "expected a JSON array of records", snippet(data))
        return
    for index, record in enumerate(parsed):
        problem = bad_text(record)
        if problem is not None:
            yield index, 0, RAW_ERROR, ("bad_text", problem, snippet(json.dumps(record)))  # ASCII: no surrogate in it
            continue
        yield index, 0, RAW_OBJECT, record


def iter_parquet(task: ReadTask, digest: FileDigest, batch_size: int, limits: InputLimits = InputLimits()) -> Iterator[RawRecord]:
    return _parquet_records(_read_all(task, digest, limits), batch_size)


def _parquet_records(data: bytes, batch_size: int) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    index = 0
    for batch in pq.ParquetFile(pa.BufferReader(data)).iter_batches(batch_size=batch_size):
        for record in batch.to_pylist():
            yield index, 0, RAW_OBJECT, record
            index += 1


def iter_arrow(task: ReadTask, digest: FileDigest, limits: InputLimits = InputLimits()) -> Iterator[RawRecord]:
    return _arrow_records(_read_all(task, digest, limits))


def _arrow_records(data: bytes) -> Iterator[RawRecord]:
    import pyarrow as pa
    import pyarrow.ipc as ipc

    try:
        reader = ipc.open_stream(pa.BufferReader(data))  # what datasets writes
        batches = iter(reader)
    except pa.ArrowInvalid:
        file_reader = ipc.open_file(pa.BufferReader(data))
        batches = (file_reader.get_batch(i) for i in range(file_reader.num_record_batches))
    index = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield index, 0, RAW_OBJECT, record
            index += 1


# Datasets opened once per worker process: a task is a row range of one of them.
_DATASETS: dict[tuple, Any] = {}


def _hf_dataset(task: ReadTask) -> Any:
    key = (task.kind, task.path, task.param("config"), task.param("split"))
    ds = _DATASETS.get(key)
    if ds is None:
        import datasets

        if task.kind == "hf_disk":
            ds = datasets.load_from_disk(task.path)
            if task.param("split") is not None:
                ds = ds[task.param("split")]
        else:
            ds = datasets.load_dataset(task.path, task.param("config"), split=task.param("split"))
        _DATASETS[key] = ds.with_format("arrow")
        ds = _DATASETS[key]
    return ds


def iter_hf(task: ReadTask, batch_size: int) -> Iterator[RawRecord]:
    ds = _hf_dataset(task)
    start, end = task.param("start"), task.param("end")
    for lo in range(start, end, batch_size):
        table = ds[lo : min(end, lo + batch_size)]
        for offset, record in enumerate(table.to_pylist()):
            yield lo + offset, 0, RAW_OBJECT, record


def _tfds_source(task: ReadTask) -> Any:
    key = ("tfds", task.path, task.param("split"), task.param("data_dir"))
    source = _DATASETS.get(key)
    if source is None:
        import tensorflow_datasets as tfds

        source = _DATASETS[key] = tfds.data_source(task.path, split=task.param("split"), data_dir=task.param("data_dir"), download=False)
    return source


class _Undecodable(Exception):
    def __init__(self, path: str, error: UnicodeDecodeError):
        super().__init__(f"field '{path}': not UTF-8 text ({error})")
        self.path = path


def _plain(value: Any, path: str = "") -> Any:
    """TFDS values (bytes, numpy scalars and arrays) -> the JSON-like values templates expect."""
    import numpy as np

    if isinstance(value, dict):
        return {k: _plain(v, f"{path}.{k}" if path else str(k)) for k, v in value.items()}
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _Undecodable(path, e) from None
    if isinstance(value, np.ndarray):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value.tolist())]
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{path}[{i}]") for i, v in enumerate(value)]
    return value


def iter_tfds(task: ReadTask, batch_size: int) -> Iterator[RawRecord]:
    source = _tfds_source(task)
    start, end = task.param("start"), task.param("end")
    for lo in range(start, end, batch_size):
        indices = list(range(lo, min(end, lo + batch_size)))
        records = source.__getitems__(indices) if hasattr(source, "__getitems__") else [source[i] for i in indices]
        for i, record in zip(indices, records):
            try:
                yield i, 0, RAW_OBJECT, _plain(record)
            except _Undecodable as e:
                yield i, 0, RAW_ERROR, ("undecodable_bytes", str(e), snippet(repr(record)))


def iter_task(task: ReadTask, digest: FileDigest, batch_size: int, limits: InputLimits | None = None) -> Iterator[RawRecord]:
    limits = limits or InputLimits()
    readers: dict[str, Callable[[], Iterator[RawRecord]]] = {
        "jsonl": lambda: iter_jsonl(task, digest, limits),
        "json": lambda: iter_json(task, digest, limits),
        "parquet": lambda: iter_parquet(task, digest, batch_size, limits),
        "arrow": lambda: iter_arrow(task, digest, limits),
        "hf_disk": lambda: iter_hf(task, batch_size),
        "hf_hub": lambda: iter_hf(task, batch_size),
        "tfds": lambda: iter_tfds(task, batch_size),
    }
    return readers[task.kind]()


def parse_text(payload: bytes) -> tuple[Any, tuple[str, str] | None]:
    """(record, None) or (None, (reason, message)) for one JSON text."""
    if _orjson_loads is not None and _LONG_DIGITS not in payload.translate(_DIGITS_AS_ZERO):
        try:
            return _orjson_loads(payload), None
        except _orjson_error:
            pass  # the json path below decides, and words the error
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, ("undecodable_bytes", f"not UTF-8 text ({e})")
    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        return None, ("malformed_json", f"not valid JSON ({e})")
    except RecursionError:
        return None, ("too_deeply_nested", "JSON nested too deeply to parse (over ~1,000 levels)")
    except Exception as e:  # whatever else the parser cannot handle is this record's problem, not the job's
        return None, ("unparseable", f"the JSON parser failed on this record ({type(e).__name__}: {e})")
    # json (unlike orjson, which sent the text here) accepts escaped lone surrogates ("\ud800"):
    # text no tokenizer can encode (sentencepiece raises, tiktoken silently replaces it).
    problem = bad_text(record)
    if problem is not None:
        return None, ("bad_text", problem)
    return record, None


def bad_text(value: Any, path: str = "") -> str | None:
    """Why a parsed record holds text that cannot be encoded (a lone surrogate), naming the
    field; None when all its text is encodable. Only json-parsed values can hold such text."""
    stack = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if not item.isascii():
                try:
                    item.encode("utf-8")
                except UnicodeEncodeError as e:
                    return (f"field '{where or '.'}': text that cannot be encoded as UTF-8 at character {e.start} "
                            f"({item[e.start:e.end]!a}, a lone surrogate); fix the record or leave it out")
        elif isinstance(item, dict):
            for k, v in item.items():
                if isinstance(k, str) and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return f"a field name under '{where or '.'}' cannot be encoded as UTF-8 (a lone surrogate)"
                stack.append((v, f"{where}.{k}" if where else str(k)))
        elif isinstance(item, list):
            stack.extend((v, f"{where}[{i}]") for i, v in enumerate(item))
    return None



def sample(task: ReadTask, count: int, limits: InputLimits | None = None) -> list[Any]:
    """The first `count` records of a task that parse (bad ones are skipped), read before the
    job as the launcher's look at an input (`--format auto`, the format check): no failpoint,
    no digest; a JSON Lines file is read only as far as those records."""
    limits = limits or InputLimits()
    if task.kind == "jsonl":
        raw: Iterable[RawRecord] = _raw_lines(_jsonl_lines(_stream_blocks(task.path, limits), limits.max_record_bytes),
                                              limits.max_record_bytes)
    elif task.kind in ("json", "parquet", "arrow"):
        data = b"".join(_stream_blocks(task.path, limits))
        limits.check_whole_file(task.path, len(data))
        raw = {"json": lambda: _json_records(data, limits), "parquet": lambda: _parquet_records(data, count),
               "arrow": lambda: _arrow_records(data)}[task.kind]()
    else:
        raw = iter_task(task, FileDigest(), count, limits)
    out: list[Any] = []
    for _, _, kind, payload in raw:
        record = parse_text(payload)[0] if kind == RAW_TEXT else payload if kind == RAW_OBJECT else None
        if record is not None:
            out.append(record)
            if len(out) >= count:
                break
    return out
