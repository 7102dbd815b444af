"""A run that lost its lock can never touch what another run published.

Each case drives a real `prepack pack` process (run A) to a named failpoint with
PREPACK_FAILPOINTS=<point>=stop (SIGSTOP: every thread stops, the lease renewer included),
lets the lock's expiry pass, runs a second run (B), then sends SIGCONT. After every case the
sets readers see verify (open_shards(..., verify=True)) and are wholly one run's: every
length, the tokenized set and published.json.

* gs:// (the emulator): the paused run's lease expires, run B takes the output over and
  publishes; when A resumes it stops at once with one line naming the owner, exit 1.
  Shown to fail with the base commit's protocol (LeaseLock.check a no-op, each switch
  conditioned on the version read at switch time, every file the run's manifest does not
  name deleted): A then switched manifests over B's, wrote its run record beside B's
  manifests, or deleted B's shards, and exited 0.
* local disk: the paused run holds its OS lock however long it is paused, so B is refused
  with one line naming A and how to free the output; A, continued, publishes its set whole.
  Shown to fail with the flock taken out of LocalLock: B then took A's live output over.

What each case costs, and why it is no weaker: run A is a process forked from one that has
imported the job once (testkit/pack_forks.py: the same `main`, its own pid, environment and
exit status); run B runs in this process (`pipelines.launch.cli.main`, the line it prints
captured), since only A must be a process to be paused. "The expiry passes" is real time in
one case (after_run_record, on gs://); in the others B's lock clock (pipelines/output/lock.py's
`time`, the only clock that judges a lease) reads just past A's lease, which is what B sees
after that wait, without the 10 s of it: A stays stopped until B has ended either way.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator

import pytest

import loaders
from pipelines.launch import cli
from pipelines.output import lock as output_lock
from prepack.storage import storage_for
from prepack.format import layout
from prepack.format.run_record import RunRecord
from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from testkit.pack_forks import PackForks, PackRun
from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LENGTHS = (64, 256)
EXPIRY_S = 10  # the floor of --lock-expiry-s (pipelines/output/lock.py MIN_EXPIRY_S)

# Every step of the publishing order, as a failpoint (docs/manifest.md lists them).
POINTS = ["before_publish", "shards_in_place", "after_manifest_switch:L64", "after_manifest_switch:L256",
          "before_tokens_switch", "after_tokens_switch", "after_run_record", "before_delete"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("fencing-in")
    return {name: write_jsonl(str(d / f"{name}.jsonl"), alpaca_records(20, seed=seed))
            for name, seed in (("old", 0), ("a", 5), ("b", 9))}


@pytest.fixture(scope="module")
def forks():
    with PackForks(ROOT) as server:
        yield server


def pack_argv(inp: str, out: str, *extra: str) -> list[str]:
    """`prepack pack`'s options (after `python -m pipelines.launch.cli`)."""
    return ["--input", inp, "--format", "alpaca", "--output", out, "--max-length", *map(str, LENGTHS), "--no-progress",
            "--lock-expiry-s", str(EXPIRY_S), *IN_PROCESS, *extra]


def pack_args(inp: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "pipelines.launch.cli", *pack_argv(inp, out, *extra)]


def run_env(failpoints: str | None = None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("PREPACK_FAILPOINTS", None)
    if failpoints:
        env["PREPACK_FAILPOINTS"] = failpoints
    return env


def start(forks: PackForks, inp: str, out: str, *extra: str, failpoints: str | None = None) -> PackRun:
    """Run A: a `prepack pack` process, paused or ended at its failpoint."""
    return forks.start(pack_argv(inp, out, *extra), run_env(failpoints))


def run_here(capsys, inp: str, out: str, *extra: str) -> tuple[int, str]:
    """Run B, or a set's first run: `prepack pack` in this process; its exit status and stderr."""
    assert "PREPACK_FAILPOINTS" not in os.environ
    capsys.readouterr()
    code = cli.main(pack_argv(inp, out, *extra))
    return code, capsys.readouterr().err


class _ClockAhead:
    """The `time` module, with time() `ahead` seconds later."""

    def __init__(self, ahead: float):
        self.ahead = ahead

    def time(self) -> float:
        return time.time() + self.ahead

    def __getattr__(self, name: str):
        return getattr(time, name)


@contextlib.contextmanager
def lock_clock_past_the_lease(out: str) -> Iterator[None]:
    """Within, this process's lock clock reads a second past the lease on `out` (held by a stopped
    run, so it stays as it is): as if the wait for its expiry had passed."""
    held = output_lock.read_lock(out)
    assert held is not None, "the stopped run holds no lock"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(output_lock, "time", _ClockAhead(max(0.0, held.expires - time.time() + 1.0)))
        yield


def read(path: str) -> bytes | None:
    found = storage_for(path).read(path)
    return None if found is None else found.data


def assert_wholly_one_runs(out: str, source: str) -> RunRecord:
    """Every length verifies and came from `source`, the tokenized set too, and published.json
    names exactly these manifests (and the tokens manifest) by sha256."""
    record = RunRecord.from_json(read(layout.run_record_path(out)).decode())
    assert sorted(loaders.published_lengths(out)) == list(LENGTHS)
    for L in LENGTHS:
        with loaders.open_shards(layout.length_dir(out, L), expected_max_length=L, verify=True) as view:
            assert len(view) == view.manifest.num_rows > 0
            assert os.path.basename(view.manifest.inputs[0]["spec"]) == f"{source}.jsonl"
    tokens = read(layout.tokens_manifest_path(out))
    assert record.tokens_manifest_sha256 == __import__("hashlib").sha256(tokens).hexdigest()
    tokens_manifest = json.loads(tokens)
    assert os.path.basename(tokens_manifest["inputs"][0]["spec"]) == f"{source}.jsonl"
    names = set(storage_for(out).versions(layout.tokens_dir(out)))
    assert {s["path"] for s in tokens_manifest["shards"]} <= names  # every file it names is there
    return record


def lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("prepack pack: ")]


# Each case starts from the same published set (run "old"), packed once per module and copied:
# a copy is what the runs under test find (the same files and run record, published.json naming
# its manifests relative to the output), without a pack per case.
@pytest.fixture(scope="module")
def gcs_old(gcs_emulator, inputs):  # noqa: F811
    out = gcs_emulator.url(f"fencing-old-{uuid.uuid4().hex[:8]}", "out")
    assert cli.main(pack_argv(inputs["old"], out)) == 0
    return out


@pytest.fixture(scope="module")
def local_old(inputs, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("fencing-old") / "out")
    assert cli.main(pack_argv(inputs["old"], out)) == 0
    return out


def copy_published(source: str, target: str) -> str:
    store = storage_for(source)
    for path in store.list_files(source):
        store.write(target + path[len(source):], store.read_bytes(path))
    return target


@pytest.fixture
def gcs_out(gcs_prefix, gcs_old):
    return copy_published(gcs_old, f"{gcs_prefix}/out")


def b_takes_over_from_stopped(a: PackRun, out: str, inputs: dict, capsys, wait: bool) -> RunRecord:
    """Once run A is stopped (its lease renewer too) and its gs:// lease has run out (`wait`: in
    real time; else on B's lock clock), run B publishes over it with --overwrite; returns B's run
    record (its set is wholly B's)."""
    a.wait_until_stopped()
    if wait:
        while (held := output_lock.read_lock(out)) is not None and held.expires >= time.time():
            time.sleep(0.1)
    with contextlib.nullcontext() if wait else lock_clock_past_the_lease(out):
        code, err = run_here(capsys, inputs["b"], out, "--overwrite")
    assert code == 0, err
    return assert_wholly_one_runs(out, "b")


def b_takes_over_then_a_resumes(a: PackRun, out: str, inputs: dict, capsys, wait: bool = False) -> tuple[RunRecord, int, str]:
    """Run B takes the stopped run A's output (b_takes_over_from_stopped); then A is continued and
    runs to its end: B's run record, and A's exit code and stderr."""
    try:
        b_record = b_takes_over_from_stopped(a, out, inputs, capsys, wait)
    finally:
        a.signal(signal.SIGCONT)
    code, err = a.finish()
    return b_record, code, err


def _fast_one(points: list[str], fast: str) -> list:
    """Every point, all but `fast` in the slow tier: the fast tier keeps one."""
    return [p if p == fast else pytest.param(p, marks=pytest.mark.slow) for p in points]


@pytest.mark.parametrize("point", _fast_one(POINTS, "after_run_record"))
def test_gcs_run_paused_past_its_lease_changes_nothing_when_it_resumes(forks, gcs_out, inputs, capsys, point):
    out = gcs_out
    # A's renewer meets a storage error at every tick (lock_renew=error), so it never has a renewal
    # in flight when A stops itself: such a renewal would be timed across the pause and end A, on
    # resuming, with LeaseTooShort's line instead (seen once in 19 runs on a busy machine). A's own
    # steps renew its lease meanwhile; the renewer's own stop is test_output_lock.py's.
    a = start(forks, inputs["a"], out, "--overwrite", failpoints=f"{point}=stop;lock_renew=error")
    # One case waits out the lease in real time; the others move B's lock clock past it.
    b_record, code, err = b_takes_over_then_a_resumes(a, out, inputs, capsys, wait=point == "after_run_record")
    assert code == 1, err
    (line,) = lines(err)
    m = re.fullmatch(rf"prepack pack: this run \(run (\w+)\) lost the lock on {re.escape(out)} \(.*\); the output now belongs "
                     rf"to run {b_record.run_id} \(.*\)\. This run stopped and changed nothing more", line)
    assert m, line
    assert m[1] != b_record.run_id
    assert assert_wholly_one_runs(out, "b") == b_record


# Each point once: a point hit once per set (before_delete) stops a resumed local run again otherwise.
LOCAL_POINTS = [p if p != "before_delete" else "before_delete:L64" for p in POINTS]


@pytest.mark.parametrize("point", _fast_one(LOCAL_POINTS, "after_run_record"))
def test_local_run_paused_holds_the_output_until_it_ends(forks, inputs, local_old, tmp_path, capsys, point):
    out = copy_published(local_old, str(tmp_path / "out"))
    a = start(forks, inputs["a"], out, "--overwrite", failpoints=f"{point}=stop")
    try:
        a.wait_until_stopped()
        # Past --lock-expiry-s (on B's lock clock): the OS lock does not expire. The lock is the
        # same at every point, so one case looks that far ahead; the others try at once.
        with lock_clock_past_the_lease(out) if point == "after_run_record" else contextlib.nullcontext():
            code, err = run_here(capsys, inputs["b"], out, "--overwrite")
        assert code == 1
        (line,) = lines(err)
        assert re.fullmatch(
            rf"prepack pack: {re.escape(out)} is being written by run \w+ \(pid {a.pid} on .*\), whose process holds the OS "
            r"lock on .*/\.lock \(a paused run keeps it until it ends\)\. Wait for that run to end, end that process to "
            r"free the output, or choose another --output", line), line
    finally:
        a.signal(signal.SIGCONT)
    code, err = a.finish()
    assert code == 0, err
    assert_wholly_one_runs(out, "a")
    assert not os.path.exists(layout.lock_path(out))


@pytest.mark.slow
def test_local_run_ended_while_paused_frees_the_output(forks, inputs, tmp_path, capsys):
    """The operator's way out: end the paused process; the next run takes over at once."""
    out = str(tmp_path / "out")
    a = start(forks, inputs["a"], out, failpoints="after_manifest_switch:L64=stop")
    a.wait_until_stopped()
    a.signal(signal.SIGKILL)
    assert a.finish()[0] == -signal.SIGKILL
    code, err = run_here(capsys, inputs["b"], out, "--overwrite", "--clean-stale")
    assert code == 0, err
    assert_wholly_one_runs(out, "b")


@pytest.mark.slow
def test_a_live_local_lock_is_not_taken_over_from_another_pid_namespace(forks, inputs, tmp_path):
    """Run A is paused; run B starts in a new PID namespace (`unshare --pid --fork`), where A's
    pid does not exist. The flock is the kernel's, shared across namespaces: B is refused, and
    A, continued, publishes. Shown to fail with the flock taken out of LocalLock (B, seeing no
    such pid, took the live output over); the gs:// lease's counterpart is in test_output_lock.py."""
    if subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid needs root (CAP_SYS_ADMIN)")
    out = str(tmp_path / "out")
    a = start(forks, inputs["a"], out, failpoints="before_publish=stop")
    try:
        a.wait_until_stopped()
        check = f"import os, sys; sys.exit(0 if not os.path.exists('/proc/{a.pid}/status') else 3)"
        b = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c",
                            f"{sys.executable} -c \"{check}\" && exec {' '.join(pack_args(inputs['b'], out, '--overwrite'))}"],
                           cwd=ROOT, env=run_env(), capture_output=True, text=True, timeout=120)
        assert b.returncode == 1, b.stderr  # 3: A's pid was visible, the namespace did not isolate it
        (line,) = lines(b.stderr)
        assert f"is being written by run " in line and f"(pid {a.pid} on " in line and "holds the OS lock" in line
    finally:
        a.signal(signal.SIGCONT)
    code, err = a.finish()
    assert code == 0, err
    assert_wholly_one_runs(out, "a")


@pytest.mark.slow
def test_gcs_run_that_loses_its_lease_while_paused_stops_at_once(forks, gcs_out, inputs, capsys):
    """Paused right after taking the lock, past its lease; run B publishes meanwhile. When A
    resumes, its first step proves it still holds the lease, finds it taken over and stops with
    the one line: A never reaches before_publish (which would exit 9). A's renewer meets a storage
    error at every tick (lock_renew=error), so only that first step can stop it. Shown to fail
    without the held.check() after after_lock in job.run (A ran its whole pipeline and exited 9
    there). The renewer's own stop (LeaseLock.on_lost, mid-pipeline) is timed by its thread, so
    its test is test_output_lock.py's, which waits for it rather than racing the pipeline."""
    out = gcs_out
    a = start(forks, inputs["a"], out, "--overwrite", failpoints="after_lock=stop;lock_renew=error;before_publish=exit(9)")
    b_record, code, err = b_takes_over_then_a_resumes(a, out, inputs, capsys)
    assert code == 1, err
    (line,) = lines(err)
    assert re.fullmatch(rf"prepack pack: this run \(run \w+\) lost the lock on {re.escape(out)} \(.*\); the output now "
                        rf"belongs to run {b_record.run_id} \(.*\)\. This run stopped and changed nothing more", line), line
    assert assert_wholly_one_runs(out, "b") == b_record
