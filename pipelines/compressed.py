"""Decompressing an input file strictly: a truncated or corrupt file is an error naming it.

Beam's CompressedFile stops quietly at the end of a truncated stream (a .gz cut at
a flush point reads as a shorter file, one cut mid-stream as a shorter file with a
broken last line), so a damaged input would be published as a smaller dataset, or
counted as one bad record. Here each format's decompressor must reach its
end-of-stream marker, for every member/frame, or the file is reported.
"""

from __future__ import annotations

import bz2
import lzma
import zlib
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

from pipelines.failures import InputFileError

READ_BLOCK = 4 << 20


def _zstd() -> Any:
    import zstandard

    return zstandard.ZstdDecompressor().decompressobj()


# suffix -> a fresh decompressor (decompress(), eof, unused_data) for one member/frame
DECOMPRESSORS: dict[str, Callable[[], Any]] = {
    ".gz": lambda: zlib.decompressobj(wbits=31),
    ".deflate": lambda: zlib.decompressobj(wbits=15),
    ".bz2": bz2.BZ2Decompressor,
    ".lzma": lzma.LZMADecompressor,
    ".zst": _zstd,
}


def suffix_of(path: str) -> str | None:
    lower = path.lower()
    return next((s for s in DECOMPRESSORS if lower.endswith(s)), None)


def decompressed_blocks(raw: BinaryIO, path: str, suffix: str, read_block: int = READ_BLOCK) -> Iterator[bytes]:
    """The file's decompressed bytes in blocks (each from at most `read_block` compressed bytes);
    raises InputFileError on truncation or corruption."""
    fresh = DECOMPRESSORS[suffix]
    d = fresh()
    consumed = 0
    pending = b""
    try:
        while True:
            block = pending or raw.read(read_block)
            pending = b""
            if not block:
                break
            consumed += len(block)
            if d.eof:  # a new member/frame starts (concatenated gzip, multi-stream bz2, zstd frames)
                d = fresh()
            out = d.decompress(block)
            if out:
                yield out
            if d.eof and d.unused_data:
                pending = d.unused_data
                consumed -= len(pending)
    except (zlib.error, OSError, EOFError, lzma.LZMAError) as e:
        raise InputFileError(
            f"{path}: corrupt {suffix} file near compressed byte {consumed:,} ({e}); replace or re-download it, "
            "or leave it out of --input"
        ) from e
    except Exception as e:
        if type(e).__name__ == "ZstdError":
            raise InputFileError(
                f"{path}: corrupt {suffix} file near compressed byte {consumed:,} ({e}); replace or re-download it, "
                "or leave it out of --input"
            ) from e
        raise
    if consumed and not d.eof:
        raise InputFileError(
            f"{path}: truncated {suffix} file (the compressed stream ends after {consumed:,} bytes without its "
            "end marker); replace or re-download it, or leave it out of --input"
        )
