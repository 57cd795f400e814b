"""Collective operations for ``tf.Tensor``, ``tf.Variable`` and numpy arrays.

Every function works eagerly and inside ``tf.function``; numpy in gives numpy
out. In a job of size 1 (no launcher) each is the identity. The Horovod names
and semantics are kept (``allreduce(..., op=Average)``, ``alltoall`` returning
``(tensor, received_splits)`` when ``splits`` is given), so Horovod code only
changes its import.

Shapes, with ``S = size()``:

=====================  ====================  ====================================
function               input on each rank    output on each rank
=====================  ====================  ====================================
allreduce              ``[d0, ...]``         ``[d0, ...]`` (same on all ranks)
allgather              ``[n_r, ...]``        ``[sum_r n_r, ...]`` in rank order
broadcast              ``[d0, ...]``         root's tensor
reducescatter          ``[d0, ...]``         ``[d0/S (+1 on the first d0%S ranks), ...]``
alltoall               ``[sum(splits), ...]`` rows sent to this rank, in rank order
neighbor_exchange      one tensor per peer   one tensor per ``recv_from`` entry
=====================  ====================  ====================================
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from . import _progress, runtime
from .backends import ReduceOp
from .errors import CollectiveError, CollectiveMismatchError, ConfigurationError

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "broadcast",
    "broadcast_variables",
    "reducescatter",
    "alltoall",
    "neighbor_exchange",
    "broadcast_object",
    "allgather_object",
]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_eager_call_ids = itertools.count()


# --------------------------------------------------------------------------- helpers
def _check_op(op: Any, allowed: Sequence[ReduceOp] = tuple(ReduceOp), what: str = "allreduce"):
    if op not in allowed:
        names = ", ".join(f"hvdkit.{o.name.title()}" for o in allowed)
        raise ConfigurationError(f"{what} does not support op={op!r}; use one of {names}.")


def _as_tensor(value: Any) -> tuple[tf.Tensor, bool]:
    """Returns the value as a tensor and whether the caller gave numpy/Python."""
    # tf.is_tensor also covers keras.Variable, which is not a tf.Variable.
    if tf.is_tensor(value) or isinstance(value, tf.Variable):
        return tf.convert_to_tensor(value), False
    return tf.convert_to_tensor(np.asarray(value)), True


def _describe(tensor: tf.Tensor) -> str:
    return f"shape {tensor.shape.as_list()} dtype {tensor.dtype.name}"


def _check_root(root_rank: int, what: str) -> None:
    n = runtime.size()
    if not isinstance(root_rank, (int, np.integer)) or not 0 <= root_rank < n:
        raise ConfigurationError(
            f"{what}: root_rank={root_rank!r} is outside the job's ranks [0, {n}); "
            f"pass a rank between 0 and {n - 1}."
        )


def _run(what: str, name: str | None, tensor_info: str, fn):
    """Call a backend collective and turn Horovod's errors into hvdkit's.

    Only eager calls can be translated: inside ``tf.function`` the error is
    raised by TensorFlow when the function runs, with Horovod's message.
    """
    if not tf.executing_eagerly():
        return fn()
    label = repr(name) if name else f"#{next(_eager_call_ids)} (unnamed; pass name= to label it)"
    waiting = _progress.enter(f"{what} {label}")  # the launcher names it if it never returns
    try:
        return fn()
    except tf.errors.OpError as exc:
        detail = exc.message.split("}}")[-1].strip()
        if "Mismatched" in detail:
            # Horovod reports the error on every rank and stays usable, so all
            # ranks can exchange what they passed and name it in the message.
            seen = runtime.backend().allgather_object(tensor_info)
            per_rank = "; ".join(f"rank {r}: {info}" for r, info in enumerate(seen))
            raise CollectiveMismatchError(
                f"{what} of tensor {label} failed: ranks passed incompatible tensors "
                f"({per_rank}). Horovod reports: {detail}. Make every rank call {what} "
                "with the same dtype and shape (allgather/alltoall: the same trailing "
                "dimensions)."
            ) from None
        here = f"rank {runtime.rank()} passed {tensor_info}"
        raise CollectiveError(f"{what} of tensor {label} failed ({here}): {detail}") from exc
    finally:
        _progress.leave(waiting)


def _out(tensor: tf.Tensor, as_numpy: bool):
    return np.asarray(tensor.numpy()) if as_numpy else tensor


# --------------------------------------------------------------------------- tensors
def allreduce(tensor, op: ReduceOp = Average, name: str | None = None):
    """Reduce ``tensor`` over all ranks; every rank gets the result.

    Args:
        tensor: ``tf.Tensor``, ``tf.Variable`` or numpy array; the same shape
            and dtype on every rank.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max`` or ``Product``.
            ``Average`` of an integer tensor rounds toward zero, as Horovod.
        name: Label used in error messages and by Horovod to match the call
            across ranks.

    Returns:
        Same shape and dtype as ``tensor`` (numpy if numpy was given).

    Raises:
        CollectiveMismatchError: ranks passed different shapes or dtypes.

    Example:
        >>> hvdkit.allreduce(np.array([hvdkit.rank() + 1.0]), op=hvdkit.Sum)
        array([3.])   # on both ranks of a 2-process job
    """
    _check_op(op)
    t, as_numpy = _as_tensor(tensor)
    out = _run("allreduce", name, _describe(t), lambda: runtime.backend().allreduce(t, op, name))
    return _out(out, as_numpy)


def grouped_allreduce(tensors: Sequence, op: ReduceOp = Average, name: str | None = None) -> list:
    """Allreduce several tensors in one fused operation (one round of messages).

    Args:
        tensors: list of tensors/arrays; each may have its own shape and dtype.
        op: as in :func:`allreduce`.

    Returns:
        List of reduced tensors, in input order.

    Example:
        >>> w, b = hvdkit.grouped_allreduce([grad_w, grad_b])
    """
    _check_op(op, what="grouped_allreduce")
    converted = [_as_tensor(t) for t in tensors]
    if not converted:
        return []
    ts = [t for t, _ in converted]
    info = "; ".join(_describe(t) for t in ts)
    outs = _run(
        "grouped_allreduce", name, info, lambda: runtime.backend().grouped_allreduce(ts, op, name)
    )
    return [_out(o, as_np) for o, (_, as_np) in zip(outs, converted, strict=True)]


def allgather(tensor, name: str | None = None):
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match.

    Example:
        >>> hvdkit.allgather(np.full([hvdkit.rank() + 1, 2], hvdkit.rank()))
        array([[0, 0], [1, 1], [1, 1]])   # shape [3, 2] on both ranks of 2
    """
    t, as_numpy = _as_tensor(tensor)
    if t.shape.rank == 0:
        t = tf.reshape(t, [1])
    out = _run("allgather", name, _describe(t), lambda: runtime.backend().allgather(t, name))
    return _out(out, as_numpy)


def broadcast(tensor, root_rank: int = 0, name: str | None = None):
    """Every rank receives ``root_rank``'s ``tensor`` (same shape/dtype on all ranks).

    Example:
        >>> hvdkit.broadcast(np.array([hvdkit.rank()]), root_rank=1)
        array([1])   # on every rank
    """
    _check_root(root_rank, "broadcast")
    t, as_numpy = _as_tensor(tensor)
    out = _run(
        "broadcast", name, _describe(t), lambda: runtime.backend().broadcast(t, root_rank, name)
    )
    return _out(out, as_numpy)


def broadcast_variables(variables: Sequence[tf.Variable], root_rank: int = 0) -> None:
    """Overwrite ``variables`` in place with their values on ``root_rank``.

    Args:
        variables: ``tf.Variable``/``keras.Variable`` objects, in the same
            order on every rank (e.g. ``model.variables``).

    Example:
        >>> hvdkit.broadcast_variables(model.variables, root_rank=0)
    """
    _check_root(root_rank, "broadcast_variables")
    for i, var in enumerate(variables):
        t = tf.convert_to_tensor(var)
        label = f"broadcast_variables[{i}] {getattr(var, 'path', getattr(var, 'name', ''))}"
        out = _run(
            "broadcast",
            label,
            _describe(t),
            lambda t=t: runtime.backend().broadcast(t, root_rank, None),
        )
        var.assign(out)


def reducescatter(tensor, op: ReduceOp = Average, name: str | None = None):
    """Reduce over ranks, then give each rank one block of rows of the result.

    With ``d0`` rows and ``S`` ranks, rank ``r`` gets ``d0 // S`` rows, plus one
    more if ``r < d0 % S``, in rank order (Horovod's split).

    Example (2 ranks, Sum):
        rank 0 has ``[[1], [2], [3]]``, rank 1 has ``[[10], [20], [30]]``
        → rank 0 gets ``[[11], [22]]``, rank 1 gets ``[[33]]``.
    """
    _check_op(op, (Average, Sum), "reducescatter")
    t, as_numpy = _as_tensor(tensor)
    if t.shape.rank == 0:
        raise ConfigurationError(
            "reducescatter needs a tensor with at least one dimension to split; got a "
            "scalar. Reshape it to [1] or use allreduce."
        )
    out = _run(
        "reducescatter", name, _describe(t), lambda: runtime.backend().reducescatter(t, op, name)
    )
    return _out(out, as_numpy)


def alltoall(tensor, splits=None, name: str | None = None):
    """Send row block ``j`` of ``tensor`` to rank ``j``; receive one block from each rank.

    Args:
        tensor: ``[sum(splits), ...]``.
        splits: rows to send to each rank (length ``size()``). ``None`` splits
            the first dimension evenly, which must then divide by ``size()``.

    Returns:
        ``received`` (rows from rank 0, then rank 1, ...) if ``splits`` is None,
        else ``(received, received_splits)``, as Horovod.

    Example (2 ranks): rank 0 sends ``[0, 1, 2]`` with splits ``[1, 2]``, rank 1
    sends ``[7, 8]`` with splits ``[2, 0]`` → rank 0 receives ``[0, 7, 8]``
    (splits ``[1, 2]``), rank 1 receives ``[1, 2]`` (splits ``[2, 0]``).
    """
    t, as_numpy = _as_tensor(tensor)
    n = runtime.size()
    if t.shape.rank == 0:
        raise ConfigurationError("alltoall needs a tensor with a first dimension; got a scalar.")
    splits_t = None
    if splits is not None:
        splits_t = tf.cast(tf.convert_to_tensor(splits), tf.int32)
        if splits_t.shape.rank != 1 or (splits_t.shape[0] is not None and splits_t.shape[0] != n):
            raise ConfigurationError(
                f"alltoall: splits must be a vector with one entry per rank ({n}); got "
                f"shape {splits_t.shape.as_list()}."
            )
        if tf.executing_eagerly():
            s = splits_t.numpy()
            if (s < 0).any() or s.sum() != t.shape[0]:
                raise ConfigurationError(
                    f"alltoall: splits={s.tolist()} must be non-negative and sum to the "
                    f"tensor's first dimension ({t.shape[0]})."
                )
    elif tf.executing_eagerly() and t.shape[0] % n:
        raise ConfigurationError(
            f"alltoall without splits needs the first dimension ({t.shape[0]}) to be "
            f"divisible by the number of ranks ({n}); pass splits= for uneven blocks."
        )
    received, rsplits = _run(
        "alltoall", name, _describe(t), lambda: runtime.backend().alltoall(t, splits_t, name)
    )
    if splits is None:
        return _out(received, as_numpy)
    return _out(received, as_numpy), _out(rsplits, as_numpy)


def neighbor_exchange(
    tensors, send_to: Sequence[int], recv_from: Sequence[int], name: str | None = None
):
    """Point-to-point exchange with chosen peers (MindSpore's NeighborExchange).

    Each rank sends a tensor to every rank in ``send_to`` and receives one from
    every rank in ``recv_from``. The pattern must agree: rank ``i`` lists ``j``
    in ``send_to`` exactly when rank ``j`` lists ``i`` in ``recv_from``;
    otherwise every rank raises :class:`CollectiveMismatchError` naming the
    pair. Shapes may differ between pairs; dtype and number of dimensions must
    be the same everywhere. Built on ``allgather`` (of the pattern) and
    ``alltoall`` (of the data).

    Args:
        tensors: one tensor sent to all of ``send_to``, or a list with one
            tensor per entry of ``send_to``.
        send_to: distinct destination ranks (may be empty).
        recv_from: distinct source ranks (may be empty).

    Returns:
        List of received tensors, one per entry of ``recv_from``, in that order.

    Example (a ring of 2): rank r sends ``[r]`` to ``1 - r``:
        >>> hvdkit.neighbor_exchange(np.array([r]), send_to=[1 - r], recv_from=[1 - r])
        [array([1 - r])]
    """
    n, me = runtime.size(), runtime.rank()
    send_to, recv_from = list(send_to), list(recv_from)
    for label, peers in (("send_to", send_to), ("recv_from", recv_from)):
        bad = [p for p in peers if not isinstance(p, (int, np.integer)) or not 0 <= p < n]
        if bad:
            raise ConfigurationError(
                f"neighbor_exchange: {label}={peers} has ranks {bad} outside [0, {n})."
            )
        if len(set(peers)) != len(peers):
            raise ConfigurationError(
                f"neighbor_exchange: {label}={peers} lists a rank twice; each peer once."
            )
    if isinstance(tensors, (list, tuple)):
        if len(tensors) != len(send_to):
            raise ConfigurationError(
                f"neighbor_exchange: got {len(tensors)} tensors for {len(send_to)} "
                "destinations in send_to; pass one tensor per destination, or a single "
                "tensor to send to all."
            )
        if not tensors:
            raise ConfigurationError(
                "neighbor_exchange: with an empty send_to, pass a single tensor (it is "
                "not sent, but sets the dtype and number of dimensions)."
            )
        converted = [_as_tensor(t) for t in tensors]
    else:
        converted = [_as_tensor(tensors)] * max(1, len(send_to))
    as_numpy = converted[0][1]
    parts = [t for t, _ in converted]
    dtype, ndim = parts[0].dtype, parts[0].shape.rank
    if any(p.dtype != dtype or p.shape.rank != ndim for p in parts):
        raise ConfigurationError(
            "neighbor_exchange: all tensors must share dtype and number of dimensions; got "
            + ", ".join(_describe(p) for p in parts)
        )
    by_dest = dict(zip(send_to, parts[: len(send_to)], strict=True))

    # Pattern row per destination j: [I send to j, I expect from j, shape...].
    rows = []
    for j in range(n):
        shape = (
            tf.shape(by_dest[j], out_type=tf.int64) if j in by_dest else tf.zeros([ndim], tf.int64)
        )
        flags = tf.constant([int(j in by_dest), int(j in recv_from)], tf.int64)
        rows.append(tf.concat([flags, shape], 0))
    pattern = allgather(tf.stack(rows)[None], name=f"{name or 'neighbor_exchange'}.pattern")
    pattern = tf.reshape(pattern, [n, n, 2 + ndim])  # [source, dest, ...]
    sends, expects = pattern[:, :, 0], tf.transpose(pattern[:, :, 1])
    if tf.executing_eagerly():
        diff = np.argwhere(sends.numpy() != expects.numpy())
        if len(diff):
            sends_np = sends.numpy()
            problems = [
                f"rank {i} sends to rank {j} but rank {j} does not list {i} in recv_from"
                if sends_np[i, j]
                else f"rank {j} expects from rank {i} but rank {i} does not list {j} in send_to"
                for i, j in diff.tolist()
            ]
            raise CollectiveMismatchError(
                "neighbor_exchange pattern does not match: "
                + "; ".join(problems)
                + ". Rank i must list j in send_to exactly when rank j lists i in recv_from."
            )
    else:
        tf.debugging.assert_equal(
            sends,
            expects,
            message="neighbor_exchange pattern does not match: rank i must list j in "
            "send_to exactly when rank j lists i in recv_from (rows: senders, columns: receivers)",
        )
    flat = [tf.reshape(by_dest[j], [-1]) for j in range(n) if j in by_dest]
    payload = tf.concat(flat, 0) if flat else tf.zeros([0], dtype)
    splits = tf.stack([tf.size(by_dest[j], tf.int32) if j in by_dest else 0 for j in range(n)])
    received, rsplits = _run(
        "neighbor_exchange",
        name,
        _describe(payload),
        lambda: runtime.backend().alltoall(payload, splits, name),
    )
    pieces = tf.split(received, rsplits, num=n)
    return [_out(tf.reshape(pieces[i], pattern[i, me, 2:]), as_numpy) for i in recv_from]


# --------------------------------------------------------------------------- objects
def broadcast_object(obj: Any, root_rank: int = 0) -> Any:
    """Send a picklable Python object from ``root_rank`` to every rank (eager only).

    Example:
        >>> config = hvdkit.broadcast_object(config if hvdkit.rank() == 0 else None)
    """
    _check_root(root_rank, "broadcast_object")
    return runtime.backend().broadcast_object(obj, root_rank)


def allgather_object(obj: Any) -> list[Any]:
    """List of every rank's picklable object, in rank order (eager only).

    Example:
        >>> hvdkit.allgather_object({"rank": hvdkit.rank()})
        [{'rank': 0}, {'rank': 1}]
    """
    return runtime.backend().allgather_object(obj)
