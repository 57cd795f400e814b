"""Horovod's probes: what was built, what runs, graph-time topology ops, the timeline.

Same names and meaning as ``horovod.tensorflow``, so Horovod code that checks
``hvd.gloo_enabled()`` or calls ``hvd.rank_op()`` runs unchanged. The build
probes describe the installed Horovod whatever backend runs; in a job of
size 1 (no launcher) no transport runs, so ``mpi_enabled()`` and
``gloo_enabled()`` are ``False``.

Example:
    >>> hvdkit.gloo_built(), hvdkit.mpi_built()    # this installation
    (True, True)
    >>> hvdkit.gloo_enabled()                     # under horovodrun --gloo
    True
"""

from __future__ import annotations

import tensorflow as tf

from . import runtime
from ._autograph import not_converted
from .backends import build_flags
from .errors import ConfigurationError

__all__ = [
    "mpi_built",
    "gloo_built",
    "nccl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "ddl_built",
    "gpu_available",
    "mpi_enabled",
    "gloo_enabled",
    "mpi_threads_supported",
    "is_homogeneous",
    "rank_op",
    "size_op",
    "local_rank_op",
    "local_size_op",
    "start_timeline",
    "stop_timeline",
]


# ------------------------------------------------------------------ build (no init needed)
def mpi_built() -> bool:
    """Whether the installed Horovod was compiled with MPI."""
    return bool(build_flags()["mpi"])


def gloo_built() -> bool:
    """Whether the installed Horovod was compiled with Gloo."""
    return bool(build_flags()["gloo"])


def nccl_built() -> int:
    """NCCL's version code if Horovod was compiled with NCCL, else 0 (as Horovod)."""
    return int(build_flags()["nccl"])


def ccl_built() -> bool:
    """Whether the installed Horovod was compiled with oneCCL."""
    return bool(build_flags()["ccl"])


def cuda_built() -> bool:
    """Whether the installed Horovod was compiled with CUDA."""
    return bool(build_flags()["cuda"])


def rocm_built() -> bool:
    """Whether the installed Horovod was compiled with ROCm."""
    return bool(build_flags()["rocm"])


def ddl_built() -> bool:
    """Whether the installed Horovod was compiled with IBM DDL."""
    return bool(build_flags()["ddl"])


def _executing_eagerly() -> bool:
    """Horovod's private helper (``hvd._executing_eagerly()`` in its tests): TF runs eagerly."""
    return tf.executing_eagerly()


def gpu_available(ext_base_name: str = "tensorflow", verbose: bool = False) -> bool:
    """Whether the framework ``ext_base_name`` runs with a GPU here (Horovod's function).

    For ``"tensorflow"``: TensorFlow sees a GPU. hvdkit serves TensorFlow
    only, so any other framework's name gives ``False``; ``verbose`` is
    accepted for Horovod's signature and prints nothing.
    """
    if ext_base_name != "tensorflow":
        return False
    return bool(tf.config.list_physical_devices("GPU"))


# ------------------------------------------------------------------ this job (after init)
def mpi_enabled() -> bool:
    """Whether this job's collectives run over MPI (``hvdkitrun``/``horovodrun --mpi``, ``mpirun``).

    Also true under ``hvdkitrun`` without a transport flag when its default
    rule picked MPI (docs/performance.md).
    """
    return runtime.backend().transport() == "mpi"


def gloo_enabled() -> bool:
    """Whether this job's collectives run over Gloo (``hvdkitrun``/``horovodrun --gloo``).

    Also true under ``hvdkitrun`` without a transport flag when its default
    rule picked Gloo, and under the scheduler/worker launch.
    """
    return runtime.backend().transport() == "gloo"


def mpi_threads_supported() -> bool:
    """Whether the MPI library allows other threads to call MPI (e.g. mpi4py).

    Raises:
        ConfigurationError: MPI does not run in this job (Gloo, or size 1);
            a ``ValueError``, as Horovod raises.
    """
    backend = runtime.backend()
    if backend.transport() != "mpi":
        raise ConfigurationError(
            "mpi_threads_supported() asks about MPI, but this job does not run over MPI "
            f"(transport: {backend.transport() or 'none, a job of size 1'}). Launch with "
            "horovodrun --mpi or mpirun, or check mpi_enabled() first."
        )
    return backend.mpi_threads_supported()


def is_homogeneous() -> bool:
    """Whether every machine of the job runs the same number of processes."""
    return runtime.backend().is_homogeneous()


def _topology_op(which: str, name: str | None) -> tf.Tensor:
    return runtime.backend().topology_op(which, name)


@not_converted
def rank_op(name: str | None = None) -> tf.Tensor:
    """int32 scalar op with :func:`hvdkit.rank`, read when the op runs, not when traced.

    Example:
        >>> tf.function(lambda: hvdkit.rank_op())()   # 0 or 1 in a 2-process job
    """
    return _topology_op("rank", name)


@not_converted
def size_op(process_set_id: int = 0, name: str | None = None) -> tf.Tensor:
    """int32 scalar op with :func:`hvdkit.size` (or the size of set ``process_set_id``).

    Horovod's signature; a string first argument is taken as ``name`` (hvdkit's
    earlier ``size_op(name)``).

    Example:
        >>> hvdkit.size_op(evens.process_set_id)   # int32 scalar: the set's size
    """
    if isinstance(process_set_id, str) and name is None:
        process_set_id, name = 0, process_set_id
    if process_set_id:
        from . import process_sets

        return process_sets.set_size_op(process_set_id, name)
    return _topology_op("size", name)


@not_converted
def local_rank_op(name: str | None = None) -> tf.Tensor:
    """int32 scalar op with :func:`hvdkit.local_rank`, read when the op runs."""
    return _topology_op("local_rank", name)


@not_converted
def local_size_op(name: str | None = None) -> tf.Tensor:
    """int32 scalar op with :func:`hvdkit.local_size`, read when the op runs."""
    return _topology_op("local_size", name)


# ------------------------------------------------------------------ timeline
def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Start writing Horovod's timeline (Chrome trace JSON) to ``file_path``.

    Needs ``HOROVOD_TIMELINE=DYNAMIC`` in the environment before
    :func:`hvdkit.init`, as Horovod does. Rank 0 writes the file. In a job of
    size 1 nothing communicates, so the file is an empty trace.

    Raises:
        ConfigurationError: ``HOROVOD_TIMELINE=DYNAMIC`` was not set.

    Example:
        >>> hvdkit.start_timeline("/tmp/timeline.json")
        >>> ...  # collectives to record
        >>> hvdkit.stop_timeline()
    """
    try:
        runtime.backend().start_timeline(str(file_path), bool(mark_cycles))
    except ConfigurationError:
        raise
    except ValueError as exc:  # Horovod's "Set HOROVOD_TIMELINE=DYNAMIC ..."
        raise ConfigurationError(
            f"start_timeline({str(file_path)!r}) failed: {exc} It must be in the environment "
            "before hvdkit.init() (horovodrun -x or export passes it to every rank)."
        ) from None


def stop_timeline() -> None:
    """Stop the timeline started by :func:`start_timeline` and close its file."""
    runtime.backend().stop_timeline()
