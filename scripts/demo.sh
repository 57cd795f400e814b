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
echo "[demo] hvdkitrun -np 2 ${transport[*]:+${transport[*]} }python examples/train_digits.py $*"
exec hvdkitrun -np 2 "${transport[@]}" python "$REPO/examples/train_digits.py" "$@"
