"""Size-1 backend: one process, no launcher, every collective is the identity.

"Identity" with Horovod's arithmetic: pre- and postscale factors are applied
the way Horovod's CPU kernels apply them (integers scaled in float64 and
truncated back), so a script gets the same numbers in a job of size 1 with or
without a launcher.
"""

from __future__ import annotations

import copy
from typing import Any

import tensorflow as tf

from .. import _compat, config
from ..errors import ConfigurationError
from .base import Backend


def _scale(tensor: tf.Tensor, factor: float) -> tf.Tensor:
    """``tensor * factor`` in Horovod's CPU precision, cast back to the tensor's dtype."""
    if factor == 1.0:
        return tf.identity(tensor)
    dtype = tensor.dtype
    if dtype == tf.float16 or dtype == tf.bfloat16:
        math = tf.float32
    elif dtype.is_floating:
        math = dtype
    else:
        math = tf.float64
    return tf.cast(tf.cast(tensor, math) * tf.constant(factor, math), dtype)


def _reduce(tensor: tf.Tensor, prescale: float, postscale: float) -> tf.Tensor:
    # Horovod scales before and after the reduction even in a job of size 1.
    return _scale(_scale(tensor, prescale), postscale)


class LocalBackend(Backend):
    """A job of one process. Lets the same script run with or without a launcher."""

    name = "local"

    def __init__(self, process_sets: list | None = None, dynamic: bool = False) -> None:
        # hvdkit.process_sets passes no set equal to the job; in a job of one
        # process every valid set is.
        self._static = list(range(1, 1 + len(process_sets or [])))
        self._next_id = 1 + len(self._static)
        self.dynamic = dynamic

    def process_set_ids(self) -> list[int]:
        return list(self._static)

    def add_process_set(self, ranks: list[int]) -> int:
        self._next_id += 1
        return self._next_id - 1

    def remove_process_set(self, process_set_id: int) -> None:
        return None

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1

    local_rank = cross_rank = rank
    local_size = cross_size = size

    def barrier(self, process_set_id=0) -> None:
        return None

    def shutdown(self) -> None:
        self._timeline = None

    def allreduce(
        self, tensor, op, name, prescale_factor=1.0, postscale_factor=1.0, process_set_id=0
    ):
        return _reduce(tensor, prescale_factor, postscale_factor)

    def grouped_allreduce(
        self,
        tensors,
        op,
        name,
        prescale_factor=1.0,
        postscale_factor=1.0,
        ignore_name_scope=False,
        process_set_id=0,
    ):
        return [_reduce(t, prescale_factor, postscale_factor) for t in tensors]

    def allgather(self, tensor, name, process_set_id=0):
        return tf.identity(tensor)

    def grouped_allgather(self, tensors, name, process_set_id=0):
        return [tf.identity(t) for t in tensors]

    def broadcast(self, tensor, root_rank, name, process_set_id=0):
        return tf.identity(tensor)

    def broadcast_inplace(self, variables, root_rank, name, process_set_id=0):
        return [tf.identity(_compat.tf_variable(v)) for v in variables]

    def reducescatter(
        self, tensor, op, name, prescale_factor=1.0, postscale_factor=1.0, process_set_id=0
    ):
        return _reduce(tensor, prescale_factor, postscale_factor)

    def grouped_reducescatter(
        self, tensors, op, name, prescale_factor=1.0, postscale_factor=1.0, process_set_id=0
    ):
        return [_reduce(t, prescale_factor, postscale_factor) for t in tensors]

    def alltoall(
        self, tensor: tf.Tensor, splits: tf.Tensor | None, name: str | None, process_set_id=0
    ) -> tuple[tf.Tensor, tf.Tensor]:
        rows = tf.shape(tensor, out_type=tf.int32)[:1]
        return tf.identity(tensor), rows

    def broadcast_object(self, obj: Any, root_rank: int, process_set_id=0) -> Any:
        # A real broadcast hands back a copy; keep that contract.
        return copy.deepcopy(obj)

    def allgather_object(self, obj: Any, process_set_id=0) -> list[Any]:
        return [copy.deepcopy(obj)]

    def join(self) -> tf.Tensor:
        return tf.constant(0, tf.int32)  # the only rank is the last to join

    def topology_op(self, which: str, name: str | None) -> tf.Tensor:
        value = {"rank": 0, "local_rank": 0, "size": 1, "local_size": 1}[which]
        return tf.constant(value, tf.int32, name=name)

    def transport(self) -> str | None:
        return None  # no MPI or Gloo runs in a job of one process

    def mpi_threads_supported(self) -> bool:
        return False  # no MPI runs here (the public function refuses, as Horovod does)

    def is_homogeneous(self) -> bool:
        return True  # one machine, one process

    _timeline: str | None = None

    def start_timeline(self, file_path: str, mark_cycles: bool) -> None:
        # Same precondition as Horovod, so a script fails the same way with and
        # without a launcher. No collective communicates in a job of one
        # process, so the trace has no events: an empty Chrome trace.
        if config.get(config.HOROVOD_TIMELINE) != "DYNAMIC":
            raise ConfigurationError(
                f"start_timeline needs {config.HOROVOD_TIMELINE}=DYNAMIC in the environment "
                "before hvdkit.init(); set it (horovodrun passes it to every rank)."
            )
        with open(file_path, "w") as f:
            f.write("[\n]\n")
        self._timeline = file_path

    def stop_timeline(self) -> None:
        self._timeline = None
