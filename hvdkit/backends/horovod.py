"""Horovod backend: the only module in hvdkit that uses Horovod's collectives.

Three other modules import Horovod's launcher side, never its collectives:
``_compat`` (the Gloo rendezvous server classes and the ``gloo_run`` hook),
``launch/guarded_horovodrun.py`` (horovodrun's command line, with the
guarded rendezvous) and ``launch/scheduler.py`` (the rank layout record
Horovod's rendezvous serves). ``tests/unit/test_layering.py`` keeps this list.

Uses ``horovod.tensorflow`` (the TF collectives) and never
``horovod.tensorflow.keras``, whose optimizer wrapper does not work with
Keras 3 (see :mod:`hvdkit._compat`). Transport (MPI or Gloo) is whatever the
launcher chose; hvdkit does not care.

Importing this module never fails: without Horovod, :func:`build_flags`
reports nothing built and :class:`HorovodBackend` refuses to start.
"""

from __future__ import annotations

import itertools
import logging
import sys
from collections.abc import Callable, Sequence
from typing import Any

import tensorflow as tf

from .. import _compat, config
from .._comm import graph_progress as _graph_progress
from .._comm import priority_trial as _priority_trial
from .._comm import sockets as _sockets
from .._comm import threads as _threads
from ..clusters import slurm as _slurm
from ..errors import CollectiveError, ConfigurationError
from .base import Backend, ReduceOp

try:
    import horovod.tensorflow as hvd
except ImportError as exc:  # pragma: no cover - depends on the installation
    hvd = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

_barrier_ids = itertools.count()
# What hvd.init() raises when Horovod's background thread failed to start. With
# hvdkit's patch (hvdkit/patches/horovod-0.28.1-init-failure-raises.patch) that
# includes a peer lost while the Gloo contexts connect; unpatched, Horovod 0.28.1
# aborts the process instead (std::terminate on the uncaught gloo::IoException).
_INIT_FAILED = "Horovod initialization failed"
BUILD_FLAGS = ("mpi", "gloo", "nccl", "ccl", "cuda", "rocm", "ddl")


def build_flags() -> dict[str, int]:
    """What the installed Horovod was compiled with (works before and without ``init``).

    ``nccl`` is NCCL's version code (0 when not built), the others 0 or 1,
    as Horovod's ``*_built()`` functions return them. All 0 when Horovod is
    not installed.
    """
    if hvd is None:
        return dict.fromkeys(BUILD_FLAGS, 0)
    return {flag: int(getattr(hvd, f"{flag}_built")()) for flag in BUILD_FLAGS}


def _op(op: ReduceOp):
    return {
        ReduceOp.AVERAGE: hvd.Average,
        ReduceOp.SUM: hvd.Sum,
        ReduceOp.MIN: hvd.Min,
        ReduceOp.MAX: hvd.Max,
        ReduceOp.PRODUCT: hvd.Product,
        ReduceOp.ADASUM: hvd.Adasum,
    }[op]


def _reduction(op: ReduceOp, prescale_factor: float, postscale_factor: float) -> dict:
    """Horovod's keyword arguments of a reduction: its op and the two scale factors."""
    return {"op": _op(op), "prescale_factor": prescale_factor, "postscale_factor": postscale_factor}


def _by_dtype(tensors: Sequence[tf.Tensor], fn: Callable[[list], list]) -> list:
    """Apply a grouped Horovod op once per dtype (Horovod fuses one dtype per group)."""
    groups: dict[tf.DType, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    out: list = [None] * len(tensors)
    for indices in groups.values():
        for i, t in zip(indices, fn([tensors[i] for i in indices]), strict=True):
            out[i] = t
    return out


def _start(process_sets) -> None:
    """``hvd.init``; a failed start leaves Horovod ready for another ``init``.

    Raises:
        CollectiveError: Horovod could not start (a peer died or stopped
            answering while the ranks connected); its log line above says why.
    """
    try:
        hvd.init(process_sets=process_sets)
    except ValueError as exc:
        if _INIT_FAILED not in str(exc):
            raise
        hvd.shutdown()  # joins Horovod's ended thread and clears its started flag
        raise CollectiveError(
            "Horovod could not start: a peer died or stopped answering while the ranks "
            f"connected (within {config.GLOO_TIMEOUT}); Horovod's log line above says "
            f"what failed.{_given_layout()} In an elastic job the rank waits for the next world."
        ) from exc


def _given_layout() -> str:
    """The rank this process was started as (Horovod's Gloo launchers set it) and, under
    plain ``horovodrun --gloo``, the pitfall that gives every rank the same one
    (hvdkit._compat.HOROVODRUN_LAYOUT_VARIABLES); "" when the variables are not set."""
    rank, size = config.get(config.HOROVOD_RANK), config.get(config.HOROVOD_SIZE)
    if rank is None or size is None:
        return ""
    said = f" This process was started as rank {rank} of {size}."
    # hvdkitrun and a worker (both give the heartbeat address), srun's tasks: each rank's own
    set_per_rank = config.get(config.MONITOR_ADDR) or config.get(_slurm.STEP_NUM_TASKS)
    if set_per_rank or config.get(_slurm.CONTROLLER) != "gloo":
        return said
    return (
        f"{said[:-1]} ({config.HOROVOD_RANK}, {config.HOROVOD_SIZE}): if another rank says "
        "the same, these were set where horovodrun ran and override each rank's own; unset "
        "them (hvdkitrun leaves them out)."
    )


class HorovodBackend(Backend):
    """Collectives through Horovod's TensorFlow ops (MPI or Gloo)."""

    name = "horovod"

    def __init__(self, process_sets: list | None = None, dynamic: bool = False) -> None:
        if hvd is None:
            raise ConfigurationError(
                "hvdkit was launched as part of a multi-process job but Horovod is not "
                f"importable ({_IMPORT_ERROR}). Build it with `scripts/install.sh`, or run "
                f"without a launcher (or with {config.BACKEND}=local) for a single process."
            )
        setting = config.comm_priority()  # a bad value is refused before the job starts
        before, sockets_before = _threads.thread_ids(), _sockets.tcp_inodes()
        static = [hvd.ProcessSet(ranks) for ranks in process_sets or []]
        # "dynamic" makes Horovod set HOROVOD_DYNAMIC_PROCESS_SETS=1 itself, as its init does
        _start(process_sets="dynamic" if dynamic and not static else static)
        self.dynamic = dynamic or config.get(config.HOROVOD_DYNAMIC_PROCESS_SETS) == "1"
        self._sets = {0: hvd.global_process_set} | {ps.process_set_id: ps for ps in static}
        self._static_ids = [ps.process_set_id for ps in static]
        # Horovod's background thread and Gloo's socket loop, started by init
        self.comm_threads = _threads.started_since(before)
        # Gloo's connections to the other ranks; under MPI, Open MPI's own (to its daemon
        # too) are not ours to end
        gloo = hvd.gloo_enabled()
        self.comm_sockets = _sockets.opened_since(sockets_before) if gloo else set()
        self.comm_priority = "off"
        self._trial: _priority_trial.PriorityTrial | None = None
        self._favoured = False  # HVDKIT_COMM_PRIORITY=1 put comm_threads on SCHED_RR
        self._says_decision = hvd.rank() == 0  # (the trial's thread may end after shutdown)
        if setting is None:  # one machine: the allreduce never waits for a wire
            setting = "auto" if hvd.cross_size() > 1 else "0"
        if setting == "0":
            return
        if self.transport() != "gloo":  # a polling real-time thread would starve the backward pass
            self.comm_priority = "off under MPI: its transport polls while it waits"
        elif setting == "1":
            self.comm_priority = _threads.favour(self.comm_threads)
            self._favoured = True
        else:
            self.comm_priority = "auto: trying Horovod's threads with and without SCHED_RR"
            self._trial = _priority_trial.PriorityTrial(
                _graph_progress.steps_done,
                favour=lambda: _threads.favour(self.comm_threads),
                unfavour=lambda: _threads.unfavour(self.comm_threads),
                report=self._decided,
            )
            self._trial.start()
        logging.getLogger("hvdkit").info(
            "%s=%s: %s", config.COMM_PRIORITY, setting, self.comm_priority
        )

    def _decided(self, line: str) -> None:
        """The priority trial's outcome: kept, logged, and said once by rank 0."""
        self.comm_priority = line
        logging.getLogger("hvdkit").info("%s: %s", config.COMM_PRIORITY, line)
        if self._says_decision:
            print(f"hvdkit: {config.COMM_PRIORITY} {line}", file=sys.stderr, flush=True)

    def process_set_ids(self) -> list[int]:
        return list(self._static_ids)

    def add_process_set(self, ranks: list[int]) -> int:
        ps = hvd.add_process_set(ranks)
        self._sets[ps.process_set_id] = ps
        return ps.process_set_id

    def remove_process_set(self, process_set_id: int) -> None:
        hvd.remove_process_set(self._sets.pop(process_set_id))

    def _in(self, process_set_id: int) -> dict:
        """Horovod's ``process_set=`` argument for the set ``process_set_id``."""
        return {"process_set": self._sets[process_set_id]}

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

    def barrier(self, process_set_id=0) -> None:
        # horovod.tensorflow 0.28 has no barrier(); an allreduce waits for all.
        hvd.allreduce(
            tf.zeros([1], tf.int32),
            op=hvd.Sum,
            name=f"hvdkit.barrier.{next(_barrier_ids)}",
            **self._in(process_set_id),
        )

    def abandon(self) -> int:
        """End the connections Horovod opened at init (see :meth:`Backend.abandon`)."""
        return _sockets.shut_down(self.comm_sockets)

    def shutdown(self) -> None:
        # Back to the normal policy first: Gloo's socket loops outlive hvd.shutdown()
        # (2 of the 3 threads init starts, seen in /proc), and an elastic job starts
        # new ones in every world.
        if self._trial is not None:
            self._trial.stop()
        elif self._favoured:
            _threads.unfavour(self.comm_threads)
        hvd.shutdown()

    def allreduce(
        self, tensor, op, name, prescale_factor=1.0, postscale_factor=1.0, process_set_id=0
    ):
        return hvd.allreduce(
            tensor,
            name=name,
            **_reduction(op, prescale_factor, postscale_factor),
            **self._in(process_set_id),
        )

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
        # A name is Horovod's tensor name (one per dtype group: name, name.1, ...);
        # without one Horovod names it after the tensors' graph names.
        index = itertools.count()
        if op is ReduceOp.ADASUM:
            # Horovod 0.28.1's grouped_allreduce(op=Adasum) fails in its own Python
            # (UnboundLocalError on `tensor`); one allreduce per tensor is the same
            # reduction (Adasum's dot products are per tensor, fused or not).
            return [
                self.allreduce(
                    t,
                    op,
                    None if name is None else f"{name}.{i}",
                    prescale_factor,
                    postscale_factor,
                    process_set_id,
                )
                for i, t in enumerate(tensors)
            ]

        def reduce(group):
            k = next(index)
            named = {}
            if name is not None:
                named = {
                    "name": f"{name}.{k}" if k else name,
                    "ignore_name_scope": ignore_name_scope,
                }
            return hvd.grouped_allreduce(
                group,
                **named,
                **_reduction(op, prescale_factor, postscale_factor),
                **self._in(process_set_id),
            )

        return _by_dtype(tensors, reduce)

    def allgather(self, tensor, name, process_set_id=0):
        return hvd.allgather(tensor, name=name, **self._in(process_set_id))

    def grouped_allgather(self, tensors, name, process_set_id=0):
        return _by_dtype(
            tensors, lambda group: hvd.grouped_allgather(group, **self._in(process_set_id))
        )

    def broadcast(self, tensor, root_rank, name, process_set_id=0):
        return hvd.broadcast(tensor, root_rank, name=name, **self._in(process_set_id))

    def broadcast_inplace(self, variables, root_rank, name, process_set_id=0):
        tf_vars = [_compat.tf_variable(v) for v in variables]
        return hvd.broadcast_(tf_vars, root_rank, name=name, **self._in(process_set_id))

    def reducescatter(
        self, tensor, op, name, prescale_factor=1.0, postscale_factor=1.0, process_set_id=0
    ):
        return hvd.reducescatter(
            tensor,
            name=name,
            **_reduction(op, prescale_factor, postscale_factor),
            **self._in(process_set_id),
        )

    def grouped_reducescatter(
        self, tensors, op, name, prescale_factor=1.0, postscale_factor=1.0, process_set_id=0
    ):
        return _by_dtype(
            tensors,
            lambda group: hvd.grouped_reducescatter(
                group,
                **_reduction(op, prescale_factor, postscale_factor),
                **self._in(process_set_id),
            ),
        )

    def alltoall(self, tensor, splits, name, process_set_id=0):
        if splits is None:
            # Horovod returns only the tensor without splits; the even split is
            # implied, so reconstruct the received splits ourselves.
            received = hvd.alltoall(tensor, name=name, **self._in(process_set_id))
            n = self._sets[process_set_id].size()
            rows = tf.shape(received, out_type=tf.int32)[0] // n
            return received, _compat.opaque_while_tracing(tf.fill([n], rows))
        received, received_splits = hvd.alltoall(
            tensor, splits=splits, name=name, **self._in(process_set_id)
        )
        return received, _compat.opaque_while_tracing(received_splits)

    def broadcast_object(self, obj: Any, root_rank: int, process_set_id=0) -> Any:
        return hvd.broadcast_object(obj, root_rank=root_rank, **self._in(process_set_id))

    def allgather_object(self, obj: Any, process_set_id=0) -> list[Any]:
        return hvd.allgather_object(obj, **self._in(process_set_id))

    def join(self):
        return hvd.join()

    def topology_op(self, which, name):
        return getattr(hvd, f"{which}_op")(name=name)

    def transport(self):
        if hvd.mpi_enabled():
            return "mpi"
        return "gloo" if hvd.gloo_enabled() else None

    def mpi_threads_supported(self):
        return bool(hvd.mpi_threads_supported())

    def is_homogeneous(self):
        return bool(hvd.is_homogeneous())

    def start_timeline(self, file_path, mark_cycles):
        hvd.start_timeline(file_path, mark_cycles=mark_cycles)

    def stop_timeline(self):
        hvd.stop_timeline()
