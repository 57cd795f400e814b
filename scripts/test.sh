#!/usr/bin/env bash
# The test suite: set up whatever is missing, lint, then run every test.
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/unit -x   # extra arguments go to pytest
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HVDKIT_SKIP_SMOKE="${HVDKIT_SKIP_SMOKE:-auto}" "$REPO/scripts/install.sh"
source "$REPO/scripts/_env.sh"
cd "$REPO"
echo "[test] ruff check + format --check"
ruff check .
ruff format --check .
echo "[test] pytest"
if (($#)); then
    exec python -m pytest "$@"
fi
exec python -m pytest tests -p no:cacheprovider --durations=40
