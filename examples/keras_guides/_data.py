"""Synthetic data for the guide-shaped scripts, and each rank's part of every global batch.

Each script runs as is in one process or under ``hvdkitrun -np N``. With the
same *global* batch, rank r takes rows r, r+N, r+2N, ... of every global
batch, so N ranks together see exactly the batches one process sees, and
the averaged gradients (and so the weights and printed numbers) equal one
process's.
"""

import numpy as np

import hvdkit  # hvdkit


def digits(n=512, shape=(28, 28, 1), classes=10, seed=0):
    """``n`` synthetic images whose class is a bright block's position: learnable, not trivial."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, classes, n).astype("int64")
    x = rng.random((n, *shape), dtype=np.float32) * 0.3
    for i, label in enumerate(y):
        row, col = divmod(int(label), 4)
        x[i, 2 + row * 7 : 8 + row * 7, 1 + col * 7 : 6 + col * 7] += 0.7
    return x, y


def mine(array):
    """This rank's rows of every global batch: rows r, r+N, ... (``len(array) / N`` rows)."""
    return array[hvdkit.rank() :: hvdkit.size()]


def per_rank(global_batch):
    """The batch each rank trains on, for a global batch that one process would train on."""
    if global_batch % hvdkit.size():
        raise SystemExit(f"global batch {global_batch} does not split over {hvdkit.size()} ranks")
    return global_batch // hvdkit.size()
