"""Put per-rank results back together in the order of the whole dataset.

After ``model.predict`` on each rank's shard, every rank holds the rows of
its own indices. :func:`unshard` gathers every rank's rows and indices and
returns, on every rank, the rows of the whole dataset in their original
order.
"""

from __future__ import annotations

import numpy as np

from .. import collectives
from ..errors import ShardingError

__all__ = ["unshard"]


def _gather_rows(values, where: np.ndarray, counts: np.ndarray, num_samples: int) -> np.ndarray:
    values = np.asarray(values)
    if values.ndim == 0:
        raise ShardingError(
            "unshard: got a scalar; pass this rank's results, one row per index "
            "(model.predict on exactly the rows of those indices)."
        )
    rows = collectives.allgather(values, name="hvdkit.unshard.rows")
    sent = collectives.allgather(np.array([values.shape[0]]), name="hvdkit.unshard.sizes")
    if not np.array_equal(sent, counts):  # the same verdict on every rank: none is left waiting
        bad = [
            f"rank {r}: {s} rows for {c} indices"
            for r, (s, c) in enumerate(zip(sent, counts, strict=True))
        ]
        raise ShardingError(
            f"unshard: results and indices differ in length ({'; '.join(bad)}); pass one row of "
            "results per index (model.predict on exactly the rows of those indices)."
        )
    out = np.empty((num_samples, *values.shape[1:]), dtype=values.dtype)
    out[where] = rows
    return out


def unshard(local, indices, num_samples: int | None = None):
    """Gather every rank's results and put them back in dataset order, on every rank.

    Args:
        local: this rank's results, one row per entry of ``indices`` (a numpy
            array, or a list/dict of them for a model with several outputs).
        indices: the dataset indices of this rank's rows, e.g. from
            :func:`hvdkit.data.shard_indices`. Shards may be uneven, and an
            index read twice (``mode="pad"``) keeps one of its equal rows.
        num_samples: the dataset length; ``None``: one more than the largest
            index of any rank. Every index below it must be on some rank.

    Returns:
        The same structure as ``local``, each array with ``num_samples`` rows.

    Raises:
        ShardingError: an index is outside ``[0, num_samples)``, some index is
            on no rank, or ``local`` has not one row per index.

    Example (2 ranks, 5 rows, ``mode="uneven"``: rank 0 reads ``[0, 2, 4]``,
    rank 1 ``[1, 3]``):
        >>> mine = hvdkit.data.shard_indices(5, hvdkit.size(), hvdkit.rank(), mode="uneven")
        >>> pred = hvdkit.data.unshard(model.predict(x[mine]), mine)
        >>> pred.shape[0]                                # on both ranks
        5
    """
    mine = np.asarray(indices, dtype=np.int64).reshape(-1)
    where = collectives.allgather(mine, name="hvdkit.unshard.indices")
    counts = collectives.allgather(np.array([len(mine)]), name="hvdkit.unshard.counts")
    total = int(where.max()) + 1 if num_samples is None and len(where) else num_samples or 0
    if len(where) and (where.min() < 0 or where.max() >= total):
        bad = where[(where < 0) | (where >= total)]
        raise ShardingError(
            f"unshard: indices {sorted(set(bad.tolist()))[:5]} are outside the dataset "
            f"[0, {total}); pass the indices each rank read and num_samples=len(dataset)."
        )
    missing = np.setdiff1d(np.arange(total), where)
    if len(missing):
        raise ShardingError(
            f"unshard: {len(missing)} of {total} rows are on no rank (first: "
            f"{missing[:5].tolist()}); every rank must pass its indices, and together they "
            "must cover the dataset (shard_indices with mode='uneven' or 'pad' does)."
        )
    if isinstance(local, dict):
        return {k: _gather_rows(v, where, counts, total) for k, v in local.items()}
    if isinstance(local, (list, tuple)):
        return type(local)(_gather_rows(v, where, counts, total) for v in local)
    return _gather_rows(local, where, counts, total)
