"""SIGINT / SIGTERM to the main process alone end the job, its workers and its staging; on
Dataflow the submitted job is cancelled.

The signal is sent at a chosen moment, not after a sleep: the input is a named pipe, so a
worker that starts reading it blocks there, and the test signals once a worker has opened it.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from pipelines.launch import interrupts

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_for(condition, what: str, limit_s: float = 120.0):
    """Polls a condition (not a timing assumption: the limit only bounds a hung test)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# Installed into every process of the job (launcher and SDK workers) through PYTHONPATH: holds
# a worker at the named fault point until the test opens the gate (a FIFO that is no input:
# inputs must be regular files, so the job itself never reads one).
HOLD_AT_FAULT_POINT = """
import os
if os.environ.get("PREPACK_TEST_HOLD_AT"):
    import pipelines.faults.failpoints as failpoints
    _real = failpoints.hit

    def hit(point, detail=None):
        if f"{point}:{detail}" == os.environ["PREPACK_TEST_HOLD_AT"]:
            with open(os.environ["PREPACK_TEST_GATE"], "rb") as gate:
                gate.read()
        _real(point, detail)

    failpoints.hit = hit
"""


def open_gate_when_a_worker_waits(job: subprocess.Popen, gate) -> Any:
    """The gate FIFO opened for writing, once a worker holds it open to read (it is held at the
    fault point): the job is then mid-pipeline. Closing the file lets the worker go on."""
    def worker_waits():
        assert job.poll() is None, f"the job ended early: {job.stderr.read()}"
        try:
            return os.open(gate, os.O_WRONLY | os.O_NONBLOCK)
        except OSError as e:
            if e.errno != errno.ENXIO:
                raise
            return None

    return os.fdopen(wait_for(worker_waits, "a worker at the fault point"), "wb")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_to_the_main_process_ends_job_and_workers(tmp_path, signum):
    """Base commit: SIGINT hung for minutes; SIGTERM killed the main process (status -15) and
    left two workers running and the staging folder behind."""
    from testkit.pipeline import alpaca_records, write_jsonl

    source = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(8))
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_AT_FAULT_POINT)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hook), ROOT, os.environ.get("PYTHONPATH", "")]),
               PREPACK_TEST_HOLD_AT="input_read:start", PREPACK_TEST_GATE=str(gate))
    job = subprocess.Popen(
        [sys.executable, "-m", "pipelines.launch.cli", "--input", source, "--format", "alpaca", "--output", str(out),
         "--max-length", "64", "--no-progress", "--direct_running_mode=multi_processing", "--direct_num_workers=2"],
        env=env, stderr=subprocess.PIPE, text=True)
    try:
        with open_gate_when_a_worker_waits(job, gate):  # the job is mid-pipeline
            workers = interrupts.descendants(job.pid)
            assert workers, "the job has no worker processes"
            assert os.path.isdir(out) and os.path.exists(out / ".lock")
            job.send_signal(signum)
            code = job.wait(timeout=interrupts.GRACE_S + 10)
        stderr = job.stderr.read()
    finally:
        if job.poll() is None:
            job.kill()
    assert code == 130
    assert stderr.strip().splitlines()[-1] == "prepack pack: interrupted; nothing new was published, the previous shard sets are intact"
    assert "Traceback" not in stderr.split("prepack pack:")[-1]
    wait_for(lambda: not [p for p in workers if alive(p)], "the workers to exit", limit_s=5)
    left = [os.path.join(r, f) for r, _, fs in os.walk(out) for f in fs]
    assert left == []  # staging removed, lock released


class FakeDataflowResult:
    """What DataflowRunner.run returns: the job was submitted and runs remotely."""

    def __init__(self):
        self.cancelled = 0

    def job_id(self) -> str:
        return "2026-12-01_fake"

    def wait_until_finish(self, duration=None):
        raise KeyboardInterrupt  # Ctrl-C while the launcher waits for the remote job

    def cancel(self):
        self.cancelled += 1


def test_interrupted_wait_cancels_the_submitted_dataflow_job(tmp_path, monkeypatch):
    import apache_beam as beam

    from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl
    from pipelines.launch.job import Interrupted, run
    from pipelines.options import parse_args

    submitted = FakeDataflowResult()
    monkeypatch.setattr(beam.Pipeline, "run", lambda self, *a, **k: submitted)
    path = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(5))
    out = tmp_path / "out"
    config, beam_args = parse_args(["--input", path, "--format", "alpaca", "--output", str(out), "--no-progress"] + IN_PROCESS)
    with pytest.raises(Interrupted, match="^interrupted; nothing new was published"):
        run(config, beam_args)
    assert submitted.cancelled == 1
    assert [f for _, _, fs in os.walk(out) for f in fs] == []


def test_launcher_passes_the_signal_to_the_job_and_waits(tmp_path):
    """The launcher alone gets SIGINT (as from `kill -INT`): the job process gets SIGTERM (it
    then cancels the Dataflow job, tested above), the launcher waits for it and exits non-zero."""
    ready, got = tmp_path / "ready", tmp_path / "got"
    child = (
        "import pathlib, signal, sys, time\n"
        f"def on_term(s, f):\n    pathlib.Path({str(got)!r}).write_text(str(s)); sys.exit(130)\n"
        "signal.signal(signal.SIGTERM, on_term)\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        f"pathlib.Path({str(ready)!r}).write_text('up')\n"
        "while True:\n    time.sleep(0.05)\n"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", f"import sys; from gcp.launch_dataflow import run_job; sys.exit(run_job([sys.executable, '-c', {child!r}]))"],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready.exists, "the job process to start")
        launcher.send_signal(signal.SIGINT)
        code = launcher.wait(timeout=30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert got.read_text() == str(int(signal.SIGTERM))
    assert code == 128 + signal.SIGINT
    assert launcher.stderr.read().strip().endswith("the job was asked to cancel its Dataflow job and exited with status 130")


def test_sigkill_between_lengths_then_the_next_run_repairs(tmp_path):
    """A real death of the launcher right after L64's manifest was switched (the failpoint
    after_manifest_switch:L64=exit(137) in a child process): both lengths still verify, each whole;
    published.json says they mix two runs; the next --overwrite run takes over the dead run's
    lock by itself (the kernel dropped its OS lock), reports
    its staging as leftovers, and publishes one consistent set.
    Base commit: a kill here left L64 new and L256 old with nothing to flag it, and a kill after the
    old manifest's removal left L64 with no manifest at all."""
    import json

    import loaders
    from testkit.pack_forks import PackForks
    from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl

    old = write_jsonl(str(tmp_path / "old.jsonl"), alpaca_records(16, seed=0))
    new = write_jsonl(str(tmp_path / "new.jsonl"), alpaca_records(16, seed=5))
    out = tmp_path / "out"

    def args(inp: str, *extra: str) -> list[str]:
        return ["--input", inp, "--format", "alpaca", "--output", str(out), "--max-length", "64", "256",
                "--no-tokens", "--no-progress", *IN_PROCESS, *extra]

    def pack_in_child(inp: str, kill_at: str | None, *extra: str) -> tuple[int, str]:
        """`prepack pack` in a process of its own (forked after the job's imports: testkit/pack_forks.py)."""
        env = dict(os.environ, PYTHONPATH=ROOT)
        env.pop("PREPACK_FAILPOINTS", None)
        if kill_at:
            env["PREPACK_FAILPOINTS"] = f"{kill_at}=exit(137)"  # os._exit: nothing cleaned, as kill -9
        return forks.start(args(inp, *extra), env).finish()

    with PackForks(ROOT) as forks:
        assert pack_in_child(old, None)[0] == 0
        killed_code, _ = pack_in_child(new, "after_manifest_switch:L64", "--overwrite")
        assert killed_code == 137
        sources = {}
        for L in (64, 256):
            with loaders.open_shards(str(out / f"L{L}"), expected_max_length=L, verify=True):
                pass
            sources[L] = os.path.basename(json.loads((out / f"L{L}" / "manifest.json").read_text())["inputs"][0]["spec"])
        assert sources == {64: "new.jsonl", 256: "old.jsonl"}
        with pytest.raises(loaders.ShardSetError, match="mix two runs"):
            loaders.published_lengths(str(out))
        assert (out / ".lock").exists()

        again_code, again_stderr = pack_in_child(new, None, "--overwrite")
    assert again_code == 0, again_stderr
    assert f"{out} holds leftovers of earlier killed runs: 1 staging folder ({out}/.staging-" in again_stderr
    assert sorted(loaders.published_lengths(str(out))) == [64, 256]
    for L in (64, 256):
        with loaders.open_shards(str(out / f"L{L}"), expected_max_length=L, verify=True):
            pass
    assert not (out / ".lock").exists()


@pytest.mark.parametrize("second_signal", [False, True])
def test_stuck_main_thread_still_exits_and_cleans_up(tmp_path, second_signal):
    """The main thread swallows the KeyboardInterrupt and keeps waiting (as Beam's runner did
    for minutes on the base commit): the watchdog runs the registered clean-up and exits 130
    after the grace period; a second signal does so at once."""
    cleaned, ready, first = tmp_path / "cleaned", tmp_path / "ready", tmp_path / "first"
    child = subprocess.Popen([sys.executable, "-c", (
        "import pathlib, time\n"
        "from pipelines.launch import interrupts\n"
        f"interrupts.GRACE_S = {3600 if second_signal else 1.0}\n"
        "interrupts.install()\n"
        f"interrupts.register(lambda: pathlib.Path({str(cleaned)!r}).write_text('yes'))\n"
        "while True:\n"
        "    try:\n"
        f"        pathlib.Path({str(ready)!r}).write_text('up')  # inside the try: from here a signal is swallowed\n"
        "        time.sleep(0.05)\n"
        "    except KeyboardInterrupt:\n"
        f"        pathlib.Path({str(first)!r}).write_text('got')  # and swallows it, as a stuck runner would\n"
    )], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stderr=subprocess.PIPE, text=True)
    try:
        wait_for(ready.exists, "the child to start")
        child.send_signal(signal.SIGINT)
        if second_signal:
            wait_for(first.exists, "the first signal to land")
            child.send_signal(signal.SIGINT)
        code = child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
    assert code == 128 + signal.SIGINT
    assert cleaned.read_text() == "yes"
    assert child.stderr.read().strip() == "prepack pack: stopped by signal 2; nothing new was published by this run"



# A worker's dying words, made deterministic: in each SDK worker process (and only there) this
# sitecustomize says it is up, then answers SIGINT at once by writing to its stderr, as real
# workers do with KeyboardInterrupt tracebacks, "CRITICAL ... sdk harness failed" and gRPC's
# "terminate called without an active exception" when Ctrl-C reaches them mid-import or
# mid-bundle (those print only when they win the race against the launcher's SIGTERM).
NOISY_WORKER = '''
import os, signal, sys, threading
if "sdk_worker_main" in " ".join(getattr(sys, "orig_argv", sys.argv)):
    os.write(2, b"worker up\\n")
    # Every thread Beam starts inherits this mask: SIGINT reaches only the sigwait below, so the
    # words are written on every Ctrl-C, before the launcher's SIGTERM can end the worker.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    def _last_words():
        signal.sigwait({signal.SIGINT})
        os.write(2, b"CRITICAL worker: sdk harness failed\\nterminate called without an active exception\\n")
        os._exit(1)
    threading.Thread(target=_last_words, daemon=True).start()
'''


@pytest.mark.parametrize("verbose", [False, True])
def test_ctrl_c_to_the_process_group_prints_only_the_last_line(tmp_path, verbose):
    """Ctrl-C signals the whole foreground process group, workers included. What workers write
    before it passes through; after it only the launcher's last line shows, unless --verbose.
    Base commit: the workers' words after the signal reached the terminal."""
    from testkit.pipeline import alpaca_records, write_jsonl

    site = tmp_path / "site"
    site.mkdir()
    # Workers hold at the input_read:start failpoint until the test opens the gate (a FIFO that
    # is no input: inputs must be regular files), so the signal comes mid-pipeline.
    (site / "sitecustomize.py").write_text(NOISY_WORKER + HOLD_AT_FAULT_POINT)
    source = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(8))
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), ROOT, os.environ.get("PYTHONPATH", "")]),
               PREPACK_TEST_HOLD_AT="input_read:start", PREPACK_TEST_GATE=str(gate))
    job = subprocess.Popen(
        [sys.executable, "-m", "pipelines.launch.cli", "--input", source, "--format", "alpaca", "--output", str(out),
         "--max-length", "64", "--no-progress", "--direct_num_workers=2", *(["--verbose"] if verbose else [])],
        env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)

    try:
        with open_gate_when_a_worker_waits(job, gate):  # the job is mid-pipeline
            os.killpg(job.pid, signal.SIGINT)  # what the terminal does on Ctrl-C
            code = job.wait(timeout=interrupts.GRACE_S + 10)
        stderr = job.stderr.read()
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
    assert code == 130
    lines = stderr.splitlines()
    assert lines[-1] == "prepack pack: interrupted; nothing new was published, the previous shard sets are intact"
    if verbose:
        assert "terminate called without an active exception" in lines and any(line.startswith("INFO ") for line in lines)
    else:
        assert lines[:-1] and set(lines[:-1]) == {"worker up"}, stderr  # before the signal: passed through


def test_in_process_pack_gives_the_callers_signal_handlers_back(tmp_path):
    """A test or notebook calling pipelines.launch.cli.main keeps its own SIGINT/SIGTERM handlers afterwards
    (they used to stay prepack's, and a later Ctrl-C in the test session raised inside pytest)."""
    from pipelines.launch.cli import main
    from testkit.pipeline import IN_PROCESS, alpaca_records, write_jsonl

    def mine(signum, frame):
        pass

    before = {s: signal.signal(s, mine) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        path = write_jsonl(str(tmp_path / "in.jsonl"), alpaca_records(4))
        assert main(["--input", path, "--format", "alpaca", "--output", str(tmp_path / "out"), "--max-length", "64",
                     "--no-progress", *IN_PROCESS]) == 0
        assert signal.getsignal(signal.SIGINT) is mine and signal.getsignal(signal.SIGTERM) is mine
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
