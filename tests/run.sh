#!/usr/bin/env bash
# The README's test command and CI's (.ci/run calls it): from a fresh clone on Debian or
# Ubuntu, installs what the tests need and runs them. Arguments go to pytest, e.g.
#   bash tests/run.sh -m "not slow"      # the fast tier
#   bash tests/run.sh tests/test_cli.py  # one file
# The run fails on a failed test and on a skip whose reason is not on the commented
# allow-list in conftest.py; pytest prints "skips: N (...)" just before its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
# tests/test_report_browser.py opens the report page in Debian's headless Chromium.
# `python3 -m venv` needs Debian's python3-venv.
missing=()
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
[ -x .venv/bin/python ] || python3 -c "import ensurepip" 2>/dev/null || missing+=(python3-venv)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=(); else sudo=(sudo); fi
  "${sudo[@]}" apt-get update -q
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
[ -x .venv/bin/python ] || python3 -m venv .venv
.venv/bin/pip install -q -e ".[pipeline,train,dev]"
exec .venv/bin/python -m pytest -q "$@"
