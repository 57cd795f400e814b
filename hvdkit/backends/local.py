"""Size-1 backend: one process, no launcher, every collective is the identity."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import tensorflow as tf

from .base import Backend, ReduceOp


class LocalBackend(Backend):
    """A job of one process. Lets the same script run with or without a launcher."""

    name = "local"

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    local_rank = cross_rank = rank
    local_size = cross_size = size

    def barrier(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def allreduce(self, tensor: tf.Tensor, op: ReduceOp, name: str | None) -> tf.Tensor:
        return tf.identity(tensor)

    def grouped_allreduce(
        self, tensors: Sequence[tf.Tensor], op: ReduceOp, name: str | None
    ) -> list[tf.Tensor]:
        return [tf.identity(t) for t in tensors]

    def allgather(self, tensor: tf.Tensor, name: str | None) -> tf.Tensor:
        return tf.identity(tensor)

    def broadcast(self, tensor: tf.Tensor, root_rank: int, name: str | None) -> tf.Tensor:
        return tf.identity(tensor)

    def reducescatter(self, tensor: tf.Tensor, op: ReduceOp, name: str | None) -> tf.Tensor:
        return tf.identity(tensor)

    def alltoall(
        self, tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None
    ) -> tuple[tf.Tensor, tf.Tensor]:
        rows = tf.shape(tensor, out_type=tf.int32)[:1]
        return tf.identity(tensor), rows

    def broadcast_object(self, obj: Any, root_rank: int) -> Any:
        # A real broadcast hands back a copy; keep that contract.
        return copy.deepcopy(obj)

    def allgather_object(self, obj: Any) -> list[Any]:
        return [copy.deepcopy(obj)]
