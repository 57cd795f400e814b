#!/usr/bin/env bash
# Set up everything hvdkit needs, idempotently: Debian packages, .venv,
# TensorFlow, hvdkit itself, Horovod 0.28.1 built from source by
# `python -m hvdkit install-horovod` (cached wheel).
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
# MPI and the headers TF's XLA headers include; a C++ toolchain and cmake for
# the Horovod build; Python 3.11 with venv; iproute2 for the namespace tests;
# OpenSSH's server and client for the test of hvdkitrun -H between two
# namespaces (the test starts its own sshd in each; no system sshd is started);
# Slurm and MUNGE for tests/test_slurm.py (it starts its own munged, slurmctld and
# slurmd in namespaces; no system service is started); Java 17 for the Spark standalone
# cluster of tests/test_spark.py (pyspark and ray come with hvdkit's [test] extra).
APT_PACKAGES=(openmpi-bin libopenmpi-dev libhighwayhash-dev libfarmhash-dev
              g++ make cmake python3.11 python3.11-venv python3.11-dev iproute2
              openssh-server openssh-client slurm-wlm munge openjdk-17-jre-headless patch)

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
newer_than_all() {  # the stamp is newer than each file given (a changed Horovod patch: rebuild)
    local f
    for f in "${@:2}"; do [[ "$1" -nt "$f" ]] || return 1; done
}
if [[ -z "${HVDKIT_FORCE_INSTALL:-}" && -f "$STAMP" && -x "$VENV/bin/python" ]] && ((!changed)) \
      && newer_than_all "$STAMP" "$REPO/setup.py" "$REPO/scripts/install.sh" "$REPO"/hvdkit/patches/*; then
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

# --- 4. hvdkit itself (it no longer requires Horovod: pip never builds one) ---
if ! "$PY" -c "import hvdkit, pytest, xdist, hypothesis, sklearn, ruff, pyspark, ray, pyarrow" 2>/dev/null \
   || [[ "$REPO/setup.py" -nt "$VENV/.hvdkit-installed" ]]; then
    log "installing hvdkit (editable) with test extras"
    "${PIP[@]}" --no-build-isolation -e "$REPO[test]"
    touch "$VENV/.hvdkit-installed"
    changed=1
fi

# --- 5. Horovod 0.28.1 for the installed TF: the same command users run -------
# python -m hvdkit install-horovod checks the build's prerequisites, adds the header
# fixes this TF needs, caches the wheel per (python, TF) in ~/.cache/hvdkit/wheels
# (HVDKIT_CACHE_DIR), and returns at once when the right Horovod is installed.
hvd_out="$(mktemp)"
set +e
"$PY" -m hvdkit install-horovod | tee "$hvd_out"
hvd_rc=${PIPESTATUS[0]}
set -e
grep -q "is installed, built for" "$hvd_out" || changed=1
rm -f "$hvd_out"
((hvd_rc == 0)) || exit "$hvd_rc"

# --- 6. smoke check: 2 processes over Gloo and over MPI ----------------------
case "${HVDKIT_SKIP_SMOKE:-0}" in
    1) ;;
    auto) if ((changed)); then "$REPO/scripts/smoke.sh"; else log "already set up (smoke check: scripts/smoke.sh)"; fi ;;
    *) "$REPO/scripts/smoke.sh" ;;
esac
touch "$STAMP"
log "ready: $VENV"
