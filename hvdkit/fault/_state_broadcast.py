"""The training state from rank 0 to every rank: a restore's, a roll back's, a newcomer's.

:meth:`hvdkit.Checkpointer.restore` and the elastic roll back
(:class:`~hvdkit.fault._memory_commit.MemoryCommit`) send the same things in
the same two steps, so that a newcomer's ``restore()`` meets the survivors'
roll back:

1. :func:`header`: rank 0's header (JSON-able: the step, the sampler's
   position, or the error every rank must raise) goes to every rank, and
   every rank's list of variable dtypes and shapes to every rank, in one
   ``allgather_object``. Every rank sees the same lists, so ranks whose
   variables differ all raise the same :class:`ConfigurationError`, naming
   the first variable and rank that differ; none waits in the next step.
2. :func:`variables`: the values, packed: the variables of one dtype are
   flattened into one buffer (up to :data:`CHUNK_BYTES` each) and each buffer
   is one broadcast, after which every other rank assigns its pieces. A
   model's few hundred variables are a few collectives instead of one each
   (each eager collective waits for Horovod's next cycle and the others).

Values are copied, never computed: every rank holds rank 0's bits.

Example:
    >>> got = header({"ok": True, "state": state}, variables)   # on every rank
    >>> variables(variables)                                      # now rank 0's values
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import tensorflow as tf

from .. import collectives, runtime
from ..errors import ConfigurationError

__all__ = ["CHUNK_BYTES", "header", "signature", "variables"]

CHUNK_BYTES = 64 << 20  # one broadcast's buffer at most (a copy of it is made on each rank)


def signature(values: list) -> list[list]:
    """``[[dtype, shape], ...]`` of ``values``, in order (JSON-able; every rank compares them).

    >>> signature([tf.zeros([2, 3]), tf.zeros([], tf.int64)])
    [['float32', [2, 3]], ['int64', []]]
    """
    return [[dtype, shape] for dtype, shape in map(_dtype_shape, values)]


def _dtype_shape(v) -> tuple[str, list[int]]:
    """A variable's (or tensor's) dtype name and shape, without reading its value."""
    return tf.as_dtype(v.dtype).name, [int(d) for d in v.shape]


def header(root_header: dict, values: list) -> dict:
    """Rank 0's ``root_header`` on every rank, once every rank's variables match rank 0's.

    Raises:
        ConfigurationError: a rank's variables differ from rank 0's in
            number, dtype or shape (on every rank alike).
    """
    mine = signature(values)
    names = [_name(v) for v in values]  # for the message only: not compared
    sent = root_header if runtime.rank() == 0 else None
    gathered = collectives.allgather_object({"header": sent, "signature": mine, "names": names})
    got = gathered[0]["header"]
    if got.get("ok", True):  # an error rank 0 sends goes first
        _check_same(gathered)
    return got


def _name(v) -> str:
    return str(getattr(v, "path", None) or getattr(v, "name", None) or "?")


def _check_same(gathered: list[dict]) -> None:
    root = gathered[0]["signature"]
    for rank, item in enumerate(gathered[1:], start=1):
        other = item["signature"]
        if other == root:
            continue
        if len(other) != len(root):
            differ = f"{len(other)} variables against rank 0's {len(root)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(root, other, strict=True)) if a != b)
            differ = (
                f"variable {i} ({item['names'][i]}) is {other[i][0]} {other[i][1]} against "
                f"rank 0's {root[i][0]} {root[i][1]} ({gathered[0]['names'][i]})"
            )
        raise ConfigurationError(
            f"the state cannot go from rank 0 to rank {rank}: its {differ}. Every rank must "
            "build the same model and optimizer (the same layers in the same order) before "
            "restore()."
        )


def variables(values: list, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s values of ``values`` (in place), packed by dtype."""
    groups: dict[str, list[tuple[Any, list[int]]]] = defaultdict(list)
    for v in values:
        dtype, shape = _dtype_shape(v)
        groups[dtype].append((v, shape))
    receive = runtime.rank() != root_rank  # reads no value: what it sends is overwritten
    for dtype in sorted(groups):
        for k, chunk in enumerate(_chunks(groups[dtype], tf.as_dtype(dtype).size)):
            sizes = [math.prod(shape) for _, shape in chunk]
            if receive:
                flat = tf.zeros([sum(sizes)], dtype)
            else:
                flat = tf.concat([tf.reshape(tf.convert_to_tensor(v), [-1]) for v, _ in chunk], 0)
            out = collectives.broadcast(flat, root_rank, name=f"hvdkit.state.{dtype}.{k}")
            if receive:
                for (v, shape), piece in zip(chunk, tf.split(out, sizes), strict=True):
                    v.assign(tf.reshape(piece, shape))


def _chunks(group: list[tuple[Any, list[int]]], itemsize: int) -> list[list]:
    """``(variable, shape)`` pairs of one dtype (``itemsize`` bytes an element) in
    consecutive runs of at most :data:`CHUNK_BYTES` (a bigger variable alone)."""
    chunks, current, size = [], [], 0
    for v, shape in group:
        nbytes = math.prod(shape) * itemsize
        if current and size + nbytes > CHUNK_BYTES:
            chunks.append(current)
            current, size = [], 0
        current.append((v, shape))
        size += nbytes
    if current:
        chunks.append(current)
    return chunks
