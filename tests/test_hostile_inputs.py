"""Inputs nobody checked (issue 24): no record can kill the job, no input can make it read
without bound or hang, and an input that changes mid-run fails it in one line."""

from __future__ import annotations

import json
import os

import pytest

from pipelines.inputs import readers
from pipelines.options import OptionsError, parse_args
from pipelines.launch.errors import JobError
from pipelines.wire.records import TaskMeta
from testkit import fuzz
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.pipeline import IN_PROCESS, alpaca_records, write_json, write_jsonl

LONE = b'{"instruction": "lone \\ud800 here", "input": "", "output": "ok"}'


def pack(args: list[str]):
    from pipelines.launch.job import run

    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


def dead_letters(out, L: int = 256) -> list[dict]:
    path = os.path.join(out, f"L{L}", "dead_letter.jsonl")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


# ----------------------------------------------------------------------------- bad_text


@pytest.mark.parametrize("tokenizer", ["gemma3", "qwen3"])
def test_lone_surrogate_is_a_bad_text_dead_letter_with_its_line(tmp_path, tokenizer):
    src = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(50), extra_lines=[LONE])
    out = str(tmp_path / "out")
    result = pack(["--input", src, "--format", "alpaca", "--output", out, "--max-length", "256", "--tokenizer", tokenizer,
                   "--max-bad-fraction", "0.1", "--no-tokens"])
    assert result.stats[256]["examples_written"] == 50
    (entry,) = dead_letters(out)
    assert entry["reason"] == "bad_text" and entry["source"]["line"] == 51
    assert "field 'instruction'" in entry["message"] and "lone surrogate" in entry["message"]


def test_lone_surrogate_in_a_json_array_is_a_bad_text_dead_letter(tmp_path):
    src = str(tmp_path / "in.json")
    with open(src, "w") as f:
        f.write(json.dumps(alpaca_records(5))[:-1] + ', {"instruction": "x \\udfff", "output": "y"}]')
    out = str(tmp_path / "out")
    result = pack(["--input", src, "--format", "alpaca", "--output", out, "--max-length", "256",
                   "--max-bad-fraction", "0.5", "--no-tokens"])
    assert result.stats[256]["examples_written"] == 5
    (entry,) = dead_letters(out)
    assert entry["reason"] == "bad_text" and entry["source"]["record"] == 5


@pytest.mark.parametrize("fmt,record", [
    ("alpaca", {"instruction": "lone \ud800 here", "output": "ok"}),  # the single-turn pair path
    ("chat", {"messages": [{"role": "user", "content": "lone \ud800"}, {"role": "assistant", "content": "ok"}]}),
])
def test_a_text_the_tokenizer_refuses_is_dead_lettered_not_a_crash(fmt, record):
    # A record that reached the tokenizer with unencodable text (whatever reader let it by):
    # sentencepiece raises TypeError for the batch; the batch is retried and only it is dropped.
    from pipelines.preparer import Preparer
    from prepack.packing.accounting import Tally

    good = {"alpaca": {"instruction": "say hi", "output": "hi"},
            "chat": {"messages": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}]}}[fmt]
    preparer = Preparer.from_names((TaskMeta(0, "in", "f.jsonl", "f.jsonl"),), fmt, (), "gemma3", "auto")
    items = [(i, i + 1, readers.RAW_OBJECT, record if i == 2 else good) for i in range(5)]
    tally, bad = Tally(), []
    batches = preparer.tokenize(preparer.template_records(0, items, tally, bad), tally, bad)
    assert sum(len(b) for b in batches) == 4
    assert [(entry["reason"], entry["source"]["line"]) for _, entry in bad] == [("bad_text", 3)]
    assert tally.bad_examples["bad_text"] == 1


# ----------------------------------------------------------------------------- --max-length


@pytest.mark.parametrize("value,words", [
    (str(1 << 31), "--max-length must be at most 1,048,576 (a row is then 20 MiB), got 2,147,483,648"),
    (str(1 << 63), "--max-length must be at most 1,048,576 (a row is then 20 MiB), got 9,223,372,036,854,775,808"),
    ("1048577", "--max-length must be at most 1,048,576"),
    ("1e20", "--max-length must be a whole number from 2 to 1,048,576, got '1e20'"),
])
def test_max_length_has_an_upper_bound(value, words):
    with pytest.raises(OptionsError) as e:
        parse_args(["--sample", "--output", "/tmp/unused", "--max-length", value])
    assert str(e.value) == words or str(e.value).startswith(words)
    assert parse_args(["--sample", "--output", "/tmp/unused", "--max-length", "1048576"])[0].rows.max_lengths == (1 << 20,)


def test_limit_options_show_in_pack_help(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--help"])
    text = capsys.readouterr().out
    for flag in ("--max-record-bytes", "--max-decompressed-bytes", "--max-compression-ratio", "--max-whole-file-bytes",
                 "at most 1,048,576"):
        assert flag in text


# ----------------------------------------------------------------------------- bounded reading


def _pack_limited(src: str, out: str, *extra: str):
    return pack(["--input", src, "--format", "alpaca", "--output", out, "--max-length", "256", "--no-tokens",
                 "--max-bad-fraction", "0.5", *extra])


@pytest.mark.parametrize("suffix", ["", ".gz", ".zst"])
def test_a_line_over_the_record_limit_is_a_too_large_dead_letter(tmp_path, suffix):
    import gzip

    import zstandard

    huge = json.dumps({"instruction": "x" * 300_000, "output": "y"}).encode()
    src = tmp_path / f"in.jsonl{suffix}"
    write_jsonl(str(tmp_path / "plain.jsonl"), alpaca_records(20), extra_lines=[huge, huge[:200_000]])  # the last has no newline
    data = (tmp_path / "plain.jsonl").read_bytes().rstrip(b"\n")
    src.write_bytes({"": data, ".gz": gzip.compress(data), ".zst": zstandard.ZstdCompressor().compress(data)}[suffix])
    out = str(tmp_path / "out")
    result = _pack_limited(str(src), out, "--max-record-bytes", "100000")
    assert result.stats[256]["examples_written"] == 20
    entries = dead_letters(out)
    assert [(e["reason"], e["source"]["line"]) for e in entries] == [("too_large", 21), ("too_large", 22)]
    assert "longer than 100,000 bytes (--max-record-bytes)" in entries[0]["message"]


def test_a_long_line_in_a_byte_range_is_a_too_large_dead_letter(tmp_path):
    # Over 1 MiB: read in byte ranges; the long line crosses a range's end.
    records = alpaca_records(4000)
    huge = json.dumps({"instruction": "x" * 1_500_000, "output": "y"}).encode()
    src = write_jsonl(str(tmp_path / "in.jsonl"), records[:2000], extra_lines=[huge])
    with open(src, "ab") as f:
        for r in records[2000:]:
            f.write(json.dumps(r).encode() + b"\n")
    assert os.path.getsize(src) > 2 << 20
    out = str(tmp_path / "out")
    result = _pack_limited(src, out, "--max-record-bytes", "1000000")
    assert result.stats[256]["examples_written"] == 4000
    assert [(e["reason"], e["source"]["line"]) for e in dead_letters(out)] == [("too_large", 2001)]


def test_line_splitter_drops_lines_over_the_limit_across_blocks():
    blocks = [b"a" * 10, b"b" * 10, b"\n{}\n", b"c" * 50, b"d" * 50, b"\n\n", b"x" * 31 + b"\n", b"e" * 3]
    lines = list(readers._jsonl_lines(iter(blocks), limit=30))
    assert [(n, None if line is None else len(line)) for n, line in lines] == [(1, 20), (2, 2), (3, None), (5, None), (6, 3)]
    ranged = list(readers._jsonl_lines(iter([b"c" * 40, b"\nab\n", b"z" * 40]), limit=30, skip_first=True))
    assert ranged == [(1, b"ab"), (2, None)]


def _bomb(tmp_path, suffix: str, size: int) -> str:
    import bz2
    import gzip

    import zstandard

    data = b'{"instruction": "a", "output": "b"}\n' + b" " * size + b"\n"
    path = tmp_path / f"bomb.jsonl{suffix}"
    path.write_bytes({".gz": lambda d: gzip.compress(d, 9), ".zst": lambda d: zstandard.ZstdCompressor(level=19).compress(d),
                      ".bz2": lambda d: bz2.compress(d, 9)}[suffix](data))
    return str(path)


@pytest.mark.parametrize("suffix", [".gz", ".zst", ".bz2"])
def test_a_decompression_bomb_fails_the_job_in_one_line(tmp_path, suffix):
    src = _bomb(tmp_path, suffix, 40 << 20)  # a few KB that expand to 40 MiB: over 1000x
    assert os.path.getsize(src) < (40 << 20) // 1000
    with pytest.raises(JobError) as e:
        _pack_limited(src, str(tmp_path / "out"))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{src}: ") and "--max-compression-ratio" in message
    assert not os.path.exists(tmp_path / "out" / "L256")


def test_decompressed_size_limit_fails_the_job_in_one_line(tmp_path):
    src = _bomb(tmp_path, ".gz", 2 << 20)
    with pytest.raises(JobError) as e:
        _pack_limited(src, str(tmp_path / "out"), "--max-decompressed-bytes", "1000000")
    assert str(e.value).startswith(f"{src}: decompresses to more than 1,000,000 bytes (--max-decompressed-bytes)")
    # Raising the limits lets the same file through (its one long line is then a dead letter).
    result = _pack_limited(src, str(tmp_path / "out"), "--max-record-bytes", "1000", "--max-compression-ratio", "100000")
    assert result.stats[256]["examples_written"] == 1


@pytest.mark.parametrize("kind", ["json", "parquet"])
def test_a_file_read_whole_over_its_limit_fails_the_job_in_one_line(tmp_path, kind):
    """JSON arrays and Parquet files are held whole by one worker: past --max-whole-file-bytes the
    job stops in one line naming the file before it parses (shown to fail without the check: the
    job read and published it)."""
    src = _write_input(tmp_path, kind)
    size = os.path.getsize(src)
    with pytest.raises(JobError) as e:
        _pack_limited(src, str(tmp_path / "out"), "--max-whole-file-bytes", str(size - 1))
    assert str(e.value) == (
        f"{src}: is read whole (JSON arrays, Parquet and Arrow files are) and holds more than {size - 1:,} bytes "
        "(--max-whole-file-bytes); convert it to JSON Lines (read in byte ranges, streamed) or split it, or raise the "
        "limit if a worker has the memory")
    assert _pack_limited(src, str(tmp_path / "out"), "--max-whole-file-bytes", str(size)).stats[256]["rows"] > 0


def test_decompressed_blocks_are_bounded(tmp_path):
    import io

    import zstandard

    from pipelines.inputs import compressed

    data = zstandard.ZstdCompressor(level=19).compress(b"\0" * (64 << 20))
    sizes = [len(b) for b in compressed.decompressed_blocks(io.BytesIO(data), "z.zst", ".zst")]
    assert sum(sizes) == 64 << 20 and max(sizes) <= 40 << 20  # never the whole 64 MiB at once
    import gzip
    sizes = [len(b) for b in compressed.decompressed_blocks(io.BytesIO(gzip.compress(b"\0" * (64 << 20))), "z.gz", ".gz")]
    assert sum(sizes) == 64 << 20 and max(sizes) <= compressed.OUT_BLOCK


# ----------------------------------------------------------------------------- only regular files


def test_a_fifo_is_refused_before_reading(tmp_path):
    from pipelines.inputs import sources

    fifo = tmp_path / "in.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(sources.InputError) as e:
        sources.resolve_inputs([str(fifo)])
    assert str(e.value) == (f"input {str(fifo)!r}: {str(fifo)!r} is a FIFO, not a regular file; only regular files and "
                            "gs:// objects are inputs: copy the data into a file")


def test_a_link_to_dev_zero_is_refused_and_a_link_to_a_file_is_read(tmp_path):
    from pipelines.inputs import sources

    zero = tmp_path / "zero.jsonl"
    os.symlink("/dev/zero", zero)
    with pytest.raises(sources.InputError, match=r"is a character device, not a regular file") as e:
        sources.resolve_inputs([str(zero)])
    assert "a link to '/dev/zero'" in str(e.value)
    real = write_jsonl(str(tmp_path / "real.jsonl"), alpaca_records(3))
    link = tmp_path / "link.jsonl"
    os.symlink(real, link)
    _, tasks = sources.resolve_inputs([str(link)])
    assert [t.size for t in tasks] == [os.path.getsize(real)]


def test_a_file_replaced_by_a_fifo_after_planning_is_refused_by_the_reader(tmp_path):
    from pipelines.inputs import sources
    from pipelines.faults.failures import InputFileError

    path = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(3))
    _, (task,) = sources.resolve_inputs([path])
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(InputFileError, match="is a FIFO, not a regular file"):
        list(readers.iter_task(task, readers.FileDigest(), 8))


# ----------------------------------------------------------------------------- inputs that change


def _write_input(tmp_path, kind: str) -> str:
    import gzip

    from testkit.pipeline import write_parquet

    records = alpaca_records(30)
    if kind == "jsonl":
        return write_jsonl(str(tmp_path / "in.jsonl"), records)
    if kind == "jsonl.gz":
        path = tmp_path / "in.jsonl.gz"
        path.write_bytes(gzip.compress(b"".join(json.dumps(r).encode() + b"\n" for r in records)))
        return str(path)
    if kind == "json":
        return write_json(str(tmp_path / "in.json"), records)
    return write_parquet(str(tmp_path / "in.parquet"), records)


@pytest.mark.parametrize("kind", ["jsonl", "jsonl.gz", "json", "parquet"])
def test_a_whole_file_input_that_changes_mid_run_fails_the_job_in_one_line(tmp_path, monkeypatch, kind):
    from pipelines.faults import failpoints

    src = _write_input(tmp_path, kind)

    def change_the_input(point: str, detail: str | None = None) -> None:
        if (point, detail) == ("input_read", "whole_file"):  # after the reader has read the file whole
            with open(src, "ab") as f:
                f.write(b'{"instruction": "appended", "output": "late"}\n' * 100)

    monkeypatch.setattr(failpoints, "hit", change_the_input)
    with pytest.raises(JobError) as e:
        _pack_limited(src, str(tmp_path / "out"))
    message = str(e.value)
    assert "\n" not in message and message.startswith(f"{src} changed while the job ran (size ")
    assert message.endswith("an input must not change while the job runs: run the job again on a copy")
    assert not os.path.exists(tmp_path / "out" / "L256")


# ----------------------------------------------------------------------------- fuzz


def _fuzz_lines(fmt: str, examples: int, tokenizer: str = "gemma3") -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from pipelines.preparer import Preparer
    from prepack.packing.accounting import Tally

    preparer = Preparer.from_names((TaskMeta(0, "in", "f.jsonl", "f.jsonl"),), fmt, (), tokenizer, "auto")
    text = st.text(max_size=30) | st.sampled_from(["lone \ud800", "\udfff", "\x00", "\u2028", "<start_of_turn>", ""])
    value = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | text,
                         lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3), max_leaves=6)
    fields = {"alpaca": ["instruction", "input", "output"], "chat": ["messages"]}[fmt]
    message = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | text,
                                     "content": text | value})
    record = st.fixed_dictionaries({f: (st.lists(message, max_size=4) if f == "messages" else text) | value for f in fields},
                                   optional={"extra": value})
    as_line = record.map(lambda r: json.dumps(r).encode()) | record.map(lambda r: json.dumps(r, ensure_ascii=False)
                                                                        .encode("utf-8", "surrogatepass"))
    line = as_line | st.binary(max_size=80) | as_line.map(lambda b: b[: len(b) // 2])

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(lines=st.lists(line, min_size=1, max_size=6))
    def check(lines):
        data = b"\n".join(lines)
        split = list(readers._jsonl_lines([data[:7], data[7:]], limit=200))
        items = list(readers._raw_lines(split, 200))
        tally, bad = Tally(), []
        batches = preparer.tokenize(preparer.template_records(0, items, tally, bad), tally, bad)
        examples_out = sum(len(b) for b in batches)
        # Every record read is examples or exactly one dead letter; nothing raised.
        assert tally.records_read == len(items)
        assert tally.examples - tally.bad_examples.total() == examples_out
        assert len(bad) == tally.bad_records.total() + tally.bad_examples.total()
        for _, entry in bad:
            json.dumps(entry, ensure_ascii=False).encode("utf-8")  # as the dead-letter writers write it

    check()


@pytest.mark.parametrize("fmt", ["alpaca", "chat"])
def test_fuzz_jsonl_lines_give_rows_or_dead_letters(fmt):
    _fuzz_lines(fmt, 300)


@pytest.mark.parametrize("fmt,tokenizer", [("alpaca", "qwen3"), ("chat", "qwen3")])
def test_fuzz_jsonl_lines_qwen3(fmt, tokenizer):
    _fuzz_lines(fmt, 150, tokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["alpaca", "chat"])
def test_fuzz_jsonl_lines_deep(fmt):
    _fuzz_lines(fmt, fuzz.DEEP_EXAMPLES)


def test_a_gs_input_that_is_replaced_mid_run_fails_the_job_in_one_line(gcs_emulator, gcs_prefix, tmp_path, monkeypatch):  # noqa: F811
    from pipelines.faults import failpoints

    # A JSON array (read whole), replaced by one of the same size: the size cannot tell, the
    # object's generation does (a stamp of size and updated seconds misses a replacement made
    # within the same second).
    records = alpaca_records(20)
    local = tmp_path / "in.json"
    local.write_text(json.dumps(records))
    url = f"{gcs_prefix}/in/in.json"
    gcs_emulator.upload_file(str(local), url)
    records[0] = dict(records[0], output=records[0]["output"].swapcase())
    bigger = tmp_path / "same_size.json"
    bigger.write_text(json.dumps(records))
    assert bigger.stat().st_size == local.stat().st_size

    def replace_the_object(point: str, detail: str | None = None) -> None:
        if (point, detail) == ("input_read", "whole_file"):  # a new generation, after the worker read the old one
            gcs_emulator.upload_file(str(bigger), url)

    monkeypatch.setattr(failpoints, "hit", replace_the_object)
    with pytest.raises(JobError) as e:
        _pack_limited(url, f"{gcs_prefix}/out")
    assert "\n" not in str(e.value) and str(e.value).startswith(f"{url} changed while the job ran (size ")
    assert " and generation " in str(e.value)
