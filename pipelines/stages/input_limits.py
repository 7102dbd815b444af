"""How much one input may make a worker hold: the limits that keep a hostile or broken
file from exhausting a worker's memory (`prepack pack --max-record-bytes`,
`--max-decompressed-bytes`, `--max-compression-ratio`; pipelines/README.md, "Limits").

- A JSONL line longer than max_record_bytes is never held whole: its bytes are dropped up to
  its newline and it becomes a dead letter (reason too_large), like any bad record.
- A file that decompresses (or, read whole: JSON arrays, Parquet, Arrow) to more than
  max_decompressed_bytes, or whose compressed bytes expand more than max_compression_ratio
  times (checked once RATIO_CHECKED_AFTER bytes are out, so small files never trip it), fails
  the job in one line naming it: a decompression bomb, or a file to split or allow explicitly.
"""

from __future__ import annotations

import dataclasses

from pipelines.failures import InputFileError

DEFAULT_MAX_RECORD_BYTES = 32 << 20  # 32 MiB: ~8M tokens of text, far beyond the longest max length
DEFAULT_MAX_DECOMPRESSED_BYTES = 64 << 30  # 64 GiB per file
DEFAULT_MAX_COMPRESSION_RATIO = 1000.0  # gzip cannot pass ~1,032x; real JSONL compresses 3-20x
RATIO_CHECKED_AFTER = 16 << 20


@dataclasses.dataclass(frozen=True)
class InputLimits:
    max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
    max_decompressed_bytes: int = DEFAULT_MAX_DECOMPRESSED_BYTES
    max_compression_ratio: float = DEFAULT_MAX_COMPRESSION_RATIO

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
