"""OUTPUT/.lock: one writer per output. Locally an OS lock (flock) that dies with its process;
on gs:// a lease renewed with generation preconditions. Liveness never rests on a pid existing
here. Also the storage's compare-and-swap that every publishing step uses (the GCS emulator
honors ifGenerationMatch)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest

from testkit.gcs_emulator import gcs_emulator, gcs_prefix  # noqa: F401  (pytest fixtures)
from pipelines.output import lock
from prepack import storage
from prepack.format import layout


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


def write_lock(output: str, data: bytes | None = None, **fields) -> None:
    """A lock file as another run left it (no OS lock held on it)."""
    info = {"run_id": "killed", "host": "elsewhere", "pid": 1, "created": 0.0, "expires": time.time() + 86400, **fields}
    data = json.dumps(info).encode() if data is None else data
    path = layout.lock_path(output)
    if not output.startswith("gs://"):
        os.makedirs(output, exist_ok=True)
    storage.storage_for(path).write(path, data)


def test_second_run_is_refused_with_the_owner_named(output):
    first = lock.OutputLock.acquire(output, "run-a", renew=False)
    held_by = rf"^{output} is being written by run run-a \(pid {os.getpid()} on .*, since .*\)"
    if output.startswith("gs://"):
        expected = held_by + r"; its lease .*\.lock expires .* unless that run renews it. Wait for that run to end, or choose another --output$"
    else:
        expected = held_by + (r", whose process holds the OS lock on .*\.lock \(a paused run keeps it until it ends\). Wait for "
                              r"that run to end, end that process to free the output, or choose another --output$")
    with pytest.raises(lock.LockHeld, match=expected):
        lock.OutputLock.acquire(output, "run-b", renew=False)
    first.release()
    second = lock.OutputLock.acquire(output, "run-b", renew=False)
    assert lock.read_lock(output).run_id == "run-b"
    second.release()
    assert lock.read_lock(output) is None


@pytest.mark.parametrize("left", ["expired", "half_written"])
def test_lock_of_a_killed_run_is_taken_over(output, left):
    write_lock(output, **({"expires": 1.0} if left == "expired" else {}), data=b'{"run_id": "kil' if left == "half_written" else None)
    taken = lock.OutputLock.acquire(output, "run-b", renew=False)
    assert lock.read_lock(output).run_id == "run-b"
    taken.check()
    taken.release()


@pytest.mark.parametrize("times", [{"expires": 1e308}, {"expires": float("inf")}, {"created": float("inf")},
                                   {"expires": -1e308}, {"created": 1e308}])
def test_a_lock_with_times_no_run_writes_is_read_as_corrupt(output, times, caplog):
    """A lease expiring at 1e308 or Infinity was written by no run (a run's expires is at most a
    day ahead): read as a corrupt lock, taken over with one warning line, where it was an
    OverflowError traceback ("output is not writable") or an output blocked for ever."""
    write_lock(output, **times)
    assert lock.LockInfo.from_bytes(storage.storage_for(output).read(layout.lock_path(output)).data) is None
    with caplog.at_level("WARNING", logger="prepack.pack"):
        taken = lock.OutputLock.acquire(output, "run-b", renew=False)
    assert lock.read_lock(output).run_id == "run-b"
    taken.release()
    if output.startswith("gs://"):
        assert [r.getMessage() for r in caplog.records] == [
            f"{layout.lock_path(output)} is corrupt (not a lock any run writes: half-written, or times such as an expiry "
            "of 1e308 or Infinity); taking it over as a stale lock"]


def test_an_oversized_lease_is_read_as_corrupt_unread(gcs_prefix, monkeypatch):
    """A lock object far larger than any lock (a stranger's) is never downloaded: read as corrupt."""
    out = f"{gcs_prefix}/out"
    write_lock(out, data=b"{" + b" " * (lock.MAX_LOCK_BYTES + 1) + b"}")
    downloads = []
    real = storage.GcsStorage.read

    def counting(self, path, limit=None):
        try:
            found = real(self, path, limit)
        except Exception:
            downloads.append(None)
            raise
        downloads.append(len(found.data) if found else None)
        return found

    monkeypatch.setattr(storage.GcsStorage, "read", counting)
    taken = lock.OutputLock.acquire(out, "run-b", renew=False)
    assert lock.read_lock(out).run_id == "run-b"
    taken.release()
    assert downloads and all(size is None or size <= lock.MAX_LOCK_BYTES for size in downloads)  # never downloaded


def test_a_local_lock_that_is_a_symbolic_link_is_refused_and_what_it_points_to_kept(tmp_path):
    """OUTPUT/.lock as a symbolic link: the file it points to (outside the output) was truncated
    and overwritten with the lock's JSON. The lock is never taken through a link: one line."""
    precious = tmp_path / "elsewhere" / "notes.txt"
    precious.parent.mkdir()
    precious.write_text("not yours to overwrite\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").symlink_to(precious)
    with pytest.raises(lock.LockHeld) as refused:
        lock.OutputLock.acquire(str(out), "run-a")
    assert str(refused.value) == (
        f"{out}/.lock is a symbolic link (to {str(precious)!r}): the output lock is never taken through a link, which "
        "would write outside the output. Remove the link, or choose another --output")
    assert precious.read_text() == "not yours to overwrite\n"
    (out / ".lock").unlink()
    os.symlink(tmp_path / "no-such-file", out / ".lock")  # a dangling link: O_CREAT would have made its target
    with pytest.raises(lock.LockHeld, match="is a symbolic link"):
        lock.OutputLock.acquire(str(out), "run-a")
    assert not (tmp_path / "no-such-file").exists()


def test_a_local_lock_that_is_a_fifo_is_refused_in_one_line(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    os.mkfifo(out / ".lock")
    with pytest.raises(lock.LockHeld, match=r"^.*/out/\.lock is not a regular file: the output lock cannot be taken there"):
        lock.OutputLock.acquire(str(out), "run-a")


def test_a_local_lock_file_without_its_os_lock_is_free(tmp_path):
    """Locally the flock is the lock: a file left by a killed process (whatever it says, even
    an expiry far ahead and a live pid) is taken over at once."""
    out = str(tmp_path / "out")
    write_lock(out, host=socket.gethostname(), pid=os.getppid(), expires=time.time() + 86400)
    taken = lock.OutputLock.acquire(out, "run-b")
    assert taken.took_over.run_id == "killed"
    taken.release()


def test_a_live_lease_naming_a_pid_that_does_not_exist_here_is_respected(gcs_prefix):
    """The PID-namespace bug: a lease on this hostname whose pid does not exist here belongs to a
    run in another container (shared hostname, separate PID namespace); until it expires it is
    live. Shown to fail with the old rule (same host and no such pid: stale), which took it over."""
    out = f"{gcs_prefix}/out"
    write_lock(out, host=socket.gethostname(), pid=dead_pid(), expires=time.time() + 600)
    with pytest.raises(lock.LockHeld, match="being written by run killed"):
        lock.OutputLock.acquire(out, "run-b", renew=False)


def test_lease_takeover_is_exclusive(gcs_prefix, monkeypatch):
    """Two runs judge the same stale lease: run C takes it over while run B is between judging
    and deleting. B's delete (conditioned on the generation it judged) must not remove C's lease.
    Shown to fail when delete_if ignores the generation (B deletes C's lease and takes it too)."""
    out = f"{gcs_prefix}/out"
    write_lock(out, expires=1.0)
    original = storage.GcsStorage.delete_if
    raced = []

    def race_then_delete(self, path, version):
        if not raced:
            raced.append(None)  # C's own delete below must not race again
            raced[0] = lock.OutputLock.acquire(out, "run-c", renew=False)
        return original(self, path, version)

    monkeypatch.setattr(storage.GcsStorage, "delete_if", race_then_delete)
    with pytest.raises(lock.LockHeld, match="being written by run run-c"):
        lock.OutputLock.acquire(out, "run-b", renew=False)
    assert lock.read_lock(out).run_id == "run-c"
    raced[0].check()
    raced[0].release()


def test_renewal_extends_the_lease_and_a_stolen_lease_is_noticed(gcs_prefix):
    out = f"{gcs_prefix}/out"
    held = lock.OutputLock.acquire(out, "run-a", expiry_s=60, renew=False)
    before = lock.read_lock(out).expires
    time.sleep(0.01)
    held.check()  # a check is a conditional renewal
    assert lock.read_lock(out).expires > before
    write_lock(out, run_id="thief", expires=time.time() + 86400)
    with pytest.raises(lock.LockLost, match=r"^this run \(run run-a\) lost the lock on .*out \(its lease expired and was "
                                            r"taken over\); the output now belongs to run thief \(pid 1 on elsewhere, "):
        held.check()
    held.release()
    assert lock.read_lock(out).run_id == "thief"  # release never deletes someone else's lock


def test_the_renewer_that_finds_its_lease_taken_over_calls_on_lost(gcs_prefix):
    """The renewer thread, not the main one, finds the loss and stops the run (job.run points
    on_lost at interrupts.stop_main). Shown to fail with the on_lost call taken out of
    LeaseLock._renew_loop (the event never fired)."""
    out = f"{gcs_prefix}/out"
    held = lock.OutputLock.acquire(out, "run-a", expiry_s=1.5, renew=True)  # a renewal every 0.5 s
    fired = threading.Event()
    held.on_lost = fired.set
    try:
        write_lock(out, run_id="thief", expires=time.time() + 86400)
        assert fired.wait(timeout=30), "the renewer never reported the lost lease"
        assert isinstance(held.lost, lock.LockLost) and "now belongs to run thief" in str(held.lost)
        with pytest.raises(lock.LockLost):  # and the main thread's next step is refused
            held.check()
    finally:
        held.release()
    assert lock.read_lock(out).run_id == "thief"


def test_a_replaced_local_lock_file_is_noticed(tmp_path):
    out = str(tmp_path / "out")
    held = lock.OutputLock.acquire(out, "run-a")
    held.check()
    os.remove(layout.lock_path(out))
    thief = lock.OutputLock.acquire(out, "thief")
    with pytest.raises(lock.LockLost, match=r"\.lock was removed or replaced\); the output now belongs to run thief"):
        held.check()
    held.release()
    assert lock.read_lock(out).run_id == "thief"  # release never deletes someone else's lock
    thief.release()


def test_the_local_lock_is_not_inherited_by_child_processes(tmp_path):
    """Opened close-on-exec: a Beam worker started while the lock is held does not keep it when
    the run is killed (its lock file stays; the kernel drops the run's own descriptor). Shown to
    fail when the descriptor is made inheritable (the orphaned child then holds the flock)."""
    out = str(tmp_path / "out")
    held = lock.OutputLock.acquire(out, "run-a")
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(30)"],
                             close_fds=False, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # exec'd: until then a forked child holds every descriptor
        os.close(held._fd)  # the run is killed; its worker lives on
        lock.OutputLock.acquire(out, "run-b").release()
    finally:
        child.kill()
        child.wait()


def test_write_if_is_compare_and_swap(output, tmp_path):
    path = f"{output}/L64/manifest.json"
    tmp = str(tmp_path / "staging" / "manifest.tmp")
    store = storage.storage_for(path)
    store.write_if(path, b"one", store.absent, tmp=tmp)
    with pytest.raises(storage.SwitchRefused, match="changed by another run since this one started"):
        store.write_if(path, b"two", store.absent, tmp=tmp)  # must not exist: another run made it
    seen = store.version(path)
    store.write_if(path, b"two", seen, tmp=tmp)
    with pytest.raises(storage.SwitchRefused, match="changed by another run") as e:
        store.write_if(path, b"three", seen, tmp=tmp)  # changed since it was seen
    assert e.value.current == b"two"  # what is there now, to name its writer
    assert store.read(path).data == b"two"
    assert not os.path.exists(tmp)


def test_delete_if_deletes_only_the_version_seen(output):
    path = f"{output}/L64/rows-00000-of-00001-aaaaaaaaaaaa.array_record"
    if not output.startswith("gs://"):
        os.makedirs(os.path.dirname(path))
    store = storage.storage_for(path)
    store.write(path, b"old")
    seen = store.version(path)
    time.sleep(0.01)
    store.write(path, b"republished")  # a later run published the same (content-addressed) name
    assert not store.delete_if(path, seen)
    assert store.read(path).data == b"republished"
    assert store.delete_if(path, store.version(path))
    assert store.read(path) is None


@pytest.mark.parametrize("value", ["0", "-5", "nan", "100000", "1", "9.9"])
def test_lock_expiry_out_of_range_is_one_line(value):
    from pipelines.options import OptionsError, parse_args

    with pytest.raises(OptionsError) as e:
        parse_args(["--sample", "--output", "out", "--lock-expiry-s", value])
    assert str(e.value) == f"--lock-expiry-s must be between 10 and 86400 seconds, got {float(value):g}"


def test_lock_expiry_is_the_lease_length(gcs_prefix):
    from pipelines.options import parse_args

    config, _ = parse_args(["--sample", "--output", "out", "--lock-expiry-s", "10"])
    assert config.run.lock_expiry_s == 10.0 and parse_args(["--sample", "--output", "o"])[0].run.lock_expiry_s == 600.0
    out = f"{gcs_prefix}/out"
    held = lock.OutputLock.acquire(out, "run-a", expiry_s=config.run.lock_expiry_s, renew=False)
    info = lock.read_lock(out)
    assert 9.5 <= info.expires - info.created <= 10.5
    held.release()


@pytest.fixture
def slow_storage(gcs_emulator, monkeypatch):
    """The output layer's GCS client behind a 400 ms round trip (testkit/http_delay_proxy.py)."""
    from prepack.storage import gcs
    from testkit.http_delay_proxy import start_proxy

    with start_proxy(os.environ["STORAGE_EMULATOR_HOST"], delay_ms=400) as proxy:
        saved = os.environ["STORAGE_EMULATOR_HOST"]
        os.environ["STORAGE_EMULATOR_HOST"] = proxy.endpoint
        try:
            client = gcs._client(proxy.endpoint)
        finally:
            os.environ["STORAGE_EMULATOR_HOST"] = saved
        monkeypatch.setattr(gcs, "gcs_client", lambda: client)
        yield proxy


def test_a_lease_shorter_than_3_round_trips_is_refused_before_any_work(slow_storage, gcs_prefix):
    """Behind a 400 ms round trip a 1 s lease would look expired while its run is healthy.
    Shown to fail without lock._judge_trip (the lock was taken and the run went on)."""
    out = f"{gcs_prefix}/out"
    with pytest.raises(lock.LeaseTooShort) as e:
        lock.OutputLock.acquire(out, "run-a", expiry_s=1.0, renew=False)
    assert re.fullmatch(rf"the lease on {re.escape(out)} cannot be kept: a renewal round trip took 0\.\d\d s and "
                        r"--lock-expiry-s 1 is under 3x that, so other runs could take over this healthy one; pass "
                        r"--lock-expiry-s 10 or more", str(e.value)), str(e.value)
    assert lock.read_lock(out) is None  # the refused run leaves no lock behind
    held = lock.OutputLock.acquire(out, "run-b", expiry_s=10.0, renew=False)  # 3 x 0.4 s fits in 10 s
    held.check()
    held.release()


def test_a_renewal_slower_than_a_third_of_the_lease_stops_the_run(gcs_prefix, monkeypatch):
    out = f"{gcs_prefix}/out"
    held = lock.OutputLock.acquire(out, "run-a", expiry_s=0.6, renew=False)
    original = storage.GcsStorage.write_if

    def slow_write_if(self, *args, **kw):
        time.sleep(0.25)
        return original(self, *args, **kw)

    monkeypatch.setattr(storage.GcsStorage, "write_if", slow_write_if)
    with pytest.raises(lock.LeaseTooShort) as e:
        held.check()
    took = re.search(r"a renewal round trip took (\d+\.\d\d) s and --lock-expiry-s 0\.6 is under 3x", str(e.value))
    assert took is not None and float(took.group(1)) >= 0.25, str(e.value)  # the trip measured includes the sleep
    assert isinstance(held.lost, lock.LeaseTooShort)
    with pytest.raises(lock.LeaseTooShort):  # every later step is refused too
        held.check()
    held.release()
