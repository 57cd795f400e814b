#!/usr/bin/env bash
# The main job: set up whatever is missing, then train on 2 processes.
#   scripts/demo.sh                 # 2 processes, hvdkitrun's default transport
#   HVDKIT_DEMO_TRANSPORT=gloo scripts/demo.sh   # or mpi: force one
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
HVDKIT_SKIP_SMOKE="${HVDKIT_SKIP_SMOKE:-auto}" "$REPO/scripts/install.sh"
source "$REPO/scripts/_env.sh"
transport=()
if [[ -n "${HVDKIT_DEMO_TRANSPORT:-}" ]]; then transport=("--$HVDKIT_DEMO_TRANSPORT"); fi
# What this environment has (versions, Horovod's build, mpirun), without the 2-process jobs
hvdkit doctor --no-run || { echo "[demo] fix what hvdkit doctor names above, then run $0 again" >&2; exit 1; }
echo "[demo] hvdkitrun -np 2 --check-weights ${transport[*]:+${transport[*]} }python examples/train_digits.py $*"
hvdkitrun -np 2 --check-weights "${transport[@]}" python "$REPO/examples/train_digits.py" "$@" || {
    rc=$?
    echo "[demo] training failed (exit $rc); hvdkit doctor tries a 2-process allreduce per transport:" >&2
    hvdkit doctor >&2 || true
    exit "$rc"
}
