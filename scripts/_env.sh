# Sourced by the scripts: puts .venv first on PATH and quiets TensorFlow.
_HVDKIT_REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PATH="$_HVDKIT_REPO/.venv/bin:$PATH"
export TF_CPP_MIN_LOG_LEVEL="${TF_CPP_MIN_LOG_LEVEL:-2}"
if [[ $(id -u) -eq 0 && -x "$_HVDKIT_REPO/.venv/bin/python" ]]; then
    # Open MPI refuses to start as root without its two variables (CI runs as root);
    # their one home is hvdkit/launch/transport.py (MPI_AS_ROOT_ENV).
    eval "$("$_HVDKIT_REPO/.venv/bin/python" -m hvdkit.launch.transport --root-env)"
fi
