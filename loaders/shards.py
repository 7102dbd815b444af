"""Opening a published shard set: validation with clear errors, and random access to its rows.

`open_shards` checks, before any training step runs, everything that would
otherwise surface as a shape error or silently wrong data mid-run:
the manifest exists and is of a supported format, the shards were packed for
the max_length and tokenizer the trainer uses, and every shard file is present
with the size, row count and record size the manifest promises (plus, with
verify=True, its sha256). A gs:// shard is checked when its local copy is made
(its sha256, always) and opened, on first read (see loaders/shard_cache.py).

Every error raised here is a `prepack.format.manifest.ManifestError` (ShardSetError is
one) and names the path it is about.
"""

from __future__ import annotations

import collections
import functools
import logging
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent import futures
from typing import Any, Protocol

import numpy as np

from prepack import storage
from loaders.shard_cache import ShardCache, ShardCacheError, ShardDigestError
from prepack.format import rowformat
from prepack.format.manifest import MANIFEST_NAME, Manifest, ManifestError

log = logging.getLogger(__name__)

# Random access: no readahead (each read wants one record), a small buffer.
_READER_OPTIONS = "readahead_buffer_size:0"
_READER_BUFFER = 32768
# Reading a whole shard in order (ShardView.scan): readahead, one thread (measured 4x faster per row).
_SCAN_OPTIONS = "readahead_buffer_size:16777216,max_parallelism:1"


class ShardSetError(ManifestError):
    """A shard set that cannot be used: no manifest, or a shard file missing, short or corrupt."""


class HasIdentity(Protocol):
    def identity(self) -> dict[str, Any]: ...


TokenizerLike = Mapping[str, Any] | HasIdentity


def tokenizer_identity(tokenizer: TokenizerLike | None) -> dict[str, Any] | None:
    """Accepts a Tokenizer (anything with .identity()) or its identity dict."""
    if tokenizer is None:
        return None
    if isinstance(tokenizer, Mapping):
        return dict(tokenizer)
    identity = getattr(tokenizer, "identity", None)
    if callable(identity):
        return dict(identity())
    raise TypeError(f"tokenizer must be a Tokenizer (with .identity()) or its identity dict, not {type(tokenizer).__name__}")


def _close_quietly(reader: Any) -> None:
    # Closing a reader of a broken file raises riegeli's error again; the caller has its own.
    try:
        reader.close()
    except Exception:
        pass


def _open_reader(path: str):
    from array_record.python.array_record_module import ArrayRecordReader

    return ArrayRecordReader(path, _READER_OPTIONS, file_reader_buffer_size=_READER_BUFFER)


class ShardView:
    """Random access to the rows of an opened shard set.

    len(view) rows; view[i] is row i as a dict of int32 [L] arrays (read-only
    views of the record); view.read(indices) is a batch as int32 [n, L] arrays.
    Row i is the i-th record when the shards are read in manifest order.

    Local (and gcsfuse) shards are read in place. gs:// shards are read from
    whole-file local copies (loaders.shard_cache): a shard is downloaded, with
    one GET, on its first read or by prefetch(), and checked against the manifest.

    Each shard's reader opens once per process, on first use (opening reads the
    footer): readers are dropped when pickled, so a view can go to worker processes.
    """

    def __init__(self, path: str, manifest: Manifest, readers: Sequence[Any] | None = None, cache: ShardCache | None = None):
        self.path = path
        self.manifest = manifest
        self.shard_paths: tuple[str, ...] = tuple(storage.join(path, s.path) for s in manifest.shards)
        self.cache = (cache or ShardCache()) if storage.is_gcs(path) else None
        counts = [s.num_rows for s in manifest.shards]
        # starts[k] = global index of shard k's first row.
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self._readers: list[Any] = list(readers) if readers is not None else [None] * len(counts)
        self._init_locks()

    def _init_locks(self) -> None:
        # One lock per shard: opening one (maybe a download) never waits on another.
        self._locks = [threading.Lock() for _ in self.shard_paths]
        self._prefetch_lock = threading.Lock()
        self._prefetching = False  # per process: a worker process starts its own
        self._prefetch_wanted = getattr(self, "_prefetch_wanted", 0)

    @property
    def max_length(self) -> int:
        return self.manifest.max_length

    @property
    def is_remote(self) -> bool:
        """True for gs:// sets (read through the local shard cache)."""
        return self.cache is not None

    def __len__(self) -> int:
        return self.manifest.num_rows

    def __repr__(self) -> str:
        return f"ShardView({self.path!r}, rows={len(self)}, shards={len(self.shard_paths)}, max_length={self.max_length})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = [None] * len(self._readers)
        for name in ("_locks", "_prefetch_lock", "_prefetching"):
            del state[name]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._init_locks()

    def _open(self, shard: int, verify: bool = False):
        info = self.manifest.shards[shard]
        name = self.shard_paths[shard]
        if self.cache is None:
            return _check_shard(name, info, self.max_length, verify=False, version=self.manifest.format_version)
        local = self._fetch(shard, verify)
        # The sha256 matched when the copy was made: the checks below are cheap and local.
        try:
            return _check_shard(local, info, self.max_length, verify=False, name=name, version=self.manifest.format_version)
        except ShardSetError:
            # The copy rotted on this disk since it was checked: drop it and fetch it once more.
            self.cache.drop(info.sha256)
            return _check_shard(self._fetch(shard, verify=False), info, self.max_length, verify=False, name=name, version=self.manifest.format_version)

    def _fetch(self, shard: int, verify: bool) -> str:
        info = self.manifest.shards[shard]
        name = self.shard_paths[shard]
        try:
            return self.cache.fetch(name, info.sha256, info.num_bytes, verify=verify)
        except (ShardCacheError, ShardDigestError) as e:
            raise ShardSetError(str(e)) from e
        except Exception as e:  # the client's network errors: name the shard, keep the reason
            raise ShardSetError(f"{name}: download failed ({type(e).__name__}: {e}); check access to the bucket and retry") from e

    def _reader(self, shard: int, verify: bool = False):
        reader = self._readers[shard]
        if reader is None:
            with self._locks[shard]:
                if self._readers[shard] is None:
                    self._readers[shard] = self._open(shard, verify)
                reader = self._readers[shard]
        return reader

    def _refetch(self, shard: int, failed: Any) -> Any:
        """A new reader of a fresh copy of a cached shard whose record failed its checksum."""
        with self._locks[shard]:
            if self._readers[shard] is failed:
                _close_quietly(failed)
                self._readers[shard] = None
                self.cache.drop(self.manifest.shards[shard].sha256)
                self._readers[shard] = self._open(shard)
            return self._readers[shard]

    def prefetch(self, threads: int = 8) -> None:
        """Starts fetching every shard in the background (gs:// sets; a no-op for local ones).

        The setting survives pickling: a worker process starts its own on its first read.
        Errors are left to the read that needs the shard, which retries and raises them.
        """
        if self.cache is None:
            return
        self._prefetch_wanted = threads
        self._start_prefetch()

    def _start_prefetch(self) -> None:
        with self._prefetch_lock:
            if self._prefetching or not self._prefetch_wanted:
                return
            self._prefetching = True
        todo = collections.deque(range(len(self.shard_paths)))  # popleft is atomic

        def work() -> None:
            while todo:
                try:
                    shard = todo.popleft()
                except IndexError:
                    return
                try:
                    self._reader(shard)
                except Exception:  # the foreground read of this shard retries and reports it
                    pass

        for k in range(min(self._prefetch_wanted, len(todo))):
            threading.Thread(target=work, daemon=True, name=f"shard-prefetch-{k}").start()

    def _open_many(self, shards: np.ndarray) -> None:
        """Opens the shards a read needs at the same time: on gs:// each may be a download,
        and a batch of B rows touches up to B shards."""
        closed = [k for k in np.unique(shards).tolist() if self._readers[k] is None]
        if len(closed) > 1:
            # Errors are left to the read of that shard, which retries and raises them.
            with futures.ThreadPoolExecutor(max_workers=min(16, len(closed))) as pool:
                for job in [pool.submit(self._reader, k) for k in closed]:
                    job.exception()

    def _locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(self)
        if indices.size and (indices.min() < -n or indices.max() >= n):
            bad = indices[(indices < -n) | (indices >= n)][0]
            raise IndexError(f"row {bad} is out of range for {self.path} ({n} rows)")
        indices = np.where(indices < 0, indices + n, indices)
        shards = np.searchsorted(self._starts, indices, side="right") - 1
        return shards, indices - self._starts[shards]

    def records(self, indices: Sequence[int] | np.ndarray) -> list[bytes]:
        """Raw records for global row indices, in the given order.

        One read call per row: array_record's batched read runs a thread pool
        that costs more host CPU than it saves on local files (measured).
        """
        if self._prefetch_wanted and not self._prefetching:
            self._start_prefetch()
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        shards, positions = self._locate(idx)
        self._open_many(shards)
        out: list[bytes] = []
        for shard, position in zip(shards.tolist(), positions.tolist()):
            reader = self._readers[shard] or self._reader(shard)
            try:
                try:
                    out.append(reader.read([position])[0])
                except Exception:
                    if self.cache is None:
                        raise
                    # A cached copy that rotted: fetched again once, then the error stands.
                    out.append(self._refetch(shard, reader).read([position])[0])
            except ShardSetError:
                raise
            except Exception as e:  # riegeli checks each chunk's hash: a corrupt record fails here
                raise ShardSetError(
                    f"{self.shard_paths[shard]}: record {position} (row {self._starts[shard] + position}) is unreadable, "
                    f"the file is corrupt ({e}); republish the set or check it with verify=True"
                ) from e
        return out

    def scan(self, shard: int, batch_rows: int = 256, verify: bool = True) -> Iterator[dict[str, np.ndarray]]:
        """Shard `shard`'s rows in record order, as int32 [n, L] batches read by one sequential reader.

        verify: its sha256 is checked first (a gs:// shard's when its local copy is made; a
        cached copy is hashed again). Every error is a ShardSetError naming the shard."""
        info, name = self.manifest.shards[shard], self.shard_paths[shard]
        local = name if self.cache is None else self._fetch(shard, verify)
        if verify and self.cache is None and (digest := storage.sha256(local)) != info.sha256:
            raise ShardSetError(f"{name}: sha256 {digest} differs from the manifest's {info.sha256}; the file is corrupt")
        from array_record.python.array_record_module import ArrayRecordReader

        try:
            reader = ArrayRecordReader(local, _SCAN_OPTIONS)
        except Exception as e:
            raise ShardSetError(f"{name}: not a readable ArrayRecord file, truncated or corrupt ({e})") from e
        try:
            count = reader.num_records()
            if count != info.num_rows:
                raise ShardSetError(f"{name}: holds {count} rows, but the manifest says {info.num_rows}; the file was replaced or is corrupt")
            for start in range(0, count, batch_rows):
                try:
                    records = reader.read(start, min(count, start + batch_rows))
                    batch = rowformat.decode_rows(records, self.max_length, self.manifest.field_order)
                except Exception as e:  # riegeli's chunk hash, or a record of the wrong size
                    raise ShardSetError(f"{name}: records {start}.. are unreadable, the file is corrupt ({e})") from e
                yield batch
        finally:
            _close_quietly(reader)

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"rows are indexed by int, not {type(index).__name__}; use view.read(indices) for many")
        batch = self.read([int(index)])
        return {name: values[0] for name, values in batch.items()}

    @functools.cached_property
    def row_facts(self) -> rowformat.RowFacts:
        """What the row rules judge this set's rows by (its manifest's version, vocabulary, pad id, sources)."""
        from prepack.format.recount import row_facts

        return row_facts(self.manifest)

    def read(self, indices: Sequence[int] | np.ndarray, check: bool = True) -> dict[str, np.ndarray]:
        """Rows as int32 [len(indices), L] arrays, in the given order. A record that breaks the row
        format is a ShardSetError naming its shard file, its record and the rule: its size, and with
        check (the default) every rule `prepack verify` judges rows by (rowformat.row_fault, on the
        manifest's facts: flags 0/1, segments, positions, padding, targets, ids inside the
        vocabulary, the pad id, sources, pairs), so that no row that breaks them is trained on.
        check=False: the records as stored (`prepack inspect` shows a broken row)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        records = self.records(idx)
        size = rowformat.record_size(self.max_length, self.manifest.format_version)
        for k, record in enumerate(records):
            if len(record) != size:
                self._row_error(idx[k], f"record has {len(record)} bytes, expected {size} for max_length {self.max_length}")
        batch = rowformat.decode_rows(records, self.max_length, self.manifest.field_order)
        if check and len(idx):
            fault = rowformat.row_fault(batch, self.row_facts)
            if fault is not None:
                where = f"segment {fault.segment}, token {fault.token}" if fault.segment else f"padding, token {fault.token}"
                values = ", ".join(f"{name} {value}" for name, value in rowformat.fault_values(batch, fault).items())
                self._row_error(idx[fault.row], f"{where}: {fault.rule} (there: {values})",
                                "the shard was edited or is not what its manifest describes: check the set with "
                                "prepack verify, and republish it")
        return batch

    def _row_error(self, index: int, problem: str,
                   advice: str = "the shards do not match their manifest, republish the set") -> None:
        shards, positions = self._locate(np.asarray([index], dtype=np.int64))
        shard, position = int(shards[0]), int(positions[0])
        raise ShardSetError(f"{self.shard_paths[shard]}: record {position} (row {self._starts[shard] + position} of "
                            f"shard set {self.path}): {problem}; {advice}")

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        for i in range(len(self)):
            yield self[i]

    def close(self) -> None:
        for shard, lock in enumerate(self._locks):
            with lock:
                if self._readers[shard] is not None:
                    _close_quietly(self._readers[shard])
                    self._readers[shard] = None

    def __enter__(self) -> "ShardView":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_manifest(path: str) -> Manifest:
    manifest_path = storage.join(path, MANIFEST_NAME)
    text = storage.read_text(manifest_path)
    if text is None:
        raise ShardSetError(
            f"no {MANIFEST_NAME} in {path}: not a published shard set (an interrupted run leaves none)"
        )
    return Manifest.from_json(text, source=manifest_path)


def _check_mixture_sources(manifest: Manifest, manifest_path: str) -> None:
    """A mixture set's rows carry source ids 1..N, N the entries of its `mixture.sources`: the
    entries' written examples and tokens must add up to the set's, or rows carry ids no entry
    names (per-source metrics would then be mislabelled)."""
    if not rowformat.has_sources(manifest.format_version):
        return
    sources = manifest.mixture["sources"]
    for key in ("examples_written", "tokens"):
        listed = [entry.get(key) for entry in sources]
        total = manifest.stats.get(key)
        if not all(type(v) is int for v in listed + [total]) or sum(listed) != total:
            raise ShardSetError(
                f"{manifest_path}: mixture.sources lists {len(sources)} sources whose {key} add up to "
                f"{sum(v for v in listed if type(v) is int)}, but the set holds {total!r} (stats.{key}): its rows carry "
                "source ids the list does not name; republish the set")


def _check_shard(path: str, info: Any, max_length: int, verify: bool, name: str | None = None,
                 version: int = rowformat.FORMAT_VERSION):
    """Opens one shard and checks it against its manifest entry; returns the open reader.

    name: what messages call the file (a gs:// URL for a cached copy at `path`).
    """
    shown = name or path
    try:
        reader = _open_reader(path)
    except Exception as e:  # array_record raises RuntimeError/ValueError with riegeli's status text
        raise ShardSetError(f"{shown}: not a readable ArrayRecord file, truncated or corrupt ({e})") from e
    try:
        if verify:  # first: a corrupt file is then named as such, whatever it would fail on below
            digest = storage.sha256(path)
            if digest != info.sha256:
                raise ShardSetError(f"{shown}: sha256 {digest} differs from the manifest's {info.sha256}; the file is corrupt")
        try:
            count = reader.num_records()
            first = reader.read([0])[0] if count else None
            options = reader.writer_options_string()
        except Exception as e:  # riegeli checks chunk hashes: corrupt bytes fail here
            raise ShardSetError(f"{shown}: not a readable ArrayRecord file, truncated or corrupt ({e})") from e
        if count != info.num_rows:
            raise ShardSetError(f"{shown}: holds {count} rows, but the manifest says {info.num_rows}; the file was replaced or is corrupt")
        if first is not None and len(first) != rowformat.record_size(max_length, version):
            raise ShardSetError(
                f"{shown}: records are {len(first)} bytes, but max_length {max_length} needs "
                f"{rowformat.record_size(max_length, version)}; the shards do not match their manifest"
            )
        if "group_size:1," not in options + ",":
            log.warning("%s: written with %r; random access wants group_size:1", shown, options)
    except BaseException:
        _close_quietly(reader)
        raise
    return reader


def open_shards(
    path: str,
    expected_max_length: int | None = None,
    tokenizer: TokenizerLike | None = None,
    *,
    verify: bool = False,
    cache_dir: str | None = None,
) -> ShardView:
    """Opens and validates a shard set folder (local, gcsfuse mount, or gs://).

    expected_max_length: the trainer's sequence length; a set packed for another one is refused.
    tokenizer: the trainer's tokenizer (or its identity dict); a set made with another is refused.
    verify: also hash every shard and compare with the manifest's sha256 (reads every byte).
      On gs:// every download is hashed anyway; verify=True downloads all shards now and
      hashes cached copies again (one that fails is dropped and downloaded once more).
    cache_dir: where gs:// shards are copied (see loaders.shard_cache; default
      $PREPACK_SHARD_CACHE or ~/.cache/prepack/shards). Unused for local sets.
    Raises ManifestError (ShardSetError for shard files) naming the offending path.

    Local shards are opened and checked now (one footer and one record each);
    gs:// shards are listed and size-checked now, and each is downloaded,
    hashed and checked when first read (or all now with verify=True).
    """
    path = str(path)
    path = path.rstrip("/") or path
    manifest = read_manifest(path)
    manifest_path = storage.join(path, MANIFEST_NAME)
    manifest.check_compatible(expected_max_length, tokenizer_identity(tokenizer), source=manifest_path)
    _check_mixture_sources(manifest, manifest_path)

    names = [s.path for s in manifest.shards]
    sizes = storage.file_sizes(path, names)
    missing = [n for n in names if sizes[n] is None]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise ShardSetError(
            f"{storage.join(path, missing[0])}: shard file listed in {manifest_path} is missing "
            f"({len(missing)} of {len(names)} missing: {shown})"
        )
    for info in manifest.shards:
        if sizes[info.path] != info.num_bytes:
            raise ShardSetError(
                f"{storage.join(path, info.path)}: {sizes[info.path]} bytes, but the manifest says {info.num_bytes}; "
                "the file is truncated or was replaced"
            )

    if storage.is_gcs(path):
        view = ShardView(path, manifest, cache=ShardCache(cache_dir))
        if verify:
            # Cached copies are hashed again: one that rotted on this disk is fetched again.
            _run_all([functools.partial(view._reader, k, True) for k in range(len(names))], close=lambda r: None)
        return view
    shard_paths = [storage.join(path, n) for n in names]
    _refuse_links_out(path, shard_paths)
    readers = _run_all(
        [functools.partial(_check_shard, p, s, manifest.max_length, verify, version=manifest.format_version) for p, s in zip(shard_paths, manifest.shards)],
        close=_close_quietly,
    )
    return ShardView(path, manifest, readers)


def _refuse_links_out(folder: str, shard_paths: Sequence[str]) -> None:
    """A local shard is a file in its set's folder: one that is a symbolic link to a file outside
    it (a manifest's names are plain, but the folder's entries need not be files) is refused, as
    a name leaving the folder is (docs/manifest.md, "Trust")."""
    import os

    home = os.path.realpath(folder)
    for shard in shard_paths:
        if not os.path.islink(shard):
            continue
        target = os.path.realpath(shard)
        if os.path.dirname(target) != home:
            raise ShardSetError(f"{shard}: a symbolic link to {target}, outside the set's folder {home}: a shard must be a "
                                "file in its set's folder; copy the file there, or republish the set")


def _run_all(jobs: list[Callable[[], Any]], close: Callable[[Any], None]) -> list[Any]:
    """Runs the jobs concurrently (each may wait on storage); raises the first error in job order after all end."""
    with futures.ThreadPoolExecutor(max_workers=max(1, min(32, len(jobs)))) as pool:
        pending = [pool.submit(job) for job in jobs]
        results, error = [], None
        for job in pending:
            try:
                results.append(job.result())
            except Exception as e:
                error = error or e
                results.append(None)
    if error is not None:
        for result in results:
            if result is not None:
                close(result)
        raise error
    return results
