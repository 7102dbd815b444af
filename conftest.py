"""Test-session policy for the whole repository: a skip must be expected.

A declared dependency that fails to import, or an ImportError in the project, must fail CI,
not turn tests into skips. So every skip's reason is checked against ALLOWED_SKIPS below: a
skip for any other reason fails the run (exit status 1, the skips listed), and the number of
skips is printed at the end of every run (tests/test_skip_policy.py shows both).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Any

from hypothesis import settings

# XLA compiles the same programs again and again across tests and the CLI runs they start (the
# tiny models' training steps, the reference forwards): one persistent compilation cache per
# test run, shared by the xdist workers and subprocesses (they inherit the environment), compiles
# each once. The executables are XLA's own, so what the tests check is unchanged; a fresh
# directory each run keeps runs independent. JAX reads these variables when it is imported.
_JAX_CACHE_OWNER = "JAX_COMPILATION_CACHE_DIR" not in os.environ
if _JAX_CACHE_OWNER:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="prepack-tests-xla-cache-")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

# Property tests draw the same examples on every machine: the default profile is derandomized
# (each test seeded from its own code) and keeps no example database, so the README's test command
# gives one result everywhere (a fresh run used to fail 1 time in ~23 on a drawn pattern). Opt in
# to exploring new examples on each run with `pytest --hypothesis-profile explore` (or
# `bash tests/run.sh --hypothesis-profile explore`), which also replays failures it found before.
settings.register_profile("default", derandomize=True, database=None)
settings.register_profile("explore", derandomize=False)
settings.load_profile("default")

# Skip reasons that may occur in a normal run, each with why it is allowed.
ALLOWED_SKIPS: dict[str, str] = {
    # tests/test_pipeline.py::test_hub_input_fails_fast_offline checks the one-line error for an
    # unreachable Hugging Face Hub; on a machine that reaches the Hub there is nothing to check.
    "the Hugging Face Hub is reachable here": "needs a machine without access to huggingface.co",
}

_skips: list[tuple[str, str]] = []  # (test id, reason)


def _reason(report: Any) -> str:
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_runtest_logreport(report: Any) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        _skips.append((report.nodeid, _reason(report)))


def pytest_collectreport(report: Any) -> None:
    if report.skipped:  # a whole module skipped at import (importorskip at the top)
        _skips.append((report.nodeid, _reason(report)))


def unexpected_skips() -> list[tuple[str, str]]:
    return [(nodeid, reason) for nodeid, reason in _skips if reason not in ALLOWED_SKIPS]


def pytest_unconfigure(config: Any) -> None:
    if _JAX_CACHE_OWNER and not hasattr(config, "workerinput"):  # the controller (or a run without xdist)
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


def pytest_sessionfinish(session: Any, exitstatus: int) -> None:
    if unexpected_skips() and exitstatus == 0:
        session.exitstatus = 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    unexpected = unexpected_skips()
    terminalreporter.write_line(f"skips: {len(_skips)} ({len(_skips) - len(unexpected)} on the allow-list in conftest.py)")
    for nodeid, reason in unexpected:
        terminalreporter.write_line(f"UNEXPECTED SKIP (fails the run; allow it in conftest.py only with a reason): "
                                    f"{nodeid}: {reason}", red=True)
