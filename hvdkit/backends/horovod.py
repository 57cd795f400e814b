"""Horovod backend: the only module in hvdkit that imports Horovod.

Uses ``horovod.tensorflow`` (the TF collectives) and never
``horovod.tensorflow.keras``, whose optimizer wrapper does not work with
Keras 3 (see :mod:`hvdkit._compat`). Transport (MPI or Gloo) is whatever the
launcher chose; hvdkit does not care.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from ..errors import ConfigurationError
from .base import Backend, ReduceOp

try:
    import horovod.tensorflow as hvd
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ConfigurationError(
        "hvdkit was launched as part of a multi-process job but Horovod is not "
        f"importable ({exc}). Build it with `scripts/install.sh`, or run without a "
        "launcher (or with HVDKIT_BACKEND=local) for a single process."
    ) from exc

_OPS = {
    ReduceOp.AVERAGE: hvd.Average,
    ReduceOp.SUM: hvd.Sum,
    ReduceOp.MIN: hvd.Min,
    ReduceOp.MAX: hvd.Max,
    ReduceOp.PRODUCT: hvd.Product,
}
_barrier_ids = itertools.count()


class HorovodBackend(Backend):
    """Collectives through Horovod's TensorFlow ops (MPI or Gloo)."""

    name = "horovod"

    def __init__(self) -> None:
        hvd.init()

    def rank(self) -> int:
        return hvd.rank()

    def size(self) -> int:
        return hvd.size()

    def local_rank(self) -> int:
        return hvd.local_rank()

    def local_size(self) -> int:
        return hvd.local_size()

    def cross_rank(self) -> int:
        return hvd.cross_rank()

    def cross_size(self) -> int:
        return hvd.cross_size()

    def barrier(self) -> None:
        # horovod.tensorflow 0.28 has no barrier(); an allreduce waits for all.
        hvd.allreduce(
            tf.zeros([1], tf.int32), op=hvd.Sum, name=f"hvdkit.barrier.{next(_barrier_ids)}"
        )

    def shutdown(self) -> None:
        hvd.shutdown()

    def allreduce(self, tensor: tf.Tensor, op: ReduceOp, name: str | None) -> tf.Tensor:
        return hvd.allreduce(tensor, op=_OPS[op], name=name)

    def grouped_allreduce(
        self, tensors: Sequence[tf.Tensor], op: ReduceOp, name: str | None
    ) -> list[tf.Tensor]:
        # Horovod fuses only tensors of one dtype per group: one group per dtype.
        by_dtype: dict[tf.DType, list[int]] = {}
        for i, t in enumerate(tensors):
            by_dtype.setdefault(t.dtype, []).append(i)
        out: list = [None] * len(tensors)
        for indices in by_dtype.values():
            reduced = hvd.grouped_allreduce([tensors[i] for i in indices], op=_OPS[op])
            for i, t in zip(indices, reduced, strict=True):
                out[i] = t
        return out

    def allgather(self, tensor: tf.Tensor, name: str | None) -> tf.Tensor:
        return hvd.allgather(tensor, name=name)

    def broadcast(self, tensor: tf.Tensor, root_rank: int, name: str | None) -> tf.Tensor:
        return hvd.broadcast(tensor, root_rank, name=name)

    def reducescatter(self, tensor: tf.Tensor, op: ReduceOp, name: str | None) -> tf.Tensor:
        return hvd.reducescatter(tensor, op=_OPS[op], name=name)

    def alltoall(
        self, tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        if splits is None:
            # Horovod returns only the tensor without splits; the even split is
            # implied, so reconstruct the received splits ourselves.
            received = hvd.alltoall(tensor, name=name)
            rows = tf.shape(received, out_type=tf.int32)[0] // hvd.size()
            return received, tf.fill([hvd.size()], rows)
        received, received_splits = hvd.alltoall(tensor, splits=splits, name=name)
        return received, received_splits

    def broadcast_object(self, obj: Any, root_rank: int) -> Any:
        return hvd.broadcast_object(obj, root_rank=root_rank)

    def allgather_object(self, obj: Any) -> list[Any]:
        return hvd.allgather_object(obj)
