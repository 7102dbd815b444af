"""A published shard set is never lost, mixed or half-replaced; bad inputs fail with one line.

Every fault is injected at a chosen point: a named failpoint (pipelines/faults/failpoints.py) between
publishing steps, or a patched function, never timing. A "kill" in-process raises Killed (a
BaseException no handler catches) with the run's clean-up disabled and its OS lock dropped,
which leaves the output exactly as SIGKILL would (tests/test_interrupts.py and
tests/test_fencing.py kill and pause real processes).
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import zlib

import pytest

import loaders
from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl
from pipelines import output
from pipelines.output import lock as output_lock
from prepack.storage import local as local_storage
from pipelines.faults import failpoints
from prepack.format import layout
from pipelines.stages import write as writer
from pipelines.launch.cli import main as cli_main
from pipelines.launch.job import run
from pipelines.options import parse_args
from pipelines.launch.errors import JobError

LENGTHS = (64, 256)


def pack(args: list[str]):
    config, beam_args = parse_args(args + ["--no-progress"] + IN_PROCESS)
    return run(config, beam_args)


def args_for(inp: str, out: str, *extra: str) -> list[str]:
    # --no-tokens: these tests are about the shard sets' publishing order (the tokenized set's own
    # publishing is tested in test_tokens_pipeline.py and test_gcp.py).
    return ["--input", inp, "--format", "alpaca", "--output", out, "--max-length", *map(str, LENGTHS), "--no-tokens", *extra]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("faults-in")
    return {name: write_jsonl(str(d / f"{name}.jsonl"), alpaca_records(24, seed=seed))
            for name, seed in (("old", 0), ("new", 5), ("other", 9))}


@pytest.fixture(scope="module")
def published(inputs, tmp_path_factory):
    """An output holding the "old" sets; tests copy it."""
    out = tmp_path_factory.mktemp("faults-old") / "out"
    pack(args_for(inputs["old"], str(out)))
    return out


@pytest.fixture
def old_output(published, tmp_path):
    import shutil

    out = tmp_path / "out"
    shutil.copytree(published, out)
    return out


def manifests(out) -> dict[int, str]:
    return {L: (out / f"L{L}" / "manifest.json").read_text() for L in LENGTHS}


def input_of(manifest_text: str) -> str:
    return os.path.basename(json.loads(manifest_text)["inputs"][0]["spec"])


def assert_complete(out) -> dict[int, str]:
    """Every length's manifest opens with verify=True (every file present, every sha256 right);
    returns which input each length's set came from."""
    found = {}
    for L in LENGTHS:
        with loaders.open_shards(str(out / f"L{L}"), expected_max_length=L, verify=True) as view:
            assert len(view) == view.manifest.num_rows > 0
        found[L] = input_of((out / f"L{L}" / "manifest.json").read_text())
    return found


def files_in(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(r, f), folder) for r, _, fs in os.walk(folder) for f in fs)


class Killed(BaseException):
    """Stands for SIGKILL: nothing catches it, and the run's clean-up is disabled."""


def at_failpoint(monkeypatch, point: str, action) -> None:
    """Runs `action()` when the failpoint `point` (NAME or NAME:DETAIL) is hit, in this process."""
    def hit(name: str, detail: str | None = None) -> None:
        if point in (name, f"{name}:{detail}"):
            action()

    monkeypatch.setattr(failpoints, "hit", hit)


def kill_at(monkeypatch, point: str) -> None:
    """As SIGKILL at `point`: no clean-up, and the kernel drops the run's OS lock (its file stays)."""
    monkeypatch.setattr(output, "cleanup_run", lambda *a, **k: None)
    monkeypatch.setattr(output_lock.LocalLock, "release", lambda self: os.close(self._fd))

    def die() -> None:
        raise Killed(point)

    at_failpoint(monkeypatch, point, die)


# ----------------------------------------------------------------------------- kills while publishing


@pytest.mark.parametrize("point, expect, consistent", [
    ("before_publish", {64: "old", 256: "old"}, True),
    ("shards_in_place", {64: "old", 256: "old"}, True),
    ("after_manifest_switch:L64", {64: "new", 256: "old"}, False),
    ("after_run_record", {64: "new", 256: "new"}, True),
])
def test_overwrite_killed_while_publishing_leaves_old_or_new_never_a_mix(
        old_output, inputs, monkeypatch, point, expect, consistent):
    """kill -9 at each step of an --overwrite: each length's manifest names a complete set
    (verify=True), old or new; published.json tells whether the lengths belong to one run.
    Shown to fail on the base commit's order (old manifest removed first: L64 had none after a
    kill, and old shards were overwritten in place under the old manifest's names) and when
    swap.publish deletes old files before switching the manifests."""
    out = old_output
    before = manifests(out)
    kill_at(monkeypatch, point)
    with pytest.raises(Killed):
        pack(args_for(inputs["new"], str(out), "--overwrite"))
    assert assert_complete(out) == {L: f"{v}.jsonl" for L, v in expect.items()}
    for L in LENGTHS:
        if expect[L] == "old":
            assert manifests(out)[L] == before[L]
    if consistent:
        assert sorted(loaders.published_lengths(str(out))) == list(LENGTHS)
    else:
        with pytest.raises(loaders.ShardSetError, match=r"L64/manifest.json is not the manifest .*published.json names.*"
                                                        r"mix two runs; wait for the run, or run `prepack pack --overwrite` again"):
            loaders.published_lengths(str(out))
    # The next run: takes over the dead run's lock (the kernel freed it), reports what it left,
    # --clean-stale removes it.
    monkeypatch.undo()
    result = pack(args_for(inputs["new"], str(out), "--overwrite", "--clean-stale"))
    assert result.notes[0].startswith("removed ")  # the killed run's staging, at least
    assert assert_complete(out) == {64: "new.jsonl", 256: "new.jsonl"}
    assert sorted(loaders.published_lengths(str(out))) == list(LENGTHS)
    for L in LENGTHS:
        manifest = json.loads(manifests(out)[L])
        wanted = {"manifest.json", *(s["path"] for s in manifest["shards"])} | ({"dead_letter.jsonl"} if manifest["dead_letter"] else set())
        assert set(files_in(out / f"L{L}")) == wanted
    assert set(files_in(out)) - {f"L{L}/{n}" for L in LENGTHS for n in files_in(out / f"L{L}")} == {"published.json"}


def test_leftovers_are_reported_then_cleaned(old_output, inputs, monkeypatch):
    """A run killed after moving its shards in leaves staging files and unpublished shards: the
    next run says so in one line (and publishes); --clean-stale removes them."""
    out = old_output
    kill_at(monkeypatch, "shards_in_place")
    with pytest.raises(Killed):
        pack(args_for(inputs["new"], str(out), "--overwrite"))
    monkeypatch.undo()
    leftovers = output.find_leftovers(str(out), "no-such-run")
    assert any("/.staging-" in p for p in leftovers.paths)
    assert any(layout.SHARD_FILE.match(os.path.basename(p)) for p in leftovers.paths)
    result = pack(args_for(inputs["other"], str(out), "--overwrite"))
    (note,) = result.notes
    assert note.startswith(f"{out} holds leftovers of earlier killed runs: 2 staging folders (") and note.endswith(
        "pass --clean-stale to remove them")
    assert output.find_leftovers(str(out), "no-such-run").paths
    result = pack(args_for(inputs["other"], str(out), "--overwrite", "--clean-stale"))
    assert result.notes and result.notes[0].startswith("removed ")
    assert output.find_leftovers(str(out), "no-such-run").paths == []
    assert assert_complete(out) == {64: "other.jsonl", 256: "other.jsonl"}


# ----------------------------------------------------------------------------- two runs at once


@pytest.mark.parametrize("overwrite", [False, True])
def test_second_run_into_a_held_output_is_refused(inputs, tmp_path, monkeypatch, overwrite):
    """Run B starts while run A is between moving its shards and switching its manifests (the
    window where the base commit mixed the two runs' shards under one manifest): B is refused
    at start, with the owner named, and A publishes one consistent set."""
    out = tmp_path / "out"
    if overwrite:
        pack(args_for(inputs["other"], str(out)))
    refusals = []

    def race() -> None:
        if not refusals:
            with pytest.raises(JobError) as e:
                pack(args_for(inputs["new"], str(out), *(["--overwrite"] if overwrite else [])))
            refusals.append(str(e.value))

    at_failpoint(monkeypatch, "shards_in_place", race)
    pack(args_for(inputs["old"], str(out), *(["--overwrite"] if overwrite else [])))
    (refusal,) = refusals
    assert refusal.startswith(f"{out} is being written by run ") and "choose another --output" in refusal
    assert assert_complete(out) == {64: "old.jsonl", 256: "old.jsonl"}
    assert sorted(loaders.published_lengths(str(out))) == list(LENGTHS)
    assert not os.path.exists(out / ".lock")


@pytest.mark.parametrize("overwrite", [False, True])
def test_run_that_lost_its_lock_does_not_publish(inputs, tmp_path, monkeypatch, overwrite):
    """Run A stalls past its lock's expiry; run B takes the output over and publishes. When A
    resumes, it checks again at publish time and refuses: B's set stays, whole.
    Shown to fail without the publish-time checks (A then replaced B's set with exit 0)."""
    out = tmp_path / "out"
    done = []

    def stall() -> None:
        if not done:
            done.append(True)
            os.remove(out / ".lock")  # an operator removed A's lock file by hand
            pack(args_for(inputs["new"], str(out), *(["--overwrite"] if overwrite else [])))

    at_failpoint(monkeypatch, "before_publish", stall)
    with pytest.raises(JobError, match=r"^this run \(run \w+\) lost the lock on .*\.lock was removed or replaced\); "
                                       r"the output now belongs to run \w+ \(it published published.json; no run holds the lock now\). This run stopped "
                                       r"and changed nothing more$"):
        pack(args_for(inputs["old"], str(out), *(["--overwrite"] if overwrite else [])))
    assert assert_complete(out) == {64: "new.jsonl", 256: "new.jsonl"}
    assert sorted(loaders.published_lengths(str(out))) == list(LENGTHS)


def test_manifest_changed_behind_the_lock_is_not_replaced(old_output, inputs, monkeypatch):
    """Even if a writer ignored the lock, a manifest that changed since this run started is not
    switched (compare-and-swap), and the message says what state the output is in."""
    out = old_output

    def sneak() -> None:
        (out / "L64" / "manifest.json").write_text((out / "L64" / "manifest.json").read_text() + " ")

    at_failpoint(monkeypatch, "shards_in_place", sneak)
    with pytest.raises(JobError, match=r"L64/manifest.json was changed by another run since this one started; refusing "
                                       r"to replace it \(sets already switched by this run: none\)"):
        pack(args_for(inputs["new"], str(out), "--overwrite"))
    assert input_of(manifests(out)[256]) == "old.jsonl"


# ----------------------------------------------------------------------------- disk full


def test_disk_full_during_the_manifest_switch(old_output, inputs, monkeypatch):
    """No temp file is left inside the published set, the old sets stay, one line says why."""
    out = old_output
    before = manifests(out)
    real_fsync = os.fsync
    full = []

    def fsync(fd):
        if full:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)

    monkeypatch.setattr(local_storage.os, "fsync", fsync)
    at_failpoint(monkeypatch, "shards_in_place", lambda: full.append(True))
    with pytest.raises(JobError) as e:
        pack(args_for(inputs["new"], str(out), "--overwrite"))
    assert str(e.value).startswith("no space left on device while writing")
    assert "the previous shard sets are intact" in str(e.value) and "\n" not in str(e.value)
    monkeypatch.undo()
    assert manifests(out) == before
    assert assert_complete(out) == {64: "old.jsonl", 256: "old.jsonl"}
    assert not [f for L in LENGTHS for f in files_in(out / f"L{L}") if "tmp" in f or f.startswith(".staging")]


def test_disk_full_while_writing_shards(inputs, tmp_path, monkeypatch, capsys):
    def full(local_path: str, dest: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", dest)

    monkeypatch.setattr(writer, "copy_local_to", full)
    out = tmp_path / "out"
    code = cli_main(args_for(inputs["new"], str(out)) + ["--no-progress"] + IN_PROCESS)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    (line,) = err
    assert line.startswith(f"prepack pack: no space left on device while writing ({out}/L64/.staging-")
    assert line.endswith(f"): free space on the disk holding {out} and the temp folder, or choose another --output; "
                         "nothing new was published, the previous shard sets are intact")
    assert files_in(out) == []


# ----------------------------------------------------------------------------- inputs


def gzip_with_flush(records: list[dict], finish: bool = True) -> bytes:
    """A .gz written with a full flush after every record; unfinished: cut at a flush point."""
    z = zlib.compressobj(wbits=31)
    out = b""
    for r in records:
        out += z.compress((json.dumps(r) + "\n").encode()) + z.flush(zlib.Z_FULL_FLUSH)
    return out + z.flush() if finish else out


@pytest.mark.parametrize("damage", ["cut_at_flush_point", "cut_mid_stream", "corrupt"])
def test_damaged_compressed_input_fails_naming_the_file(tmp_path, capsys, damage):
    """Base commit: a .gz cut at a flush point published 10 of 20 records with exit 0; cut
    mid-stream, the rest counted as one malformed_json record."""
    records = alpaca_records(20, seed=3)
    data = gzip_with_flush(records)
    if damage == "cut_at_flush_point":
        data = gzip_with_flush(records, finish=False)
    elif damage == "cut_mid_stream":
        data = data[: len(data) // 2]
    else:
        data = data[:40] + bytes(b ^ 0xFF for b in data[40:60]) + data[60:]
    path = tmp_path / "in.jsonl.gz"
    path.write_bytes(data)
    out = tmp_path / "out"
    code = cli_main(args_for(str(path), str(out), "--max-bad-fraction", "1") + ["--no-progress"] + IN_PROCESS)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    kind = "corrupt" if damage == "corrupt" else "truncated"
    assert line.startswith(f"prepack pack: {path}: {kind} .gz file")
    assert line.endswith("replace or re-download it, or leave it out of --input")
    assert files_in(out) == []


def test_record_nested_100k_deep_is_dead_lettered(tmp_path):
    """Base commit: RecursionError, a ~240-line traceback, the job dead."""
    path = write_jsonl(str(tmp_path / "deep.jsonl"), alpaca_records(10, seed=1),
                       [b'{"instruction": ' + b"[" * 100_000 + b"]" * 100_000 + b', "output": "x"}', b"[" * 100_000])
    out = tmp_path / "out"
    result = pack(args_for(path, str(out), "--max-bad-fraction", "0.5"))
    assert result.stats[64]["examples_dropped"]["too_deeply_nested"] == 2
    entries = [json.loads(line) for line in (out / "L64" / "dead_letter.jsonl").read_text().splitlines()]
    deep = [e for e in entries if e["reason"] == "too_deeply_nested"]
    assert [e["source"]["line"] for e in deep] == [11, 12]
    assert deep[0]["message"] == "JSON nested too deeply to parse (over ~1,000 levels)"


def test_empty_and_all_bad_inputs_say_so(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"")
    with pytest.raises(JobError, match=rf"^the inputs hold no records \({empty} is empty\); nothing was published. Check --input$"):
        pack(args_for(str(empty), str(tmp_path / "o1")))
    # Records with alpaca's fields, every one bad (an empty output), and a line that is no JSON.
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), [{"instruction": "x", "output": " "}] * 3, [b"{broken"])
    with pytest.raises(JobError, match=r"^all 4 examples read are bad records \(empty_response 3, malformed_json 1\); "
                                       r"nothing was published; they are listed in .*L64/dead_letter.failed.jsonl. "
                                       r"Check --format and the inputs$"):
        pack(args_for(bad, str(tmp_path / "o2"), "--max-bad-fraction", "1"))


def test_more_shards_asked_than_rows_is_reported(inputs, tmp_path):
    result = pack(args_for(inputs["new"], str(tmp_path / "out"), "--num-shards", "10000"))
    for L in LENGTHS:
        manifest = json.loads((tmp_path / "out" / f"L{L}" / "manifest.json").read_text())
        assert manifest["options"]["num_shards"] == 10000
        rows = manifest["num_rows"]
        assert len(manifest["shards"]) == rows
        assert f"L{L}: --num-shards 10000 asked, {rows} written ({rows} rows; a shard holds at least one row)" in result.notes


def test_nothing_fits_leaves_no_length_folder(inputs, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(JobError, match="no example fits max length 16"):
        pack(["--input", inputs["new"], "--format", "alpaca", "--output", str(out), "--max-length", "16"])
    assert not (out / "L16").exists() and files_in(out) == []


def test_a_failed_first_run_with_its_tokenized_set_leaves_no_folders(inputs, tmp_path):
    # "nothing was published": no empty L16/, tokens/ or output folder either (the tokenized
    # set is published only after the shard sets).
    out = tmp_path / "new-output"
    with pytest.raises(JobError, match="no example fits max length 16.*nothing was published"):
        pack(["--input", inputs["new"], "--format", "alpaca", "--output", str(out), "--max-length", "16"])
    assert not out.exists()


def test_existing_set_is_refused_before_beam_is_imported(published, inputs):
    code = (
        "import sys; from pipelines.launch.cli import main; "
        f"code = main({args_for(inputs['old'], str(published))!r}); "
        "print(code, 'apache_beam' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=dict(os.environ))
    assert done.stdout.split() == ["2", "False"]  # a refusal before any work (prepack/cli_help.py EXIT_REFUSED)
    assert done.stderr.strip() == (f"prepack pack: {published}/L64/manifest.json, {published}/L256/manifest.json already exist: "
                                   "refusing to write into an existing shard set. Pass --overwrite to replace it "
                                   f"({published}/published.json then names exactly this run's lengths), or "
                                   "choose another --output")


def test_storage_error_between_lengths_says_what_is_published(old_output, inputs, monkeypatch):
    """A storage error after L64 was switched (a gs:// 503, say): one line that says L64 is the new
    set and L256 is not, and what to do; both lengths still verify."""
    def fail() -> None:
        raise ConnectionError("injected: the storage service is unavailable")

    at_failpoint(monkeypatch, "after_manifest_switch:L64", fail)
    with pytest.raises(JobError) as e:
        pack(args_for(inputs["new"], str(old_output), "--overwrite"))
    assert str(e.value) == (
        f"publishing into {old_output} failed (ConnectionError: injected: the storage service is unavailable) (L64 already "
        f"holds this run's set, L256 does not: {old_output}/published.json does not match them; run again with --overwrite)")
    assert assert_complete(old_output) == {64: "new.jsonl", 256: "old.jsonl"}
