#!/usr/bin/env bash
# 2-process smoke check of the Horovod build: allreduce over Gloo and MPI.
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$REPO/scripts/_env.sh"
for transport in gloo mpi; do
    out="$(timeout 120 horovodrun -np 2 --$transport "$REPO/.venv/bin/python" -c '
import os, horovod.tensorflow as hvd, tensorflow as tf
hvd.init()
s = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum)
os.write(1, f"SMOKE {hvd.rank()} {float(s[0])}\n".encode())  # one write: one mpirun line
' 2>&1)" || { echo "$out" >&2; echo "[smoke] $transport: FAILED" >&2; exit 1; }
    n_ok="$(grep -c 'SMOKE [01] 3.0' <<<"$out" || true)"
    if [[ "$n_ok" != "2" ]]; then
        echo "$out" >&2; echo "[smoke] $transport: wrong result" >&2; exit 1
    fi
    echo "[smoke] horovodrun -np 2 --$transport: allreduce OK (1+2=3 on both ranks)"
done
