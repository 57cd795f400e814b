# Sourced by the scripts: puts .venv first on PATH and quiets TensorFlow.
_HVDKIT_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$_HVDKIT_REPO/.venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
if [[ $(id -u) -eq 0 ]]; then
    # Open MPI refuses to start as root without these (CI runs as root).
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi
