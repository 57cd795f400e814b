"""The job ``hvdkit doctor`` runs under ``hvdkitrun -np 2``: one allreduce, one line per rank.

Each rank adds ``rank + 1``; with 2 ranks both must print ``sum=3.0``.
"""

import os

import tensorflow as tf

import hvdkit
from hvdkit.tools.doctor import PROBE_MARK

if __name__ == "__main__":
    hvdkit.init()
    total = hvdkit.allreduce(tf.constant([float(hvdkit.rank() + 1)]), op=hvdkit.Sum)
    line = f"{PROBE_MARK} rank={hvdkit.rank()} size={hvdkit.size()} sum={float(total[0])}\n"
    os.write(1, line.encode())  # one write: one relayed line under either transport
