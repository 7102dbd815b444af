"""Real `prepack pack` processes without paying Python's and Beam's imports for each one.

A `python -m pipelines.launch.cli` process spends about 2.5 s of CPU importing Beam and the
job before it reads a record, twice what a small job then costs. Tests that start many
runs as processes, to pause them (SIGSTOP), kill them or let them exit at a failpoint
(tests/test_fencing.py), start them here instead:

    with PackForks(root) as forks:
        run = forks.start(argv, env)     # a PackRun: .pid is the run's own process
        run.wait_until_stopped()         # it sent itself SIGSTOP at its failpoint
        run.signal(signal.SIGCONT)
        code, err = run.finish()         # its exit status as subprocess reports it, and its stderr

A server process imports the job once, then forks for each run a child that sets the run's
environment, points its stdin at /dev/null and its stdout and stderr at files, and runs
`sys.exit(pipelines.launch.cli.main(argv))` as `python -m pipelines.launch.cli` does: the
interpreter ends it the same way (atexit handlers, exit status). The server is checked to be
single-threaded and to hold no clients when it forks, so a child starts as a fresh process
would after those imports. Each child is forked by a short-lived watcher process that waits
for it and records its exit status in a file: the test process is not the run's parent, so it
tells a stopped run by its state in /proc.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

# What every run imports first (Beam, the job, the report): imported once, by the server.
PRELOADED = ("apache_beam", "pipelines.launch.cli", "pipelines.launch.job", "pipelines.launch.report",
             "pipelines.launch.errors", "pipelines.launch.worker_stderr")


class PackRun:
    """One forked `prepack pack` run: its pid, and files its watcher writes."""

    def __init__(self, folder: str, server: subprocess.Popen):
        self.folder = folder
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(folder, "pid")):
            assert server.poll() is None, f"the fork server ended (status {server.returncode}); its stderr is the test's"
            assert time.monotonic() < deadline, "the fork server did not start the run"
            time.sleep(0.02)
        self.pid = int(open(os.path.join(folder, "pid")).read())

    def _status(self) -> int | None:
        path = os.path.join(self.folder, "status")
        return int(open(path).read()) if os.path.exists(path) else None

    def stderr(self) -> str:
        with open(os.path.join(self.folder, "stderr"), errors="replace") as f:
            return f.read()

    def stopped(self) -> bool:
        """Whether the run is stopped (SIGSTOP): state T in /proc/PID/stat."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] == "T"
        except (FileNotFoundError, ProcessLookupError):
            return False

    def wait_until_stopped(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._status() is not None:
                raise AssertionError(f"the run ended before its failpoint (exit {self._status()}): {self.stderr()}")
            if self.stopped():
                return
            time.sleep(0.05)
        raise AssertionError("the run did not reach its failpoint")

    def signal(self, signum: int) -> None:
        if self._status() is None:
            os.kill(self.pid, signum)

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        """Waits for the run to end: its exit status (negative: the signal that ended it, as
        subprocess says) and its stderr."""
        status = _wait_for_file(os.path.join(self.folder, "status"), timeout, f"the run (pid {self.pid}) did not end")
        return int(status), self.stderr()


def _wait_for_file(path: str, timeout: float, why: str) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if os.path.exists(path):
            return open(path).read()
        time.sleep(0.02)
    raise AssertionError(why)


def _write(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)  # readers see it whole


class PackForks:
    """The fork server, as a context manager: started on entry, ended on exit."""

    def __init__(self, root: str):
        self.root = root
        self.folder = tempfile.mkdtemp(prefix="pack-forks-")
        env = dict(os.environ, PYTHONPATH=root)
        env.pop("PREPACK_FAILPOINTS", None)
        self._server = subprocess.Popen([sys.executable, "-m", "testkit.pack_forks"], cwd=root, env=env,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self._server.stdout.readline()
        assert ready.strip() == "ready", f"the fork server did not start: {ready!r}"

    def start(self, argv: list[str], env: dict[str, str]) -> PackRun:
        """Starts `prepack pack ARGV` (the options after `python -m pipelines.launch.cli`) with
        exactly the environment `env`."""
        folder = os.path.join(self.folder, uuid.uuid4().hex[:12])
        os.mkdir(folder)
        self._server.stdin.write(json.dumps({"argv": argv, "env": env, "folder": folder}) + "\n")
        self._server.stdin.flush()
        return PackRun(folder, self._server)

    def __enter__(self) -> "PackForks":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Ends the server and removes its runs' files (call it once its runs have ended)."""
        if self._server.stdin.closed:
            return
        self._server.stdin.close()
        self._server.wait(timeout=30)
        self._server.stdout.close()
        shutil.rmtree(self.folder, ignore_errors=True)


# ----------------------------------------------------------------------------- the server


def _serve() -> list[str]:
    """The server's loop; returns only in a forked run, with that run's argv."""
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # watchers are reaped as they end
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        # A fork copies only the forking thread: one holding a lock elsewhere would leave it held.
        assert threading.active_count() == 1, f"the fork server has threads: {threading.enumerate()}"
        if os.fork() != 0:
            continue  # the server: next request
        # The watcher: forks the run, waits for it, records its exit status.
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the run and its own children wait as usual
        folder = request["folder"]
        pid = os.fork()
        if pid == 0:
            return _become_run(request)
        _write(os.path.join(folder, "pid"), str(pid))
        _, status = os.waitpid(pid, 0)
        _write(os.path.join(folder, "status"), str(os.waitstatus_to_exitcode(status)))
        os._exit(0)
    sys.exit(0)


def _become_run(request: dict) -> list[str]:
    folder = request["folder"]
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, os.path.join(folder, "stdout"), os.O_WRONLY | os.O_CREAT),
                            (2, os.path.join(folder, "stderr"), os.O_WRONLY | os.O_CREAT)):
        opened = os.open(name, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    sys.stdin = open(0, closefd=False)
    sys.argv = ["pipelines/launch/cli.py", *request["argv"]]
    return request["argv"]


if __name__ == "__main__":
    _argv = _serve()
    from pipelines.launch.cli import main

    sys.exit(main(_argv))
