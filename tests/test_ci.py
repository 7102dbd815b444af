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
