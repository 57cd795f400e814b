# Sourced by run_scheduler.sh / run_workers.sh: sets HVDKITRUN without installing anything.
# Order: $HVDKITRUN if set, hvdkitrun on PATH, then this checkout's .venv.
if [[ -z "${HVDKITRUN:-}" ]]; then
    if command -v hvdkitrun >/dev/null 2>&1; then
        HVDKITRUN="$(command -v hvdkitrun)"
    elif [[ -x "$REPO/.venv/bin/hvdkitrun" ]]; then
        HVDKITRUN="$REPO/.venv/bin/hvdkitrun"
    else
        echo "hvdkitrun not found (not on PATH, not in $REPO/.venv): install hvdkit on this" \
             "machine first with $REPO/scripts/install.sh, or set HVDKITRUN=/path/to/hvdkitrun" >&2
        exit 2
    fi
fi
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
# The Python hvdkitrun runs with (its #! line).
hvdkit_python() {
    local py
    py="$(head -1 "$HVDKITRUN" | sed -n 's/^#![[:space:]]*//p')"
    ${py:-python3} "$@"
}
if [[ $(id -u) -eq 0 ]]; then
    # Open MPI refuses to start as root without its two variables; their one home
    # is hvdkit/launch/transport.py (MPI_AS_ROOT_ENV).
    eval "$(hvdkit_python -m hvdkit.launch.transport --root-env)"
fi
# "python train.py" in the workers' command means the Python hvdkitrun belongs to.
PATH="$(dirname "$HVDKITRUN"):$PATH"
export PATH
# The scheduler's default port lives in hvdkit.config (one home); ask the Python
# hvdkitrun runs with (its #! line) only when no port is set.
default_sched_port() {
    hvdkit_python -c 'from hvdkit.config import DEFAULT_SCHED_PORT; print(DEFAULT_SCHED_PORT)'
}
