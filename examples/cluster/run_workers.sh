#!/usr/bin/env bash
# Start NUM_LOCAL workers of a multi-node job on this machine and wait for them.
#
#   HVDKIT_SCHED_HOST=10.0.0.1 HVDKIT_JOB_TOKEN=... \
#       examples/cluster/run_workers.sh 4 python train.py
#
# Each worker's output is prefixed with its rank; with HVDKIT_LOG_DIR set it
# also goes to $HVDKIT_LOG_DIR/rank.N/{stdout,stderr}. Exits non-zero if any
# worker failed; Ctrl-C or SIGTERM stops all of them. On the scheduler's
# machine the token is read from the file run_scheduler.sh wrote, if
# HVDKIT_JOB_TOKEN is not set.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
if (($# < 2)) || ! [[ "$1" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NUM_LOCAL program [args...]   (NUM_LOCAL: workers on this machine, >= 1)" >&2
    exit 2
fi
# Starting a node installs nothing: run scripts/install.sh once per machine beforehand.
source "$REPO/examples/cluster/_find_hvdkitrun.sh"
num_local="$1"; shift
port="${HVDKIT_SCHED_PORT:-${MS_SCHED_PORT:-$(default_sched_port)}}"
token_file="${HVDKIT_TOKEN_FILE:-$HOME/.hvdkit/job-$port.token}"
if [[ -z "${HVDKIT_JOB_TOKEN:-}" ]]; then
    for _ in $(seq 50); do [[ -s "$token_file" ]] && break; sleep 0.2; done
    if [[ ! -s "$token_file" ]]; then
        echo "no HVDKIT_JOB_TOKEN and no token file $token_file: set HVDKIT_JOB_TOKEN to the" \
             "token the scheduler printed" >&2
        exit 2
    fi
    HVDKIT_JOB_TOKEN="$(cat "$token_file")"
    export HVDKIT_JOB_TOKEN
fi
export HVDKIT_SCHED_PORT="$port"
pids=()
# Background jobs of a script ignore SIGINT: forward it (and TERM/HUP) ourselves.
trap 'kill -TERM "${pids[@]}" 2>/dev/null; wait; exit 130' INT TERM HUP
for ((i = 0; i < num_local; i++)); do
    HVDKIT_ROLE=worker "$HVDKITRUN" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
    wait "$pid" || status=1
done
exit "$status"
