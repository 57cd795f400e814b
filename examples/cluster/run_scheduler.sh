#!/usr/bin/env bash
# Start the scheduler of a multi-node job (no SSH needed), in the foreground.
#
#   HVDKIT_WORKER_NUM=8 HVDKIT_SCHED_HOST=10.0.0.1 examples/cluster/run_scheduler.sh
#
# HVDKIT_SCHED_HOST is the address the scheduler listens on and workers dial
# (default 127.0.0.1: one machine only). Without HVDKIT_JOB_TOKEN a token is
# generated and written to $HVDKIT_TOKEN_FILE (default
# ~/.hvdkit/job-<port>.token, mode 600, removed when the scheduler ends)
# where run_workers.sh on the same machine finds it. MS_WORKER_NUM / MS_SCHED_HOST / MS_SCHED_PORT also work.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
# Starting a node installs nothing: run scripts/install.sh once per machine beforehand.
source "$REPO/examples/cluster/_find_hvdkitrun.sh"
port="${HVDKIT_SCHED_PORT:-${MS_SCHED_PORT:-$(default_sched_port)}}"
if [[ -z "${HVDKIT_JOB_TOKEN:-}" ]]; then
    mkdir -p "$HOME/.hvdkit" && chmod 700 "$HOME/.hvdkit"
    export HVDKIT_TOKEN_FILE="${HVDKIT_TOKEN_FILE:-$HOME/.hvdkit/job-$port.token}"
fi
export HVDKIT_SCHED_PORT="$port"
HVDKIT_ROLE=scheduler exec "$HVDKITRUN"
