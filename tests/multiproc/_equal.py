"""What the 2-rank equivalence scripts compare: one process on the global batch, and the ranks.

rows = my_rows(64, global_batch=16, rank=r, size=n)   # rank r's half of every batch
assert_close(weights(model), weights(reference))      # against one process
assert_same_on_all_ranks(weights(model), "fit")       # bit-identical across ranks
"""

import numpy as np

import hvdkit as hvd


def my_rows(count: int, global_batch: int, rank: int, size: int) -> np.ndarray:
    """Row indices of ``rank``'s share of every global batch, in order."""
    part = global_batch // size
    return np.concatenate(
        [np.arange(b + rank * part, b + (rank + 1) * part) for b in range(0, count, global_batch)]
    )


def weights(model) -> list:
    return [w.numpy() for w in model.weights]


def assert_close(got, want, rtol=1e-5, atol=1e-6) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol)


def assert_same_on_all_ranks(ws, label: str) -> None:
    flat = np.concatenate([np.asarray(w, np.float64).ravel() for w in ws])
    both = hvd.allgather(flat[None])
    if not np.array_equal(both[0], both[1]):
        raise AssertionError(
            f"{label}: weights differ across ranks, max |diff| {np.abs(both[0] - both[1]).max()}"
        )
