"""The repository's conftest.py fails a run on a skip whose reason is not on its allow-list,
and prints the number of skips; an allowed skip passes."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(tmp_path: Path, reason: str) -> subprocess.CompletedProcess:
    shutil.copy(ROOT / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_one.py").write_text(
        "import pytest\n\n\ndef test_passes():\n    pass\n\n\n"
        f"def test_skips():\n    pytest.skip({reason!r})\n")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)


def test_an_unexpected_skip_fails_the_run(tmp_path):
    out = _run(tmp_path, "module foo is not installed")
    assert out.returncode == 1, out.stdout
    assert "skips: 1 (0 on the allow-list in conftest.py)" in out.stdout
    assert "UNEXPECTED SKIP" in out.stdout and "test_one.py::test_skips: module foo is not installed" in out.stdout


def test_an_allowed_skip_passes(tmp_path):
    out = _run(tmp_path, "the Hugging Face Hub is reachable here")
    assert out.returncode == 0, out.stdout
    assert "skips: 1 (1 on the allow-list in conftest.py)" in out.stdout
    assert out.stdout.strip().splitlines()[-1].startswith("1 passed, 1 skipped")


@pytest.mark.parametrize("reason", ["a", ""])
def test_reasons_are_compared_whole(tmp_path, reason):
    assert _run(tmp_path, reason).returncode == 1
