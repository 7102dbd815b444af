"""How much one input may make a worker hold: the limits that keep a hostile or broken file from
exhausting a worker's memory (`prepack pack --max-record-bytes`, `--max-decompressed-bytes`,
`--max-compression-ratio`; pipelines/README.md, "Limits").

- A JSONL line longer than max_record_bytes is never held whole: its bytes are dropped up to
  its newline and it becomes a dead letter (reason too_large), like any bad record.
- A file read whole (JSON arrays, Parquet, Arrow) that holds more than max_whole_file_bytes
  fails the job in one line naming it: a worker holds it and its parsed records at once.
- A file that decompresses (or, read whole: JSON arrays, Parquet, Arrow) to more than
  max_decompressed_bytes, or whose compressed bytes expand more than max_compression_ratio
  times (checked once RATIO_CHECKED_AFTER bytes are out, so small files never trip it), fails
  the job in one line naming it: a decompression bomb, or a file to split or allow explicitly.
"""

from __future__ import annotations

import dataclasses

from pipelines.faults.failures import InputFileError

DEFAULT_MAX_RECORD_BYTES = 32 << 20  # 32 MiB: ~8M tokens of text, far beyond the longest max length
DEFAULT_MAX_DECOMPRESSED_BYTES = 64 << 30  # 64 GiB per file
DEFAULT_MAX_COMPRESSION_RATIO = 1000.0  # gzip cannot pass ~1,032x; real JSONL compresses 3-20x
# JSON arrays, Parquet and Arrow files are held whole by one worker, with their parsed records
# (several times the bytes): 1 GiB keeps that within a worker's memory; JSONL streams instead.
DEFAULT_MAX_WHOLE_FILE_BYTES = 1 << 30
RATIO_CHECKED_AFTER = 16 << 20


@dataclasses.dataclass(frozen=True)
class InputLimits:
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    max_compression_ratio: float = DEFAULT_MAX_COMPRESSION_RATIO
    max_whole_file_bytes: int = DEFAULT_MAX_WHOLE_FILE_BYTES

    def check_whole_file(self, path: str, held: int) -> None:
        """Raises InputFileError once a file read whole (JSON array, Parquet, Arrow) holds more
        than max_whole_file_bytes."""
        if held > self.max_whole_file_bytes:
            raise InputFileError(
                f"{path}: is read whole (JSON arrays, Parquet and Arrow files are) and holds more than "
                f"{self.max_whole_file_bytes:,} bytes (--max-whole-file-bytes); convert it to JSON Lines (read in "
                "byte ranges, streamed) or split it, or raise the limit if a worker has the memory")

    def check_output(self, path: str, produced: int, consumed: int | None) -> None:
        """Raises InputFileError once `produced` bytes (from `consumed` compressed bytes, None
        for a plain file read whole) pass a limit."""
        if produced > self.max_decompressed_bytes:
            raise InputFileError(
                f"{path}: {'decompresses' if consumed is not None else 'is'} to more than {self.max_decompressed_bytes:,} "
                f"bytes (--max-decompressed-bytes); split the file, or raise the limit if it is meant to be this big")
        if consumed and produced > RATIO_CHECKED_AFTER and produced > self.max_compression_ratio * consumed:
            raise InputFileError(
                f"{path}: {consumed:,} compressed bytes expand to over {produced:,} (more than "
                f"{self.max_compression_ratio:g}x, --max-compression-ratio): a decompression bomb? Leave it out of "
                "--input, or raise the limit if the file is meant to compress this well")
