#!/usr/bin/env bash
# Start NUM_LOCAL workers of a multi-node job on this machine and wait for them.
#
#   HVDKIT_SCHED_HOST=10.0.0.1 HVDKIT_JOB_TOKEN=... \
#       examples/cluster/run_workers.sh 4 python train.py
#
# Each worker's output is prefixed with its rank; with HVDKIT_LOG_DIR set it
# also goes to $HVDKIT_LOG_DIR/rank.N/{stdout,stderr}. Exits with the first
# non-zero status of a worker (75: the job was preempted and can resume);
# SIGTERM, Ctrl-C and SIGHUP are passed on to the workers. On the scheduler's
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
# A signal is passed on to every worker, which passes it on to its rank: on
# SIGTERM the job stops at a common step with a checkpoint (exit 75, see
# docs/fault-tolerance.md), so keep waiting for the workers to finish.
for sig in TERM INT HUP; do
    trap "kill -$sig \${pids[*]} 2>/dev/null || true" "$sig"
done
for ((i = 0; i < num_local; i++)); do
    HVDKIT_ROLE=worker "$HVDKITRUN" "$@" &
    pids+=($!)
done
status=0  # the first worker's non-zero status (75: preempted, resumable)
for pid in "${pids[@]}"; do
    while true; do
        wait "$pid" && rc=0 || rc=$?
        # a trapped signal ends `wait` early (status > 128) while the worker runs on
        if ((rc > 128)) && kill -0 "$pid" 2>/dev/null; then continue; fi
        break
    done
    if ((rc != 0 && status == 0)); then status=$rc; fi
done
exit "$status"
