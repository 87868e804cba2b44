#!/usr/bin/env bash
# Set up the project in ./.venv on a fresh machine (Python 3.11+ with venv and pip).
# Usage: bash scripts/setup.sh [EXTRAS]   default "lab,app" (the demo and the dashboard);
# "dev" for the tests, "" for the core only.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1-lab,app}"
py="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$py" -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install -q --disable-pip-version-check -e "$spec"
