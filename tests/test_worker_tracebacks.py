"""A worker failure the launcher states in one line (pipelines/faults/failures.py: a truncated .gz, a
gs:// object stored compressed twice, an input over a limit) is that one line on stderr: the
runner's relays of the worker's log and the worker's own printed traceback (85 lines and 4
tracebacks before the line) are dropped; a traceback of any other failure still shows."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys

import pytest

from pipelines.launch.worker_stderr import KnownFailureTracebacks
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KNOWN = (b"Traceback (most recent call last):\n  File \"read.py\", line 46, in process\n    for record in x:\n"
         b"pipelines.faults.failures.InputFileError: in.jsonl.gz: truncated .gz file; replace it\n\n"
         b"During handling of the above exception, another exception occurred:\n\n"
         b"Traceback (most recent call last):\n  File \"sdk_worker.py\", line 310, in _execute\n    response = task()\n"
         b"pipelines.faults.failures.InputFileError: in.jsonl.gz: truncated .gz file; replace it [while running 'Read']\n\n")
BUG = (b"Traceback (most recent call last):\n  File \"fit.py\", line 9, in process\n    x[3]\n"
       b"IndexError: list index out of range\n\n")


def filtered(chunks: list[bytes]) -> bytes:
    f = KnownFailureTracebacks()
    return b"".join(f.feed(c) for c in chunks) + f.flush(final=True)


def test_a_known_failures_traceback_is_dropped_whole_in_any_chunking():
    stream = b"progress 1\n" + KNOWN + b"progress 2\n" + BUG + b"last words\n"
    for size in (1, 7, 64, len(stream)):
        chunks = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert filtered(chunks) == b"progress 1\nprogress 2\n" + BUG + b"last words\n", size


def test_an_idle_flush_judges_a_complete_traceback_and_holds_an_unfinished_one():
    f = KnownFailureTracebacks()
    assert f.feed(BUG) == b"" and f.flush() == BUG  # complete: written once nothing more came
    assert f.feed(KNOWN[:60]) == b"" and f.flush() == b""  # still in its frames: held
    assert f.feed(KNOWN[60:]) == b"" and f.flush() == b""  # then judged: a known failure, dropped
    assert f.feed(b"plain line\nno newline yet") == b"plain line\n" and f.flush(final=True) == b"no newline yet"


def pack_stderr(args: list[str], env: dict | None = None) -> tuple[int, str]:
    done = subprocess.run([sys.executable, "-m", "apps.cli", "pack", *args, "--max-length", "256", "--no-progress",
                           "--direct_num_workers=1"],
                          cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)
    return done.returncode, done.stderr


def test_a_truncated_gz_input_is_one_line_on_stderr(tmp_path):
    data = gzip.compress(b"".join(b'{"instruction": "Say %d", "input": "", "output": "Hi."}\n' % i for i in range(2000)))
    (tmp_path / "in.jsonl.gz").write_bytes(data[: len(data) // 2])
    code, err = pack_stderr(["--input", str(tmp_path / "in.jsonl.gz"), "--format", "alpaca", "--output", str(tmp_path / "out")])
    assert code == 1
    assert err.splitlines() == [f"prepack pack: {tmp_path}/in.jsonl.gz: truncated .gz file (the compressed stream ends "
                                f"after {len(data) // 2:,} bytes without its end marker); replace or re-download it, "
                                "or leave it out of --input"], err


def test_a_gcs_object_compressed_twice_is_one_line_on_stderr(gcs_emulator, gcs_prefix, tmp_path):  # noqa: F811
    path = f"{gcs_prefix}/in.jsonl.gz"
    blob = gcs_emulator.client().bucket(gcs_emulator.bucket).blob(gcs_emulator.split(path)[1])
    blob.content_encoding = "gzip"
    blob.upload_from_string(gzip.compress(gzip.compress(b'{"instruction": "a", "input": "", "output": "b"}\n')),
                            content_type="application/gzip")
    code, err = pack_stderr(["--input", path, "--format", "alpaca", "--output", str(tmp_path / "out")],
                            env={"STORAGE_EMULATOR_HOST": os.environ["STORAGE_EMULATOR_HOST"]})
    assert code == 1
    assert err.splitlines() == [f"prepack pack: {path}: a gzip file stored with Content-Encoding: gzip (compressed twice) "
                                "cannot be read; upload it again without that Content-Encoding"], err
