"""Collective operations for ``tf.Tensor``, ``tf.Variable`` and numpy arrays.

The tensor collectives work eagerly and inside ``tf.function``;
``broadcast_object``/``allgather_object`` are eager only. Numpy in gives numpy
out. In a job of size 1 (no launcher) each is the identity (with Horovod's
pre/postscale arithmetic). The Horovod names, argument order and semantics are
kept (``allreduce(tensor, average=None, device_dense='', device_sparse='',
compression=..., op=None, prescale_factor=1.0, postscale_factor=1.0, name=None)``,
``alltoall`` returning ``(tensor, received_splits)`` when ``splits`` is given),
so Horovod code only changes its import. ``process_set=`` limits a collective
to a registered :class:`~hvdkit.ProcessSet` (:mod:`hvdkit.process_sets`);
there ``S`` below is the set's size and ranks are the set's, in order, while
``root_rank`` stays a global rank (as Horovod).

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

import contextlib
import itertools
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np
import tensorflow as tf

from . import _compat, process_sets, runtime
from ._autograph import not_converted
from ._comm import progress as _progress
from ._validate import is_int, is_number
from .backends import ReduceOp
from .errors import CollectiveError, CollectiveMismatchError, ConfigurationError, NotSupportedError
from .process_sets import ProcessSet

#: What the tensor collectives accept: a tensor, a (Keras) variable, numpy or Python numbers.
TensorLike = tf.Tensor | tf.Variable | np.ndarray | float | int | Sequence
#: What they return: a ``tf.Tensor``, or numpy when numpy/Python values were given.
TensorOut = tf.Tensor | np.ndarray

__all__ = [
    "ReduceOp",
    "Average",
    "Sum",
    "Min",
    "Max",
    "Product",
    "Adasum",
    "allreduce",
    "grouped_allreduce",
    "allgather",
    "grouped_allgather",
    "broadcast",
    "broadcast_",
    "broadcast_variables",
    "reducescatter",
    "grouped_reducescatter",
    "alltoall",
    "join",
    "neighbor_exchange",
    "broadcast_object",
    "allgather_object",
]

Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT
Adasum = ReduceOp.ADASUM

_eager_call_ids = itertools.count()


class TFCollectiveMismatchError(CollectiveMismatchError, tf.errors.FailedPreconditionError):
    """:class:`~hvdkit.errors.CollectiveMismatchError` that is also Horovod's error class.

    Horovod 0.28.1 reports ranks that disagree (shape, dtype, root rank, op)
    as ``tf.errors.FailedPreconditionError``, eagerly and inside
    ``tf.function``. hvdkit raises this class eagerly, so both
    ``except hvdkit.CollectiveMismatchError`` and Horovod-style
    ``except tf.errors.FailedPreconditionError`` catch it. (Inside a
    ``tf.function`` TensorFlow itself raises ``FailedPreconditionError``.)
    """

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)
        self.args = (message,)

    def __reduce__(self):
        return type(self), (self.message,)


class TFArgumentError(ConfigurationError, tf.errors.InvalidArgumentError):
    """:class:`~hvdkit.errors.ConfigurationError` that is also Horovod's error class.

    Horovod 0.28.1 reports an ``alltoall`` whose rows do not split as asked
    (``splits`` not adding up to the first dimension, an uneven default split),
    and a collective on a process set the rank is not in,
    as ``tf.errors.InvalidArgumentError``; hvdkit finds these before
    communicating and raises this class, so ``except ValueError``,
    ``except hvdkit.ConfigurationError`` and Horovod-style
    ``except tf.errors.InvalidArgumentError`` all catch it.
    """

    def __init__(self, message: str):
        tf.errors.InvalidArgumentError.__init__(self, None, None, message)
        self.args = (message,)

    def __reduce__(self):
        return type(self), (self.message,)


# --------------------------------------------------------------------------- helpers
def _check_op(op: Any, allowed: Sequence[ReduceOp] = tuple(ReduceOp), what: str = "allreduce"):
    if op is Adasum and Adasum not in allowed:
        raise NotSupportedError(
            f"{what} does not support op=hvdkit.Adasum (nor does Horovod); use hvdkit.Average "
            "or hvdkit.Sum, or allreduce with op=hvdkit.Adasum."
        )
    if op not in allowed:
        names = ", ".join(f"hvdkit.{o.name.title()}" for o in allowed)
        raise ConfigurationError(f"{what} does not support op={op!r}; use one of {names}.")


def _resolve_op(op: ReduceOp | None, average: bool | None, what: str) -> ReduceOp:
    """Horovod's rule for the deprecated ``average=``: ``op`` wins, both is an error."""
    if op is not None:
        if average is not None:
            raise ConfigurationError(
                f"{what}: got both op={op!r} and average={average!r}; op supersedes the "
                "deprecated average argument. Pass only op."
            )
        _check_op(op, what=what)
        return op
    if average is not None:
        warnings.warn(
            f"{what}(average=...) is deprecated (as in Horovod); pass op=hvdkit.Average "
            "or op=hvdkit.Sum.",
            DeprecationWarning,
            stacklevel=3,
        )
        return Average if average else Sum
    return Average


def _in_set(process_set: Any, what: str) -> ProcessSet:
    """The registered set a collective runs over; refuses a set this rank is not in.

    Horovod's engine raises ``tf.errors.InvalidArgumentError`` for a rank
    outside the set; hvdkit's error is that class too (and a ConfigurationError).
    """
    return process_sets.resolve(process_set, what, not_member=TFArgumentError)


def _size(ps: ProcessSet) -> int:
    return len(ps.ranks) if ps.process_set_id else runtime.size()


def check_adasum(ps: ProcessSet, what: str) -> None:
    """Horovod's rules for ``op=Adasum`` on CPU, checked before anything is sent.

    Horovod's CPU Adasum is its MPI kernel; Gloo has none. Horovod also
    refuses it for a process set other than the global one and for a number
    of ranks that is not a power of 2 (``NotImplementedError``, as here).
    """
    n = runtime.size()
    if n == 1:
        return  # one rank's tensor is its own adaptive sum
    if ps.process_set_id:
        raise NotSupportedError(
            f"{what}: op=hvdkit.Adasum runs over the whole job only (as Horovod); got "
            f"process_set={ps}. Drop process_set, or use op=hvdkit.Average in the set."
        )
    if runtime.backend().transport() != "mpi":
        raise NotSupportedError(
            f"{what}: op=hvdkit.Adasum needs MPI (Horovod's CPU Adasum is an MPI kernel); this "
            f"job runs over {runtime.backend().transport()}. Launch with horovodrun --mpi, "
            "mpirun or hvdkitrun --mpi, or use op=hvdkit.Average."
        )
    if n & (n - 1):
        raise NotSupportedError(
            f"{what}: op=hvdkit.Adasum needs a power of 2 ranks (as Horovod); this job has {n}. "
            "Launch 2, 4, 8, ... ranks, or use op=hvdkit.Average."
        )


def _check_scale(prescale_factor: float, postscale_factor: float, what: str) -> None:
    for label, factor in (
        ("prescale_factor", prescale_factor),
        ("postscale_factor", postscale_factor),
    ):
        if not is_number(factor):
            raise ConfigurationError(f"{what}: {label}={factor!r} must be a Python number.")


def _device(device: str):
    return tf.device(device) if device else contextlib.nullcontext()


def _as_tensor(value: Any) -> tuple[tf.Tensor, bool]:
    """Returns the value as a tensor and whether the caller gave numpy/Python."""
    # tf.is_tensor also covers keras.Variable, which is not a tf.Variable.
    if tf.is_tensor(value) or isinstance(value, tf.Variable):
        return tf.convert_to_tensor(value), False
    return tf.convert_to_tensor(np.asarray(value)), True


def _describe(tensor: tf.Tensor) -> str:
    return f"shape {tensor.shape.as_list()} dtype {tensor.dtype.name}"


def _check_root(root_rank: int, what: str, ps: ProcessSet | None = None) -> None:
    n = runtime.size()
    if ps is not None and ps.process_set_id and is_int(root_rank) and root_rank not in ps.ranks:
        raise ConfigurationError(
            f"{what}: root_rank={root_rank!r} is not in {ps}; root_rank is a global rank "
            f"(as in Horovod), one of {ps.ranks}."
        )
    if not is_int(root_rank) or not 0 <= root_rank < n:
        problem = "is outside the job's ranks" if is_int(root_rank) else "is not a rank of the job"
        raise ConfigurationError(
            f"{what}: root_rank={root_rank!r} {problem} [0, {n}); "
            f"pass an integer rank between 0 and {n - 1}."
        )


def _run(what: str, name: str | None, tensor_info: str, fn, ps: ProcessSet | None = None):
    """Call a backend collective and turn Horovod's errors into hvdkit's.

    ``ps``: the process set it runs over (``None``: the job); the messages
    and what the launcher reports for a stuck rank name it.

    Only eager calls can be translated: inside ``tf.function`` the error is
    raised by TensorFlow when the function runs, with Horovod's message and
    Horovod's class (``FailedPreconditionError`` for a mismatch).
    """
    if not tf.executing_eagerly():
        return fn()
    label = repr(name) if name else f"#{next(_eager_call_ids)} (unnamed; pass name= to label it)"
    if ps is not None and ps.process_set_id:
        label += f" in process set {ps.process_set_id} {ps.ranks}"
    waiting = _progress.enter(f"{what} {label}")  # the launcher names it if it never returns
    try:
        return fn()
    except tf.errors.OpError as exc:
        detail = exc.message.split("}}")[-1].strip()
        if "Mismatched" in detail:
            # Horovod reports the error on every rank and stays usable, so all
            # ranks can exchange what they passed and name it in the message.
            set_id = ps.process_set_id if ps is not None else 0
            seen = runtime.backend().allgather_object(tensor_info, process_set_id=set_id)
            ranks = ps.ranks if set_id else range(len(seen))
            per_rank = "; ".join(f"rank {r}: {info}" for r, info in zip(ranks, seen, strict=True))
            raise TFCollectiveMismatchError(
                f"{what} of tensor {label} failed: ranks passed incompatible arguments "
                f"({per_rank}). Horovod reports: {detail}. Make every rank call {what} "
                "with the same dtype, shape and root rank (allgather/alltoall: the same "
                "trailing dimensions)."
            ) from None
        here = f"rank {runtime.rank()} passed {tensor_info}"
        raise CollectiveError(f"{what} of tensor {label} failed ({here}): {detail}") from exc
    finally:
        _progress.leave(waiting)


def _compressed(
    what: str, t: tf.Tensor, name: str | None, compression, call, ps: ProcessSet
) -> tf.Tensor:
    """``call(compressed t)`` through :func:`_run`, decompressed (``compression`` may be None)."""
    c, ctx = compression.compress(t) if compression is not None else (t, None)
    out = _run(what, name, _describe(c), lambda: call(c), ps)
    return compression.decompress(out, ctx) if compression is not None else out


def _out(tensor: tf.Tensor, as_numpy: bool):
    return np.asarray(tensor.numpy()) if as_numpy else tensor


def _reduce_slices(
    slices: Sequence[tf.IndexedSlices],
    op: ReduceOp,
    prescale: float,
    postscale: float,
    what: str,
    ps: ProcessSet,
) -> list[tf.IndexedSlices]:
    """Horovod's sparse allreduce: allgather values and indices; Average divides by size."""
    if op is Adasum:
        raise NotSupportedError(
            f"{what}: op=hvdkit.Adasum does not support tf.IndexedSlices (as Horovod); densify "
            "them with tf.convert_to_tensor, or pass sparse_as_dense=True to the optimizer."
        )
    if op not in (Sum, Average):
        raise NotSupportedError(
            f"{what} of tf.IndexedSlices supports only op=hvdkit.Sum or hvdkit.Average (as "
            f"Horovod); got op={op!r}. Densify first with tf.convert_to_tensor(slices) to use "
            "other ops."
        )
    if prescale != 1.0 or postscale != 1.0:
        raise NotSupportedError(
            f"{what}: prescale_factor/postscale_factor are not supported with tf.IndexedSlices "
            f"(as Horovod); got {prescale}/{postscale}. Scale the values yourself."
        )
    values = grouped_allgather([s.values for s in slices], process_set=ps)
    indices = grouped_allgather([s.indices for s in slices], process_set=ps)
    n = _size(ps)
    out = []
    for v, i, s in zip(values, indices, slices, strict=True):
        if op == Average:
            v = v / tf.cast(n, v.dtype)
        out.append(tf.IndexedSlices(v, i, dense_shape=s.dense_shape))
    return out


# --------------------------------------------------------------------------- tensors
@not_converted
def allreduce(
    tensor: TensorLike | tf.IndexedSlices,
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    ignore_name_scope: bool = False,
) -> TensorOut | tf.IndexedSlices:
    """Reduce ``tensor`` over all ranks; every rank gets the result (Horovod's signature).

    Computes ``postscale_factor * reduce_r(prescale_factor * tensor_r)``;
    ``Average`` is the sum divided by ``size()``. Integer tensors are scaled
    in float64 and truncated toward zero, as Horovod does (so ``Average`` of
    ints rounds toward zero).

    Args:
        tensor: ``tf.Tensor``, ``tf.Variable``, numpy array or
            ``tf.IndexedSlices``; the same shape and dtype on every rank. An
            ``IndexedSlices`` (``dense_shape`` may be ``None``) is allgathered:
            the result holds every rank's rows (``Average`` divides values by
            ``size()``); only ``Sum``/``Average`` and no scaling are allowed.
        average: deprecated (Horovod 0.19): ``True`` is ``op=Average``,
            ``False`` ``op=Sum``; giving it with ``op`` is an error. A string
            here is taken as ``name``: ``horovod.tensorflow.keras.allreduce``
            has ``(value, name, average, ...)``.
        device_dense, device_sparse: device for dense / sparse inputs
            (``""``: TensorFlow's choice).
        compression: ``hvdkit.Compression.none`` (``None``) or ``.fp16``.
        op: ``Average`` (default), ``Sum``, ``Min``, ``Max``, ``Product``, or
            ``Adasum`` (Horovod's adaptive summation: MPI only, the whole job,
            a power of 2 ranks, dense tensors; :func:`check_adasum`).
        prescale_factor, postscale_factor: multiply before / after reducing.
        name: label used in error messages and by Horovod to match the call
            across ranks.
        process_set: a registered :class:`~hvdkit.ProcessSet` to reduce within
            (``Average`` divides by its size); ``None`` is the whole job.
        ignore_name_scope: accepted for Horovod code; names only, no effect
            on results.

    Returns:
        Same shape and dtype as ``tensor`` (numpy if numpy was given).

    Raises:
        CollectiveMismatchError: ranks passed different shapes or dtypes;
            also a ``tf.errors.FailedPreconditionError``, like Horovod's.
        NotSupportedError: ``IndexedSlices`` with ``Min``/``Max``/``Product``
            or with scaling (a ``NotImplementedError``, like Horovod's).

    Example:
        >>> hvdkit.allreduce(np.array([hvdkit.rank() + 1.0]), op=hvdkit.Sum)
        array([3.])   # on both ranks of a 2-process job
        >>> hvdkit.allreduce(np.array([2.0]), op=hvdkit.Sum, postscale_factor=0.5)
        array([2.])   # (2 + 2) * 0.5
    """
    if isinstance(average, str) and name is None:
        # horovod.tensorflow.keras.allreduce(value, name, average, ...): its second
        # parameter is the name; average is a bool, so a string there is that name.
        name, average = average, None
    op = _resolve_op(op, average, "allreduce")
    ps = _in_set(process_set, "allreduce")
    _check_scale(prescale_factor, postscale_factor, "allreduce")
    if isinstance(tensor, tf.IndexedSlices):
        with _device(device_sparse):
            return _reduce_slices([tensor], op, prescale_factor, postscale_factor, "allreduce", ps)[
                0
            ]
    if op is Adasum:
        check_adasum(ps, "allreduce")
    t, as_numpy = _as_tensor(tensor)
    with _device(device_dense):
        out = _compressed(
            "allreduce",
            t,
            name,
            compression,
            lambda c: runtime.backend().allreduce(
                c, op, name, prescale_factor, postscale_factor, process_set_id=ps.process_set_id
            ),
            ps,
        )
    return _out(out, as_numpy)


@not_converted
def grouped_allreduce(
    tensors: Sequence[TensorLike | tf.IndexedSlices],
    average: bool | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = None,
    op: ReduceOp | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet | None = None,
    ignore_name_scope: bool = False,
    name: str | None = None,
) -> list[TensorOut | tf.IndexedSlices]:
    """Allreduce several tensors in one fused operation (Horovod's signature).

    Arguments as :func:`allreduce`. Tensors may differ in shape and dtype
    (one fused exchange per dtype); ``tf.IndexedSlices`` entries are
    allgathered as in :func:`allreduce`.

    Returns:
        List of reduced tensors, in input order.

    Example:
        >>> w, b = hvdkit.grouped_allreduce([grad_w, grad_b])
    """
    op = _resolve_op(op, average, "grouped_allreduce")
    ps = _in_set(process_set, "grouped_allreduce")
    _check_scale(prescale_factor, postscale_factor, "grouped_allreduce")
    if not tensors:
        return []
    out: list = [None] * len(tensors)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:
        with _device(device_sparse):
            reduced = _reduce_slices(
                [tensors[i] for i in sparse],
                op,
                prescale_factor,
                postscale_factor,
                "grouped_allreduce",
                ps,
            )
        for i, r in zip(sparse, reduced, strict=True):
            out[i] = r
    dense = [i for i in range(len(tensors)) if i not in set(sparse)]
    if dense:
        if op is Adasum:
            check_adasum(ps, "grouped_allreduce")
        converted = [_as_tensor(tensors[i]) for i in dense]
        with _device(device_dense):
            packed = [
                compression.compress(t) if compression is not None else (t, None)
                for t, _ in converted
            ]
            ts = [t for t, _ in packed]
            info = "; ".join(_describe(t) for t in ts)
            outs = _run(
                "grouped_allreduce",
                name,
                info,
                lambda: runtime.backend().grouped_allreduce(
                    ts,
                    op,
                    name,
                    prescale_factor,
                    postscale_factor,
                    ignore_name_scope,
                    process_set_id=ps.process_set_id,
                ),
                ps,
            )
            if compression is not None:
                outs = [
                    compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed, strict=True)
                ]
        for i, o, (_, as_np) in zip(dense, outs, converted, strict=True):
            out[i] = _out(o, as_np)
    return out


@not_converted
def allgather(
    tensor: TensorLike,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> TensorOut:
    """Concatenate every rank's ``tensor`` along the first dimension, in rank order.

    The first dimension may differ between ranks; the others must match. A
    scalar is gathered as a vector of one element per rank.

    Example:
        >>> hvdkit.allgather(np.full([hvdkit.rank() + 1, 2], hvdkit.rank()))
        array([[0, 0], [1, 1], [1, 1]])   # shape [3, 2] on both ranks of 2
    """
    ps = _in_set(process_set, "allgather")
    t, as_numpy = _as_tensor(tensor)
    if t.shape.rank == 0:
        t = tf.reshape(t, [1])
    out = _run(
        "allgather",
        name,
        _describe(t),
        lambda: runtime.backend().allgather(t, name, process_set_id=ps.process_set_id),
        ps,
    )
    return _out(out, as_numpy)


@not_converted
def grouped_allgather(
    tensors: Sequence[TensorLike],
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> list[TensorOut]:
    """:func:`allgather` of several tensors in one fused operation, in input order.

    Horovod requires one dtype for the whole group; hvdkit accepts mixed
    dtypes (one fused exchange per dtype).

    Example:
        >>> x, y = hvdkit.grouped_allgather([features, labels])  # rows of every rank
    """
    ps = _in_set(process_set, "grouped_allgather")
    converted = [_as_tensor(t) for t in tensors]
    if not converted:
        return []
    ts = [tf.reshape(t, [1]) if t.shape.rank == 0 else t for t, _ in converted]
    info = "; ".join(_describe(t) for t in ts)
    outs = _run(
        "grouped_allgather",
        name,
        info,
        lambda: runtime.backend().grouped_allgather(ts, name, process_set_id=ps.process_set_id),
        ps,
    )
    return [_out(o, as_np) for o, (_, as_np) in zip(outs, converted, strict=True)]


@not_converted
def broadcast(
    tensor: TensorLike,
    root_rank: int = 0,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> TensorOut:
    """Every rank receives ``root_rank``'s ``tensor`` (same shape/dtype on all ranks).

    Raises:
        CollectiveMismatchError: ranks passed different shapes, dtypes or
            root ranks (also a ``tf.errors.FailedPreconditionError``).

    Example:
        >>> hvdkit.broadcast(np.array([hvdkit.rank()]), root_rank=1)
        array([1])   # on every rank
    """
    ps = _in_set(process_set, "broadcast")
    _check_root(root_rank, "broadcast", ps)
    t, as_numpy = _as_tensor(tensor)
    out = _run(
        "broadcast",
        name,
        f"{_describe(t)} root_rank {root_rank}",
        lambda: runtime.backend().broadcast(t, root_rank, name, process_set_id=ps.process_set_id),
        ps,
    )
    return _out(out, as_numpy)


@not_converted
def broadcast_(
    variables: Sequence[tf.Variable],
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> list[tf.Tensor]:
    """In-place broadcast (Horovod's ``broadcast_``): overwrite ``variables`` with root's values.

    Args:
        variables: ``tf.Variable``/``keras.Variable`` objects, the same
            shapes and dtypes in the same order on every rank.

    Returns:
        The variables' new values, one tensor per variable.

    Example:
        >>> v = tf.Variable([float(hvdkit.rank())])
        >>> hvdkit.broadcast_([v], root_rank=1)
        [<tf.Tensor: numpy=array([1.], dtype=float32)>]   # and v holds [1.] on every rank
    """
    ps = _in_set(process_set, "broadcast_")
    _check_root(root_rank, "broadcast_", ps)
    variables = list(variables)
    try:
        tf_vars = [_compat.tf_variable(v) for v in variables]
    except TypeError as exc:
        raise ConfigurationError(f"broadcast_: {exc}") from None
    if not tf_vars:
        return []
    info = (
        "; ".join(_describe(tf.convert_to_tensor(v)) for v in tf_vars) + f" root_rank {root_rank}"
    )
    return list(
        _run(
            "broadcast_",
            name,
            info,
            lambda: runtime.backend().broadcast_inplace(
                tf_vars, root_rank, name, process_set_id=ps.process_set_id
            ),
            ps,
        )
    )


@not_converted
def broadcast_variables(
    variables: Sequence[tf.Variable],
    root_rank: int = 0,
    process_set: ProcessSet | None = None,
    inplace: bool = False,
) -> tf.Operation | None:
    """Overwrite ``variables`` in place with their values on ``root_rank``.

    Args:
        variables: ``tf.Variable``/``keras.Variable`` objects, in the same
            order on every rank (e.g. ``model.variables``).
        inplace: use :func:`broadcast_` (one fused in-place exchange) instead
            of one broadcast and assign per variable; same result.

    Returns:
        As Horovod: ``None`` when run eagerly; in a graph, the op that
        assigns the broadcast values (``tf.group`` of the assignments).

    Example:
        >>> hvdkit.broadcast_variables(model.variables, root_rank=0)
    """
    ps = _in_set(process_set, "broadcast_variables")
    _check_root(root_rank, "broadcast_variables", ps)
    if inplace:
        broadcast_(variables, root_rank, process_set=ps)
        return None
    assigns = []
    for i, var in enumerate(variables):
        t = tf.convert_to_tensor(var)
        label = f"broadcast_variables[{i}] {getattr(var, 'path', getattr(var, 'name', ''))}"
        out = _run(
            "broadcast",
            label,
            _describe(t),
            lambda t=t: runtime.backend().broadcast(
                t, root_rank, None, process_set_id=ps.process_set_id
            ),
            ps,
        )
        assigns.append(var.assign(out))
    return tf.group(*assigns)


def _check_scatterable(t: tf.Tensor, what: str) -> None:
    if t.shape.rank == 0:
        raise ConfigurationError(
            f"{what} needs a tensor with at least one dimension to split; got a scalar. "
            "Reshape it to [1] or use allreduce."
        )


@not_converted
def reducescatter(
    tensor: TensorLike,
    device_dense: str = "",
    compression: Any = None,
    op: ReduceOp = Average,
    name: str | None = None,
    process_set: ProcessSet | None = None,
    ignore_name_scope: bool = False,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> TensorOut:
    """Reduce over ranks, then give each rank one block of rows of the result.

    Horovod's signature. With ``d0`` rows and ``S`` ranks, rank ``r`` gets
    ``d0 // S`` rows, plus one more if ``r < d0 % S``, in rank order.
    ``op`` is ``Average`` (default) or ``Sum``; the scale factors work as in
    :func:`allreduce`.

    Example (2 ranks, Sum):
        rank 0 has ``[[1], [2], [3]]``, rank 1 has ``[[10], [20], [30]]``
        → rank 0 gets ``[[11], [22]]``, rank 1 gets ``[[33]]``.
    """
    _check_op(op, (Average, Sum), "reducescatter")
    ps = _in_set(process_set, "reducescatter")
    _check_scale(prescale_factor, postscale_factor, "reducescatter")
    t, as_numpy = _as_tensor(tensor)
    _check_scatterable(t, "reducescatter")
    with _device(device_dense):
        out = _compressed(
            "reducescatter",
            t,
            name,
            compression,
            lambda c: runtime.backend().reducescatter(
                c, op, name, prescale_factor, postscale_factor, process_set_id=ps.process_set_id
            ),
            ps,
        )
    return _out(out, as_numpy)


@not_converted
def grouped_reducescatter(
    tensors: Sequence[TensorLike],
    device_dense: str = "",
    compression: Any = None,
    op: ReduceOp = Average,
    process_set: ProcessSet | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    name: str | None = None,
) -> list[TensorOut]:
    """:func:`reducescatter` of several tensors in one fused operation (Horovod's signature).

    Each tensor is split by its own first dimension. Horovod requires one
    dtype for the group; hvdkit accepts mixed dtypes (one exchange per dtype).

    Example (2 ranks, Sum): ``[a, b]`` with ``a`` of 4 rows and ``b`` of 3 →
    rank 0 gets rows 0-1 of ``sum(a)`` and rows 0-1 of ``sum(b)``, rank 1 gets
    rows 2-3 and row 2.
    """
    _check_op(op, (Average, Sum), "grouped_reducescatter")
    ps = _in_set(process_set, "grouped_reducescatter")
    _check_scale(prescale_factor, postscale_factor, "grouped_reducescatter")
    converted = [_as_tensor(t) for t in tensors]
    if not converted:
        return []
    for t, _ in converted:
        _check_scatterable(t, "grouped_reducescatter")
    with _device(device_dense):
        packed = [
            compression.compress(t) if compression is not None else (t, None) for t, _ in converted
        ]
        ts = [t for t, _ in packed]
        outs = _run(
            "grouped_reducescatter",
            name,
            "; ".join(_describe(t) for t in ts),
            lambda: runtime.backend().grouped_reducescatter(
                ts, op, name, prescale_factor, postscale_factor, process_set_id=ps.process_set_id
            ),
            ps,
        )
        if compression is not None:
            outs = [
                compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed, strict=True)
            ]
    return [_out(o, as_np) for o, (_, as_np) in zip(outs, converted, strict=True)]


@not_converted
def alltoall(
    tensor: TensorLike,
    splits: TensorLike | None = None,
    name: str | None = None,
    ignore_name_scope: bool = False,
    process_set: ProcessSet | None = None,
) -> TensorOut | tuple[TensorOut, TensorOut]:
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
    ps = _in_set(process_set, "alltoall")
    t, as_numpy = _as_tensor(tensor)
    n = _size(ps)
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
                raise TFArgumentError(
                    f"alltoall: splits={s.tolist()} must be non-negative and sum to the "
                    f"tensor's first dimension ({t.shape[0]})."
                )
    elif tf.executing_eagerly() and t.shape[0] % n:
        raise TFArgumentError(
            f"alltoall without splits needs the first dimension ({t.shape[0]}) to be "
            f"divisible by the number of ranks ({n}); pass splits= for uneven blocks."
        )
    received, rsplits = _run(
        "alltoall",
        name,
        _describe(t),
        lambda: runtime.backend().alltoall(t, splits_t, name, process_set_id=ps.process_set_id),
        ps,
    )
    if splits is None:
        return _out(received, as_numpy)
    return _out(received, as_numpy), _out(rsplits, as_numpy)


@not_converted
def neighbor_exchange(
    tensors: TensorLike | Sequence[TensorLike],
    send_to: Sequence[int],
    recv_from: Sequence[int],
    name: str | None = None,
) -> list[TensorOut]:
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
    eager = tf.executing_eagerly()
    send_to, recv_from = list(send_to), list(recv_from)
    _check_peers(send_to, recv_from, n)
    by_dest, as_numpy = _tensors_by_destination(tensors, send_to)
    pattern = _gather_pattern(by_dest, recv_from, n, name)  # [src, dest, 2 + ndim]
    checked = _check_pattern(pattern, eager)
    received, rsplits = _exchange(pattern[me], by_dest, n, checked, eager, name)
    pieces = tf.split(received, rsplits, num=n)
    return [_out(tf.reshape(pieces[i], pattern[i, me, 2:]), as_numpy) for i in recv_from]


def _check_peers(send_to: list, recv_from: list, n: int) -> None:
    for label, peers in (("send_to", send_to), ("recv_from", recv_from)):
        bad = [p for p in peers if not is_int(p) or not 0 <= p < n]
        if bad:
            raise ConfigurationError(
                f"neighbor_exchange: {label}={peers} has entries {bad} that are not ranks of "
                f"the job [0, {n}); pass integer ranks between 0 and {n - 1}."
            )
        if len(set(peers)) != len(peers):
            raise ConfigurationError(
                f"neighbor_exchange: {label}={peers} lists a rank twice; each peer once."
            )


def _tensors_by_destination(tensors, send_to: list) -> tuple[dict, bool]:
    """``({destination: tensor}, whether to return numpy)``; one dtype and rank for all."""
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
    parts = [t for t, _ in converted]
    dtype, ndim = parts[0].dtype, parts[0].shape.rank
    if any(p.dtype != dtype or p.shape.rank != ndim for p in parts):
        raise ConfigurationError(
            "neighbor_exchange: all tensors must share dtype and number of dimensions; got "
            + ", ".join(_describe(p) for p in parts)
        )
    by_dest = dict(zip(send_to, parts[: len(send_to)], strict=True))
    # With an empty send_to the one tensor only sets dtype and rank (key -1: not sent).
    return by_dest or {-1: parts[0]}, converted[0][1]


def _gather_pattern(by_dest: dict, recv_from: list, n: int, name: str | None) -> tf.Tensor:
    """Every rank's row per destination j: ``[sends to j, expects from j, shape...]``."""
    template = next(iter(by_dest.values()))
    ndim = template.shape.rank
    rows = []
    for j in range(n):
        sent = j in by_dest
        shape = tf.shape(by_dest[j], out_type=tf.int64) if sent else tf.zeros([ndim], tf.int64)
        flags = tf.constant([int(sent), int(j in recv_from)], tf.int64)
        rows.append(tf.concat([flags, shape], 0))
    pattern = allgather(tf.stack(rows)[None], name=f"{name or 'neighbor_exchange'}.pattern")
    return tf.reshape(_compat.opaque_while_tracing(pattern), [n, n, 2 + ndim])


def _check_pattern(pattern: tf.Tensor, eager: bool):
    """Every rank sees the same pattern and fails alike; in a graph, the check to wait for."""
    sends, expects = pattern[:, :, 0], tf.transpose(pattern[:, :, 1])
    if not eager:
        return tf.debugging.assert_equal(
            sends,
            expects,
            message="neighbor_exchange pattern does not match: rank i must list j in "
            "send_to exactly when rank j lists i in recv_from (rows: senders, columns: receivers)",
        )
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
    return None


def _exchange(mine, by_dest: dict, n: int, checked, eager: bool, name: str | None):
    """The alltoall of the data, ordered after the pattern check; ``(received, splits)``.

    Inside a tf.function nothing orders Horovod's ops but data, and a rank
    sending nothing has a constant payload (which Grappler folds, dropping
    control edges), so the splits are computed from the gathered pattern
    (``mine``: this rank's row per destination) and wait for the check: none
    is left in an alltoall the others never start.
    """
    template = next(iter(by_dest.values()))
    flat = [tf.reshape(by_dest[j], [-1]) for j in range(n) if j in by_dest]
    payload = tf.concat(flat, 0) if flat else tf.zeros([0], template.dtype)
    splits = tf.cast(mine[:, 0] * tf.reduce_prod(mine[:, 2:], axis=1), tf.int32)
    if checked is not None:
        with tf.control_dependencies([checked]):
            splits = tf.identity(splits)
    # In a graph Horovod matches ops by name, derived from the input's name when
    # none is given; ranks with different patterns build different graphs, so
    # the name must not depend on the pattern.
    data_name = name if eager else f"{name or 'neighbor_exchange'}.data"
    received, rsplits = _run(
        "neighbor_exchange",
        name,
        _describe(payload),
        lambda: runtime.backend().alltoall(payload, splits, data_name),
    )
    if not eager:
        # A rank that receives nothing returns nothing from the alltoall, and a
        # tf.function prunes ops its outputs do not need; an assertion is kept.
        tf.debugging.assert_non_negative(rsplits, message="neighbor_exchange.data ran")
    return received, rsplits


@not_converted
def join() -> tf.Tensor:
    """Mark this rank as done with its data (Horovod's ``join``); returns the last rank to join.

    Until every rank has joined, the ranks that have not keep calling
    :func:`allreduce` (and the gradient allreduces of the optimizer) without
    waiting for the joined ones, which contribute zeros: ``op=Sum`` adds
    only the active ranks' tensors, and ``op=Average`` still divides by
    ``size()``. Other collectives (allgather, broadcast, alltoall,
    reducescatter) are refused by Horovod while a rank is joined. Blocks
    until all ranks joined.

    Returns:
        int32 scalar tensor: the rank that joined last (the same on every rank).

    Example (rank 1 has one batch more than rank 0):
        >>> for batch in my_batches:
        ...     train_step(batch)          # its allreduces go on without rank 0
        >>> hvdkit.join()
    """
    _compat.refuse_xla("hvdkit.join")
    return _run("join", None, "join", lambda: runtime.backend().join())


# --------------------------------------------------------------------------- objects
def _check_session(session: Any, what: str) -> None:
    if session is not None:
        raise ConfigurationError(
            f"{what}: session={session!r} is a TensorFlow 1 argument; hvdkit runs eagerly "
            "(TensorFlow 2). Drop it."
        )


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    session: None = None,
    name: str | None = None,
    process_set: ProcessSet | None = None,
) -> Any:
    """Send a picklable Python object from ``root_rank`` to every rank (eager only).

    ``session``, ``name`` and ``process_set`` are Horovod's arguments;
    only their defaults are supported (``name`` is accepted and unused).

    Example:
        >>> config = hvdkit.broadcast_object(config if hvdkit.rank() == 0 else None)
    """
    _check_session(session, "broadcast_object")
    ps = _in_set(process_set, "broadcast_object")
    _check_root(root_rank, "broadcast_object", ps)
    return _run(
        "broadcast_object",
        name,
        f"a {type(obj).__name__} from root {root_rank}",
        lambda: runtime.backend().broadcast_object(
            obj, root_rank, process_set_id=ps.process_set_id
        ),
        ps,
    )


def allgather_object(
    obj: Any, session: None = None, name: str | None = None, process_set: ProcessSet | None = None
) -> list[Any]:
    """List of every rank's picklable object, in rank order (eager only).

    Example:
        >>> hvdkit.allgather_object({"rank": hvdkit.rank()})
        [{'rank': 0}, {'rank': 1}]
    """
    _check_session(session, "allgather_object")
    ps = _in_set(process_set, "allgather_object")
    return _run(
        "allgather_object",
        name,
        f"a {type(obj).__name__}",
        lambda: runtime.backend().allgather_object(obj, process_set_id=ps.process_set_id),
        ps,
    )
