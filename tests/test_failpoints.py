"""PREPACK_FAILPOINTS: each action does what it says, at the point named, and a bad value is one line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pipelines.faults import failpoints

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_reads_every_action():
    got = failpoints.parse(" before_publish=stop; after_manifest_switch:L64=sleep(0.5);after_run_record=exit(3);"
                           "before_delete=error ;")
    assert got == {
        "before_publish": failpoints.Action("stop"),
        "after_manifest_switch:L64": failpoints.Action("sleep", 0.5),
        "after_run_record": failpoints.Action("exit", 3),
        "before_delete": failpoints.Action("error"),
    }


@pytest.mark.parametrize("value, message", [
    ("before_publish", "'before_publish': expected NAME=ACTION (for example before_publish=stop)"),
    ("=stop", "'=stop': expected NAME=ACTION (for example before_publish=stop)"),
    ("befor_publish=stop", "'befor_publish=stop': unknown failpoint 'befor_publish'; known: after_lock, before_publish, "),
    ("before_publish=pause", "'before_publish=pause': unknown action 'pause'; use stop, sleep(SECONDS), exit(CODE) or error"),
    ("before_publish=sleep", "'before_publish=sleep': sleep needs an argument: sleep(SECONDS)"),
    ("before_publish=sleep(-1)", "'before_publish=sleep(-1)': sleep needs a number of seconds >= 0, got '-1'"),
    ("before_publish=sleep(nan)", "'before_publish=sleep(nan)': sleep needs a number of seconds >= 0, got 'nan'"),
    ("before_publish=exit(256)", "'before_publish=exit(256)': exit needs an exit status 0-255, got '256'"),
    ("before_publish=exit(x)", "'before_publish=exit(x)': exit needs an exit status 0-255, got 'x'"),
    ("before_publish=stop(1)", "'before_publish=stop(1)': stop takes no argument"),
    ("before_publish=stop;before_publish=error", "'before_publish=error': before_publish is set twice"),
    ("after_lock:L9999=error", "'after_lock:L9999=error': after_lock takes no detail (it is hit once per run); "
                               "use after_lock=ACTION"),
    ("after_manifest_switch:64=error", "'after_manifest_switch:64=error': after_manifest_switch takes the detail "
                                       "L<length> or tokens, not '64'"),
    ("before_delete:L0=error", "'before_delete:L0=error': before_delete takes the detail L<length> or tokens, not 'L0'"),
    ("input_read:end=stop", "'input_read:end=stop': input_read takes the detail start or whole_file, not 'end'"),
])
def test_a_bad_value_is_one_line(value, message):
    with pytest.raises(failpoints.FailpointError) as e:
        failpoints.parse(value)
    assert str(e.value).startswith(f"PREPACK_FAILPOINTS: {message}")
    assert "\n" not in str(e.value)


def test_a_bad_value_stops_pack_before_any_work(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, PREPACK_FAILPOINTS="before_publish=jump")
    done = subprocess.run([sys.executable, "-m", "pipelines.launch.cli", "--sample", "--output", str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, env=env)
    assert done.returncode == 2
    assert done.stderr.strip() == ("prepack pack: PREPACK_FAILPOINTS: 'before_publish=jump': unknown action 'jump'; "
                                   "use stop, sleep(SECONDS), exit(CODE) or error")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, args, message", [
    ("before_delete:L9999=error", ["--max-length", "128", "256"],
     "'before_delete:L9999': this run packs no max length 9999 (its --max-length: 128 256), so it would never fire"),
    ("after_manifest_switch:L64=stop", ["--max-length", "128"],
     "'after_manifest_switch:L64': this run packs no max length 64 (its --max-length: 128), so it would never fire"),
    ("before_delete:tokens=error", ["--max-length", "128", "--no-tokens"],
     "'before_delete:tokens': this run publishes no tokenized set (--no-tokens or --from-tokens), so it would never fire"),
])
def test_a_detail_the_run_never_hits_is_refused_before_any_work(tmp_path, capsys, monkeypatch, value, args, message):
    """`before_delete:L9999=error` was accepted and never fired: a test meaning to break a run
    there passed without breaking anything."""
    from pipelines.launch.cli import main

    monkeypatch.setenv(failpoints.ENV, value)
    assert main(["--sample", "--output", str(tmp_path / "out"), *args]) == 2
    assert capsys.readouterr().err == f"prepack pack: PREPACK_FAILPOINTS: {message}\n"
    assert not (tmp_path / "out").exists()
    failpoints.check([64, 128, 9999], publishes_tokens=True)  # the same values, for a run that hits them


def test_every_documented_detail_is_accepted():
    got = failpoints.parse("after_manifest_switch:L512=stop;after_manifest_switch:tokens=stop;before_delete:L64=stop;"
                           "before_delete:tokens=stop;input_read:start=stop;input_read:whole_file=stop")
    assert len(got) == 6


@pytest.mark.parametrize("point", ["after_lock", "before_publish", "input_read:start"])
def test_an_injected_error_is_the_jobs_one_line_failure(tmp_path, point):
    env = dict(os.environ, PYTHONPATH=ROOT, PREPACK_FAILPOINTS=f"{point}=error")
    done = subprocess.run([sys.executable, "-m", "pipelines.launch.cli", "--sample", "--max-length", "128", "--output",
                           str(tmp_path / "out"), "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 1, done.stderr
    # One line, a worker's failure included: its traceback and the runner's relays of it are
    # dropped (pipelines/launch/worker_stderr.py), the launcher states it.
    assert done.stderr.splitlines() == [
        f"prepack pack: failpoint {point}: injected error (PREPACK_FAILPOINTS); nothing new was published, the "
        "previous shard sets are intact"]
    assert not (tmp_path / "out").exists()


def test_detail_narrows_a_point_to_one_hit(monkeypatch):
    monkeypatch.setenv(failpoints.ENV, "after_manifest_switch:L256=error")
    failpoints.hit("after_manifest_switch", "L64")  # not this one
    with pytest.raises(failpoints.InjectedFault, match=r"^failpoint after_manifest_switch:L256: injected error$"):
        failpoints.hit("after_manifest_switch", "L256")
    monkeypatch.setenv(failpoints.ENV, "after_manifest_switch=error")
    with pytest.raises(failpoints.InjectedFault):
        failpoints.hit("after_manifest_switch", "L64")  # the bare name: every hit
    monkeypatch.delenv(failpoints.ENV)
    failpoints.hit("after_manifest_switch", "L64")


def _child(action: str, **kw) -> subprocess.Popen:
    code = ("import sys, time\nfrom pipelines.faults import failpoints\nprint('up', flush=True)\n"
            "failpoints.hit('before_publish')\nprint('after', flush=True)\n")
    env = dict(os.environ, PYTHONPATH=ROOT, PREPACK_FAILPOINTS=f"before_publish={action}")
    return subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True, **kw)


def test_exit_ends_the_process_at_once_with_the_code():
    child = _child("exit(7)")
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 7 and out == "up\n"


def test_sleep_then_goes_on():
    started = time.monotonic()
    child = _child("sleep(0.3)")
    out, _ = child.communicate(timeout=30)
    assert child.returncode == 0 and out == "up\nafter\n"
    assert time.monotonic() - started >= 0.3


def test_stop_pauses_the_whole_process_until_sigcont():
    child = _child("stop")
    assert child.stdout.readline() == "up\n"
    os.waitpid(child.pid, os.WUNTRACED)  # returns once the child is stopped
    with open(f"/proc/{child.pid}/stat") as f:
        assert f.read().rsplit(")", 1)[1].split()[0] == "T"  # stopped
    os.kill(child.pid, signal.SIGCONT)
    assert child.stdout.readline() == "after\n"
    assert child.wait(timeout=30) == 0
