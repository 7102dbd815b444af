"""The one storage interface of the project: local paths and gs:// behind it.

`storage_for(path)` is the only place that tells gs:// from a local path (tests/test_import_boundaries.py);
the output lock and commit use its versioned conditional operations, the loaders, apps and the
pipeline's launcher its plain reads and writes. Paths are joined by prepack.format.layout.join alone.
The pipeline's streamed files (inputs on the workers, part files, shards) use its streams and
`match`; no Beam here, and nothing in the project opens a file through Beam's FileSystems.
"""

from __future__ import annotations

import hashlib
import re
from typing import BinaryIO

from prepack.format.layout import MANIFEST_NAME, join
from prepack.format.manifest import ManifestError
from prepack.hostile_input import untrusted
from prepack.storage.gcs import GcsStorage, gcs_client, is_gcs, object_stamp, split_gcs
from prepack.storage.interface import STREAM_BUFFER_BYTES, Storage, SwitchRefused, Version, Versioned
from prepack.storage.local import LocalStorage

__all__ = [
    "GcsStorage", "LocalStorage", "STREAM_BUFFER_BYTES", "Storage", "SwitchRefused", "Version", "Versioned", "create_stream",
    "download", "file_sizes", "gcs_client", "is_gcs", "join", "location_problem", "match", "not_a_folder", "object_stamp", "on_this_machine", "open_stream", "read_bytes", "read_metadata", "read_text",
    "sha256", "split_gcs", "storage_for", "write_text",
]

_LOCAL, _GCS = LocalStorage(), GcsStorage()
SHA_BLOCK = 1 << 22


def storage_for(path: str) -> Storage:
    """The storage holding `path`: the one place that tells gs:// from a local path."""
    return _GCS if is_gcs(path) else _LOCAL


def read_bytes(path: str) -> bytes | None:
    """The whole file, or None if it does not exist."""
    return storage_for(path).read_bytes(path)


def read_metadata(path: str) -> bytes | None:
    """A metadata file's bytes (a manifest, a tokenized set's manifest, a run record, a saved
    state), or None if there is none (a folder, or a path through a file, is none). Written by
    strangers: one over untrusted.MAX_METADATA_FILE_BYTES is refused with one ManifestError line,
    and no more than the cap + 1 bytes of it are read (one ranged GET on gs://)."""
    cap = untrusted.MAX_METADATA_FILE_BYTES
    try:
        data = storage_for(path).read_head(path, cap + 1)
    except (IsADirectoryError, NotADirectoryError):
        return None
    except OSError as e:  # no access, no credentials: one line naming the file
        raise ManifestError(f"{path}: cannot be read ({e.strerror or e})") from None
    if data is not None and len(data) > cap:
        raise ManifestError(untrusted.too_large(path, cap))
    return data


def read_text(path: str) -> str | None:
    """A metadata file's text (read_metadata: capped), or None if it does not exist; ManifestError
    (one line) if its bytes are not UTF-8: the manifests and records read here are written by strangers."""
    data = read_metadata(path)
    if data is None:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text (byte {e.start} is {data[e.start:e.start + 1]!r}); the file was "
                            "edited or is damaged: republish the set") from None


_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):/")


def location_problem(path: str) -> str | None:
    """Why `path`, as a user typed it, names no place this project can read or write (one line),
    or None. Asked of every path a command takes before anything is read or written there: a
    gs:// URL needs a bucket (`--output gs://` wrote a local folder ./gs:/L512, and `gs:///x`
    was a ValueError traceback), and another scheme (s3://, http://, gs:/ with one slash) would
    otherwise be taken for a local folder named after it."""
    if is_gcs(path):
        bucket = path[len("gs://"):].split("/", 1)[0]
        return None if bucket else f"{path!r} names no bucket: write gs://BUCKET/FOLDER"
    scheme = _SCHEME.match(path)
    if scheme and scheme.group(1).lower() == "gs":
        return f"{path!r} is not a gs:// URL: write gs://BUCKET/FOLDER"
    if scheme and len(scheme.group(1)) > 1:  # c:/... is a drive letter, not a scheme
        return f"{path!r}: only local paths and gs:// are supported, not {scheme.group(1)}://"
    return None


def local_write_problem(path: str) -> str | None:
    """Why this process cannot create files beside the local `path` (one line), or None. Commands
    stage their output beside it (path.tmp-PID, .name.XXXX) and rename it into place, so the
    question is the nearest existing folder at or above its parent: it must be a folder, and one
    where a folder can be made. That is tried (a probe folder made and removed at once), not read
    from permission bits: root passes os.access on /proc, where mkdir still fails."""
    import os
    import tempfile

    from prepack.storage.places import resolved

    above = os.path.dirname(resolved(path))  # where the writer writes: links followed before `..`
    while not os.path.lexists(above):
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        return f"{path!r} cannot be written: {above} is a file, not a folder"
    try:
        os.rmdir(tempfile.mkdtemp(dir=above, prefix=".prepack-write-probe-"))
    except OSError as e:
        return f"{path!r} cannot be written: no folder can be made in {above} ({e.strerror or e})"
    return None


def on_this_machine(spec: str) -> bool:
    """Whether a path or input spec reads this machine's disk: a local path, or hf: naming a
    local folder; gs://, hf:NAME of the Hub, tfds:NAME (under the user's own --tfds-data-dir) and
    other schemes (refused as inputs in their own words) do not. A mixture file not on this
    machine may name only inputs that are not (prepack/mixture_file.py)."""
    if is_gcs(spec) or spec.startswith("tfds:") or _SCHEME.match(spec) and "://" in spec:
        return False
    if spec.startswith("hf:"):
        return spec[3:].startswith(("/", "./", "../", "~")) or spec[3:] in (".", "..")
    return True


def not_a_folder(path: str) -> str | None:
    """The one line for a command given a file where it takes a set's folder (its manifest.json
    itself, say), else None: asked only after no manifest was found there."""
    if not storage_for(path).is_file(path):
        return None
    folder = path.rsplit("/", 1)[0] if "/" in path.rstrip("/") else "."
    hint = f" ({folder})" if path.endswith("/" + MANIFEST_NAME) or path == MANIFEST_NAME else ""
    return f"{path} is a file, not a folder: name the set's folder{hint} or the --output of `prepack pack`"


def write_text(path: str, text: str) -> None:
    """Writes a small text file whole; locally through a temp name, so a crash leaves the old file."""
    storage_for(path).replace(path, text.encode("utf-8"))


def open_stream(path: str, buffer_bytes: int = STREAM_BUFFER_BYTES) -> BinaryIO:
    """The file's stored bytes (never decompressed), streamed and seekable."""
    return storage_for(path).open_stream(path, buffer_bytes)


def create_stream(path: str) -> BinaryIO:
    """A new file written as a stream (created with its folders; replaced if it exists)."""
    return storage_for(path).create_stream(path)


def match(pattern: str) -> list[tuple[str, int]]:
    """(path, size) of each file a path or glob matches (prepack/storage/patterns.py), sorted;
    the storage's own error when it cannot list."""
    return storage_for(pattern).match(pattern)


def file_sizes(folder: str, names: list[str]) -> dict[str, int | None]:
    """Size in bytes of each named file in `folder`, None where it is missing (one listing on gs://)."""
    return storage_for(folder).sizes(folder, names)


class _HashingWriter:
    """A write-only file object that hashes what passes through it on its way to `out`."""

    def __init__(self, out: BinaryIO):
        self._out = out
        self.digest = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.digest.update(data)
        self.size += len(data)
        return self._out.write(data)


def download(path: str, out: BinaryIO) -> tuple[int, str]:
    """Copies a whole file into `out`; returns (bytes, sha256 hex) of what was copied."""
    writer = _HashingWriter(out)
    storage_for(path).download(path, writer)  # type: ignore[arg-type]
    return writer.size, writer.digest.hexdigest()


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    for chunk in storage_for(path).chunks(path, SHA_BLOCK):
        digest.update(chunk)
    return digest.hexdigest()
