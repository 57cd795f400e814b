#!/usr/bin/env bash
# The test suite: set up whatever is missing, lint, then run every test.
#   scripts/test.sh                 # everything
#   scripts/test.sh tests/unit -x   # extra arguments go to pytest
#   scripts/test.sh --quick         # inner loop: the one-process tests and one
#                                   # 2-rank hvdkitrun smoke (the full run is the CI gate)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The whole run skips install.sh's 2-process smoke check (14 s): its tests run such
# jobs over both transports. --quick keeps it after an install that changed something
# (its own one job is over Gloo only).
smoke=1
if [[ "${1:-}" == "--quick" ]]; then smoke=auto; fi
HVDKIT_SKIP_SMOKE="${HVDKIT_SKIP_SMOKE:-$smoke}" "$REPO/scripts/install.sh"
source "$REPO/scripts/_env.sh"
cd "$REPO"
echo "[test] ruff check + format --check"
ruff check .
ruff format --check .
echo "[test] pytest"
if [[ "${1:-}" == "--quick" ]]; then
    shift
    exec python -m pytest tests/unit tests/test_launch_mp.py::test_hvdkitrun_prefixes_lines \
        -p no:cacheprovider -n 2 --dist loadfile "$@"
fi
if (($#)); then
    exec python -m pytest "$@"
fi
# One pytest worker per core plus one, each running one test file at a time (a
# file's 2-rank job is shared by its tests). With 2 workers on 2 cores the
# processes it launched used 1720 CPU seconds in a 1829 s run (half the cores:
# waits), so a third keeps the cores busy; a fourth was measured not to help:
# 95 % of both cores busy and 25:55 for the suite (performance-record.md).
# At most 8 (a file's job takes up to about 3 GB of memory).
# HVDKIT_TEST_WORKERS=N sets the number; 0 runs everything in this process.
# A pytest worker that dies (a test must never end its runner) fails the run at
# once: xdist's replacement worker was seen to leave the run waiting for ever.
cores="$(nproc)"
workers="${HVDKIT_TEST_WORKERS:-$((cores < 8 ? cores + 1 : 8))}"
dist=()
# Files go out in collection order: the longest first (tests/conftest.py).
if [[ "$workers" != 0 ]]; then
    dist=(-n "$workers" --dist loadfile --no-loadscope-reorder --max-worker-restart 0)
fi
exec python -m pytest tests -p no:cacheprovider --durations=40 "${dist[@]}"
