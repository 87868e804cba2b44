#!/usr/bin/env bash
# Set everything up and run the checks: ruff, then the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
# The dashboard's browser test drives Debian's chromium; install it when missing (as root,
# quietly). Without it that one test skips with the reason.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 \
  && [ "$(id -u)" = 0 ]; then
  export DEBIAN_FRONTEND=noninteractive
  { apt-get install -y -qq chromium || { apt-get update -qq && apt-get install -y -qq chromium; }; } \
    >/dev/null 2>&1 || echo "note: could not install chromium; the browser test will skip" >&2
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python -m pytest "$@"
