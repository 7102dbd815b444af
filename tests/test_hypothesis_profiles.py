"""The suite gives one result on every machine: property tests are derandomized by default, and
`--hypothesis-profile explore` opts in to fresh examples (conftest.py registers both)."""

from __future__ import annotations

import os
import subprocess
import sys

from hypothesis import settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = '''
import json, os
from hypothesis import given, settings, strategies as st

@given(st.integers())
def test_draws(x):
    with open(os.environ["DRAWN"], "a") as f:
        f.write(json.dumps([settings().derandomize, x]) + "\\n")
'''


def test_the_default_profile_is_derandomized(request):
    if request.config.getoption("hypothesis_profile", None) == "explore":
        assert settings.get_current_profile_name() == "explore" and not settings.default.derandomize
    else:
        assert settings.get_current_profile_name() == "default"
        assert settings.default.derandomize and settings.default.database is None


def _drawn(tmp_path, name: str, *args: str) -> list:
    import json

    (tmp_path / "test_probe.py").write_text(PROBE)
    out = tmp_path / f"{name}.jsonl"
    # The probe lies outside the repository, so the root conftest.py (the profiles) is loaded as a plugin.
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest",
                    str(tmp_path / "test_probe.py"), *args],
                   cwd=ROOT, env={**os.environ, "DRAWN": str(out)}, check=True, capture_output=True, timeout=120)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_two_runs_draw_the_same_examples_and_explore_draws_fresh_ones(tmp_path):
    first, second = _drawn(tmp_path, "first"), _drawn(tmp_path, "second")
    assert first == second and first and all(derandomized for derandomized, _ in first)
    explored = _drawn(tmp_path, "explore", "--hypothesis-profile", "explore")
    assert explored and not any(derandomized for derandomized, _ in explored)
