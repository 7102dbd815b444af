"""OUTPUT/.lock: one writer per output, exclusive creation, stale takeover, and the manifest switch's
compare-and-swap, locally and on gs:// (the GCS emulator honors ifGenerationMatch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from pipelines import lock, outputs


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.fixture(params=["local", "gcs"])
def output(request, tmp_path):
    if request.param == "local":
        return str(tmp_path / "out")
    emulator_prefix = request.getfixturevalue("gcs_prefix")
    return f"{emulator_prefix}/out"


def write_lock(output: str, **fields) -> None:
    info = {"run_id": "killed", "host": "elsewhere", "pid": 1, "created": 0.0, "expires": 4e9, **fields}
    path = lock.lock_path(output)
    if outputs.is_gcs(path):
        outputs._blob(path).upload_from_string(json.dumps(info))
    else:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            json.dump(info, f)


def test_second_run_is_refused_with_the_owner_named(output):
    first = lock.OutputLock.acquire(output, "run-a", renew=False)
    with pytest.raises(lock.LockHeld, match=rf"^{output} is being written by run run-a \(pid {os.getpid()} on .*\); "
                                            r"its lock .*\.lock expires .*Wait for that run to end, or choose another --output"):
        lock.OutputLock.acquire(output, "run-b", renew=False)
    first.release()
    second = lock.OutputLock.acquire(output, "run-b", renew=False)
    assert lock.read_lock(output).run_id == "run-b"
    second.release()
    assert lock.read_lock(output) is None


@pytest.mark.parametrize("left", ["expired", "dead_pid", "half_written"])
def test_lock_of_a_killed_run_is_taken_over(output, left):
    import socket

    if left == "expired":
        write_lock(output, expires=1.0)
    elif left == "dead_pid":
        write_lock(output, host=socket.gethostname(), pid=dead_pid())
    else:
        path = lock.lock_path(output)
        if outputs.is_gcs(path):
            outputs._blob(path).upload_from_string(b'{"run_id": "kil')
        else:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            open(path, "wb").write(b'{"run_id": "kil')
    taken = lock.OutputLock.acquire(output, "run-b", renew=False)
    assert lock.read_lock(output).run_id == "run-b"
    taken.check()
    taken.release()


def test_a_live_lock_on_another_host_is_respected_until_it_expires(output):
    write_lock(output, host="elsewhere", pid=dead_pid())  # another host: its pid says nothing here
    with pytest.raises(lock.LockHeld, match="being written by run killed"):
        lock.OutputLock.acquire(output, "run-b", renew=False)


def test_takeover_is_exclusive(output, monkeypatch):
    """Two runs judge the same stale lock: run C takes it over while run B is between judging
    and deleting. B's delete (conditional on the version it judged) must not remove C's lock.
    Shown to fail when delete_if ignores the version (B deletes C's lock and takes it too)."""
    write_lock(output, expires=1.0)
    original = lock.is_stale
    raced = []

    def judge_then_race(info, now=None):
        stale = original(info, now)
        if stale and not raced:
            raced.append(None)  # C's own judgement below must not race again
            raced[0] = lock.OutputLock.acquire(output, "run-c", renew=False)
        return stale

    monkeypatch.setattr(lock, "is_stale", judge_then_race)
    with pytest.raises(lock.LockHeld, match="being written by run run-c"):
        lock.OutputLock.acquire(output, "run-b", renew=False)
    assert lock.read_lock(output).run_id == "run-c"
    raced[0].check()
    raced[0].release()


def test_renewal_extends_the_expiry_and_a_stolen_lock_is_noticed(output):
    held = lock.OutputLock.acquire(output, "run-a", expiry_s=60, renew=False)
    before = lock.read_lock(output).expires
    held.renew()
    assert lock.read_lock(output).expires >= before
    held.check()
    write_lock(output, run_id="thief", expires=4e9)
    with pytest.raises(lock.LockLost, match=r"no longer held by this run \(run run-a; it is held by run thief"):
        held.check()
    held.renew()
    assert held.lost
    held.release()
    assert lock.read_lock(output).run_id == "thief"  # release never deletes someone else's lock


def test_switch_is_compare_and_swap(output, tmp_path):
    path = f"{output}/L64/manifest.json"
    tmp = str(tmp_path / "staging" / "manifest.tmp")
    absent = outputs.absent_version(path)
    outputs.switch(path, b"one", absent, tmp=tmp)
    with pytest.raises(outputs.SwitchRefused, match="created by another run|changed by another run"):
        outputs.switch(path, b"two", absent, tmp=tmp)  # must not exist: another run made it
    seen = outputs.version(path)
    outputs.switch(path, b"two", seen, tmp=tmp)
    with pytest.raises(outputs.SwitchRefused, match="changed by another run"):
        outputs.switch(path, b"three", seen, tmp=tmp)  # changed since it was seen
    assert outputs.read_bytes(path) == b"two"
    assert not os.path.exists(tmp)
