"""The pipeline's file streams: Beam's FileSystems behind the storage interface (prepack/storage).

The core interface answers whole small reads and writes, listings and the versioned operations of
the lock and commit; what the Beam job alone needs is here, in the one module that imports
FileSystems: streamed opens and creates on workers (resumable, chunked uploads of shards and part
files), seekable range reads with a small gs:// buffer, and glob matching of --input.
"""

from __future__ import annotations

from typing import Any, BinaryIO

GCS_RANGE_BUFFER = 1 << 20  # download granularity of a range read from gs:// (Beam's default is 16 MB)
_gcsio: Any = None


def _filesystems():
    from apache_beam.io.filesystems import FileSystems

    return FileSystems


def open_read(path: str) -> BinaryIO:
    """The file's bytes as stored (no decompression), streamed."""
    from apache_beam.io.filesystem import CompressionTypes

    return _filesystems().open(path, compression_type=CompressionTypes.UNCOMPRESSED)


def open_for_range(path: str) -> BinaryIO:
    """The file, seekable, without decompression. On gs:// with a small download buffer: Beam's
    FileSystems would fetch 16 MB per read, several times a small range."""
    global _gcsio
    if path.startswith("gs://"):
        if _gcsio is None:
            from apache_beam.io.gcp.gcsio import GcsIO

            _gcsio = GcsIO()
        return _gcsio.open(path, "rb", read_buffer_size=GCS_RANGE_BUFFER)
    return open_read(path)


def create(path: str) -> BinaryIO:
    """A new file for streamed writing (created with its folders; replaced if it exists)."""
    from apache_beam.io.filesystem import CompressionTypes

    return _filesystems().create(path, mime_type="application/octet-stream", compression_type=CompressionTypes.UNCOMPRESSED)


def match(pattern: str) -> list[tuple[str, int, float]]:
    """(path, size, last updated) of each file a path or glob matches; raises what Beam raises
    (BeamIOError) when it cannot list."""
    found = _filesystems().match([pattern])[0].metadata_list
    return [(m.path, m.size_in_bytes, m.last_updated_in_seconds) for m in found]
