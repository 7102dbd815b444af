"""CI runs the README's test command: the whole suite split over both cores (pytest-xdist)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_ci_runs_the_readmes_command_on_both_cores():
    readme = (REPO / "README.md").read_text()
    setup = re.search(r"```bash\n(.*?)```", readme, re.S).group(1).splitlines()
    assert setup[1] == "bash tests/run.sh -n 2"
    ci = (REPO / ".ci" / "run").read_text()
    assert 'exec bash tests/run.sh -n 2 "$@"' in ci
    setup_py = (REPO / "setup.py").read_text()
    assert re.search(r'"pytest-xdist>=[0-9.]+"', setup_py)  # installed by tests/run.sh (the dev extra)


def test_a_hung_test_fails_alone(tmp_path):
    """pytest-timeout (declared in the dev extra) is active with the suite's limit and the thread
    method: a test that outlives it, even one blocked where no signal is handled, ends its xdist
    worker; the test fails and the rest of the suite goes on in a new worker."""
    import subprocess
    import sys

    ini = (REPO / "pytest.ini").read_text()
    limit = int(re.search(r"^timeout = (\d+)$", ini, re.M).group(1))
    assert 60 <= limit <= 1800
    assert re.search(r"^timeout_method = thread$", ini, re.M)
    (tmp_path / "test_hang.py").write_text(
        "import time\n\ndef test_hangs():\n    time.sleep(60)\n\ndef test_after():\n    assert True\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c", str(REPO / "pytest.ini"),
                          "--rootdir", str(tmp_path), "-o", "timeout=2", "-n", "1", str(tmp_path)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert run.returncode == 1, run.stdout
    assert "FAILED test_hang.py::test_hangs - worker 'gw0' crashed" in run.stdout
    assert "1 failed, 1 passed" in run.stdout
