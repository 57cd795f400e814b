"""The interface every collective backend implements."""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from typing import Any

import tensorflow as tf


class ReduceOp(enum.Enum):
    """Reduction applied by ``allreduce``/``reducescatter`` (Horovod's ops)."""

    AVERAGE = "average"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"
    ADASUM = "adasum"  # Horovod's adaptive summation (its CPU kernel runs under MPI)

    def __repr__(self) -> str:
        return f"hvdkit.{self.name.title()}"


class Backend(abc.ABC):
    """Process-group topology and tensor collectives.

    Tensor methods take and return ``tf.Tensor`` and must work both eagerly and
    while tracing a ``tf.function``. Argument checking happens in
    :mod:`hvdkit.collectives`; backends may assume valid input. Every
    collective takes ``process_set_id``: ``0`` is the whole job, other ids
    come from :meth:`process_set_ids` or :meth:`add_process_set`
    (:mod:`hvdkit.process_sets` checks that this rank is in the set).
    """

    name: str
    dynamic = False  # whether add/remove_process_set may be called (set at creation)

    @abc.abstractmethod
    def process_set_ids(self) -> list[int]:
        """Ids of the process sets registered at creation, in the order they were given."""

    @abc.abstractmethod
    def add_process_set(self, ranks: list[int]) -> int:
        """Register ``ranks`` (sorted global ranks) in a running job; its id."""

    @abc.abstractmethod
    def remove_process_set(self, process_set_id: int) -> None:
        """Unregister the set ``process_set_id`` (added by :meth:`add_process_set`)."""

    @abc.abstractmethod
    def rank(self) -> int: ...

    @abc.abstractmethod
    def size(self) -> int: ...

    @abc.abstractmethod
    def local_rank(self) -> int: ...

    @abc.abstractmethod
    def local_size(self) -> int: ...

    @abc.abstractmethod
    def cross_rank(self) -> int: ...

    @abc.abstractmethod
    def cross_size(self) -> int: ...

    @abc.abstractmethod
    def barrier(self, process_set_id: int = 0) -> None: ...

    @abc.abstractmethod
    def shutdown(self) -> None: ...

    def abandon(self) -> int:
        """End this process's connections to the other ranks; how many were open.

        For a job whose world is gone (an elastic job lost a rank): a
        collective waiting on a peer fails at once instead of at the
        transport's timeout. Call :meth:`shutdown` afterwards. A backend
        without connections has nothing to end.
        """
        return 0

    @abc.abstractmethod
    def allreduce(
        self,
        tensor: tf.Tensor,
        op: ReduceOp,
        name: str | None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set_id: int = 0,
    ) -> tf.Tensor:
        """``postscale * reduce_r(prescale * tensor_r)``; ``Average`` divides the sum by size.

        Integer tensors are scaled in float64 (float16 in float32) and cast
        back, truncating toward zero, as Horovod's CPU kernels do.
        """

    @abc.abstractmethod
    def grouped_allreduce(
        self,
        tensors: Sequence[tf.Tensor],
        op: ReduceOp,
        name: str | None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        ignore_name_scope: bool = False,
        process_set_id: int = 0,
    ) -> list[tf.Tensor]: ...

    @abc.abstractmethod
    def allgather(
        self, tensor: tf.Tensor, name: str | None, process_set_id: int = 0
    ) -> tf.Tensor: ...

    @abc.abstractmethod
    def grouped_allgather(
        self, tensors: Sequence[tf.Tensor], name: str | None, process_set_id: int = 0
    ) -> list[tf.Tensor]: ...

    @abc.abstractmethod
    def broadcast(
        self, tensor: tf.Tensor, root_rank: int, name: str | None, process_set_id: int = 0
    ) -> tf.Tensor: ...

    @abc.abstractmethod
    def broadcast_inplace(
        self,
        variables: Sequence[tf.Variable],
        root_rank: int,
        name: str | None,
        process_set_id: int = 0,
    ) -> list[tf.Tensor]:
        """Overwrite ``variables`` with root's values; returns their new values."""

    @abc.abstractmethod
    def reducescatter(
        self,
        tensor: tf.Tensor,
        op: ReduceOp,
        name: str | None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set_id: int = 0,
    ) -> tf.Tensor: ...

    @abc.abstractmethod
    def grouped_reducescatter(
        self,
        tensors: Sequence[tf.Tensor],
        op: ReduceOp,
        name: str | None,
        prescale_factor: float = 1.0,
        postscale_factor: float = 1.0,
        process_set_id: int = 0,
    ) -> list[tf.Tensor]: ...

    @abc.abstractmethod
    def alltoall(
        self, tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None, process_set_id: int = 0
    ) -> tuple[tf.Tensor, tf.Tensor]:
        """Returns ``(received, received_splits)``."""

    @abc.abstractmethod
    def broadcast_object(self, obj: Any, root_rank: int, process_set_id: int = 0) -> Any: ...

    @abc.abstractmethod
    def allgather_object(self, obj: Any, process_set_id: int = 0) -> list[Any]: ...

    @abc.abstractmethod
    def join(self) -> tf.Tensor:
        """Mark this rank done; int32 scalar: the last rank that joined."""

    # ------------------------------------------------------------ introspection
    @abc.abstractmethod
    def topology_op(self, which: str, name: str | None) -> tf.Tensor:
        """int32 scalar op giving ``rank``/``size``/``local_rank``/``local_size`` when run."""

    @abc.abstractmethod
    def transport(self) -> str | None:
        """``"mpi"``, ``"gloo"`` or ``None`` (no transport: a local job)."""

    @abc.abstractmethod
    def mpi_threads_supported(self) -> bool: ...

    @abc.abstractmethod
    def is_homogeneous(self) -> bool: ...

    @abc.abstractmethod
    def start_timeline(self, file_path: str, mark_cycles: bool) -> None: ...

    @abc.abstractmethod
    def stop_timeline(self) -> None: ...
