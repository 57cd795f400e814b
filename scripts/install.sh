#!/usr/bin/env bash
# Set up everything hvdkit needs, idempotently: Debian packages, .venv,
# TensorFlow, Horovod 0.28.1 built from source (cached wheel), hvdkit itself.
# Safe to re-run; a second run on the same machine takes seconds.
#
#   scripts/install.sh            # full setup + 2-process smoke check
#   HVDKIT_SKIP_SMOKE=1 scripts/install.sh      # never run the smoke check
#   HVDKIT_SKIP_SMOKE=auto scripts/install.sh   # only if this run installed something
#   HVDKIT_FORCE_INSTALL=1 scripts/install.sh   # re-check every step even if set up
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$REPO/.venv"
PY_BIN="${HVDKIT_PYTHON:-python3.11}"

TF_VERSION="2.21.0"
KERAS_VERSION="3.15.1"  # the tested one; inside setup.py's range (tests/unit/test_pins.py)
HOROVOD_VERSION="0.28.1"
# MPI and the headers TF's XLA headers include; a C++ toolchain and cmake for
# the Horovod build; Python 3.11 with venv; iproute2 for the namespace tests;
# OpenSSH's server and client for the test of hvdkitrun -H between two
# namespaces (the test starts its own sshd in each; no system sshd is started);
# Slurm and MUNGE for tests/test_slurm.py (it starts its own munged, slurmctld and
# slurmd in namespaces; no system service is started).
APT_PACKAGES=(openmpi-bin libopenmpi-dev libhighwayhash-dev libfarmhash-dev
              g++ make cmake python3.11 python3.11-venv python3.11-dev iproute2
              openssh-server openssh-client slurm-wlm munge)

log() { printf '[install] %s\n' "$*"; }
changed=0

# --- 1. Debian packages ------------------------------------------------------
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
    if [[ $(id -u) -eq 0 ]]; then
        log "installing Debian packages: ${missing[*]}"
        export DEBIAN_FRONTEND=noninteractive
        apt-get update -qq
        # Install without starting services (Debian's policy-rc.d, exit 101 = deny):
        # openssh-server would otherwise start a system sshd on port 22, slurm-wlm
        # and munge their daemons.
        policy=/usr/sbin/policy-rc.d
        own_policy=0
        if [[ ! -e "$policy" ]]; then
            printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && own_policy=1
        fi
        rc=0
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null || rc=$?
        if ((own_policy)); then rm -f "$policy"; fi
        ((rc == 0)) || exit "$rc"
        changed=1
    else
        echo "hvdkit needs these Debian packages: ${missing[*]}" >&2
        echo "Run:  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
        echo "then re-run $0" >&2
        exit 1
    fi
fi

# --- fast path: nothing changed since the last complete run --------------------
STAMP="$VENV/.hvdkit-ready"
if [[ -z "${HVDKIT_FORCE_INSTALL:-}" && -f "$STAMP" && "$STAMP" -nt "$REPO/setup.py" \
      && "$STAMP" -nt "$REPO/scripts/install.sh" && -x "$VENV/bin/python" ]] && ((!changed)); then
    log "already set up (HVDKIT_FORCE_INSTALL=1 re-checks everything; smoke check: scripts/smoke.sh)"
    [[ "${HVDKIT_SKIP_SMOKE:-0}" == "0" ]] && "$REPO/scripts/smoke.sh"
    exit 0
fi

# --- 2. virtualenv -----------------------------------------------------------
if ! command -v "$PY_BIN" >/dev/null 2>&1; then
    echo "hvdkit needs Python 3.11 ('$PY_BIN' not found). Set HVDKIT_PYTHON to a python3.11 binary." >&2
    exit 1
fi
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    "$PY_BIN" -m venv "$VENV"
    changed=1
    "$VENV/bin/pip" install -q --upgrade pip wheel setuptools
fi
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# --- 3. TensorFlow and friends (before Horovod: its build imports TF) -------
if ! "$PY" -c "import tensorflow as tf, sys; sys.exit(tf.__version__ != '$TF_VERSION')" 2>/dev/null; then
    tf_pkg="tensorflow-cpu"
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        tf_pkg="tensorflow[and-cuda]"   # not verified on a GPU yet, see docs/limits.md
    fi
    log "installing $tf_pkg==$TF_VERSION keras==$KERAS_VERSION"
    "${PIP[@]}" "$tf_pkg==$TF_VERSION" "keras==$KERAS_VERSION" numpy mpi4py cloudpickle psutil
    changed=1
fi

# --- 4. Horovod, built once per (python, TF) and cached outside the repo -----
PY_TAG="$("$PY" -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')"
CACHE="${HVDKIT_CACHE_DIR:-${XDG_CACHE_HOME:-${HOME:-/root}/.cache}/hvdkit}/wheels/horovod-$HOROVOD_VERSION-$PY_TAG-tf$TF_VERSION"
horovod_ok() {
    "$PY" - <<'PYEOF' 2>/dev/null
import horovod.tensorflow as hvd
import sys
sys.exit(0 if (hvd.gloo_built() and hvd.mpi_built()) else 1)
PYEOF
}
if ! horovod_ok; then
    wheel="$(ls "$CACHE"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)"
    if [[ -z "$wheel" ]]; then
        log "building Horovod $HOROVOD_VERSION against TF $TF_VERSION (about 3-5 minutes)"
        mkdir -p "$CACHE"
        shim="$(mktemp -d)"
        # TF 2.21 moved xla_builder.h; Horovod 0.28.1 still includes the old path.
        mkdir -p "$shim/tensorflow/compiler/xla/client"
        echo '#include "xla/hlo/builder/xla_builder.h"' > "$shim/tensorflow/compiler/xla/client/xla_builder.h"
        CPLUS_INCLUDE_PATH="$shim" CMAKE_POLICY_VERSION_MINIMUM=3.5 \
        HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
        HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 MAKEFLAGS=-j2 \
            "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir \
            "horovod==$HOROVOD_VERSION" -w "$CACHE"
        rm -rf "$shim"
        wheel="$(ls "$CACHE"/horovod-"$HOROVOD_VERSION"-*.whl | head -n1)"
    else
        log "using cached Horovod wheel $wheel"
    fi
    "${PIP[@]}" "$wheel"
    changed=1
    horovod_ok || { echo "Horovod installed but lacks Gloo or MPI support; delete $CACHE and re-run." >&2; exit 1; }
fi

# --- 5. hvdkit itself --------------------------------------------------------
if ! "$PY" -c "import hvdkit, pytest, xdist, hypothesis, sklearn, ruff" 2>/dev/null \
   || [[ "$REPO/setup.py" -nt "$VENV/.hvdkit-installed" ]]; then
    log "installing hvdkit (editable) with test extras"
    "${PIP[@]}" --no-build-isolation -e "$REPO[test]"
    touch "$VENV/.hvdkit-installed"
    changed=1
fi

# --- 6. smoke check: 2 processes over Gloo and over MPI ----------------------
case "${HVDKIT_SKIP_SMOKE:-0}" in
    1) ;;
    auto) if ((changed)); then "$REPO/scripts/smoke.sh"; else log "already set up (smoke check: scripts/smoke.sh)"; fi ;;
    *) "$REPO/scripts/smoke.sh" ;;
esac
touch "$STAMP"
log "ready: $VENV"
