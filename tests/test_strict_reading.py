"""Reading inputs strictly: damaged compressed files name themselves; records too deep to parse
are bad records, never a crash (unit level; end to end in test_pipeline_faults.py)."""

from __future__ import annotations

import bz2
import gzip
import io
import lzma

import pytest
import zstandard

from pipelines.inputs import compressed, readers
from pipelines.faults.failures import InputFileError
from pipelines.inputs.sources import ReadTask

DATA = b"".join(b'{"instruction": "task %d", "output": "answer"}\n' % i for i in range(3000))
COMPRESS = {
    ".gz": gzip.compress,
    ".bz2": bz2.compress,
    ".lzma": lambda d: lzma.compress(d, format=lzma.FORMAT_ALONE),
    ".zst": lambda d: zstandard.ZstdCompressor().compress(d),
}


def read(data: bytes, suffix: str) -> bytes:
    return b"".join(compressed.decompressed_blocks(io.BytesIO(data), f"in.jsonl{suffix}", suffix))


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
def test_whole_and_concatenated_files_read_in_full(suffix):
    data = COMPRESS[suffix](DATA)
    assert read(data, suffix) == DATA
    if suffix != ".lzma":  # gzip members, bz2 streams and zstd frames may be concatenated
        assert read(data + data, suffix) == DATA + DATA


@pytest.mark.parametrize("suffix", sorted(COMPRESS))
def test_truncated_file_is_an_error_naming_it(suffix):
    """Shown to fail with Beam's CompressedFile / zstandard's stream_reader, which return the
    shorter data silently."""
    data = COMPRESS[suffix](DATA)
    with pytest.raises(InputFileError, match=rf"^in.jsonl\{suffix}: (truncated|corrupt) \{suffix} file .*; replace or "
                                              r"re-download it, or leave it out of --input$"):
        read(data[: len(data) * 2 // 3], suffix)


def test_parse_text_dead_letters_what_the_parser_cannot_handle():
    record, error = readers.parse_text(b"[" * 100_000 + b"]" * 100_000)
    assert record is None and error == ("too_deeply_nested", "JSON nested too deeply to parse (over ~1,000 levels)")
    assert readers.parse_text(b'{"a": [[1]]}') == ({"a": [[1]]}, None)


def test_json_array_file_nested_too_deep_is_one_bad_record(tmp_path):
    path = tmp_path / "deep.json"
    path.write_bytes(b"[" * 100_000 + b"]" * 100_000)
    task = ReadTask(task_index=0, input_index=0, kind="json", path=str(path), name="deep.json")
    ((index, line, kind, payload),) = list(readers.iter_json(task, readers.FileDigest()))
    assert kind == readers.RAW_ERROR and payload[0] == "too_deeply_nested"
