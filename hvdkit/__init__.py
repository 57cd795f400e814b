"""hvdkit: data-parallel training for TensorFlow 2 / Keras 3 on Horovod.

A Horovod user's script needs only its import changed::

    import hvdkit as hvd          # was: import horovod.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(ds, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

Without a launcher the same script runs as a job of size 1.

Names are loaded on first use, so that ``hvdkitrun`` and the scheduler, which
need no TensorFlow, start in a fraction of a second. ``import hvdkit`` does one
more thing: it tells Keras (now, or once Keras is imported) where to find
``DistributedOptimizer``, so that ``keras.models.load_model`` reads files saved
with it (:mod:`hvdkit.keras._registry`).
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING

from .keras import _registry as _keras_registry

__version__ = "0.1.0"

# public name -> module that defines it (a name equal to its module is the module)
_EXPORTS = {
    # runtime (init itself is defined below: it wires the layers above runtime)
    "shutdown": "runtime",
    "is_initialized": "runtime",
    "rank": "runtime",
    "size": "runtime",
    "local_rank": "runtime",
    "local_size": "runtime",
    "cross_rank": "runtime",
    "cross_size": "runtime",
    "barrier": "runtime",
    "backend_name": "runtime",
    # collectives
    "ReduceOp": "collectives",
    "Average": "collectives",
    "Sum": "collectives",
    "Min": "collectives",
    "Max": "collectives",
    "Product": "collectives",
    "Adasum": "collectives",
    "allreduce": "collectives",
    "grouped_allreduce": "collectives",
    "allgather": "collectives",
    "grouped_allgather": "collectives",
    "broadcast": "collectives",
    "broadcast_": "collectives",
    "broadcast_variables": "collectives",
    "reducescatter": "collectives",
    "grouped_reducescatter": "collectives",
    "alltoall": "collectives",
    "neighbor_exchange": "collectives",
    "join": "collectives",
    "broadcast_object": "collectives",
    "allgather_object": "collectives",
    # Horovod's probes: build, transport, graph-time topology, timeline
    "mpi_built": "probes",
    "gloo_built": "probes",
    "nccl_built": "probes",
    "ccl_built": "probes",
    "cuda_built": "probes",
    "rocm_built": "probes",
    "ddl_built": "probes",
    "gpu_available": "probes",
    "mpi_enabled": "probes",
    "gloo_enabled": "probes",
    "mpi_threads_supported": "probes",
    "is_homogeneous": "probes",
    "rank_op": "probes",
    "size_op": "probes",
    "local_rank_op": "probes",
    "local_size_op": "probes",
    "start_timeline": "probes",
    "stop_timeline": "probes",
    # training
    "DistributedOptimizer": "optimizer",
    "DistributedGradientTape": "optimizer",
    "reduce_gradients": "optimizer",
    "PartialDistributedGradientTape": "partial",
    "PartialDistributedOptimizer": "partial",
    "Compression": "_comm.compression",
    "SyncBatchNormalization": "keras.sync_batch_norm",
    "load_model": "keras.saving",
    "save_model": "keras.saving",
    "callbacks": "keras.callbacks",
    "Checkpointer": "fault.checkpoint",
    # data, patch ops, sink mode
    "data": "data",
    "ops": "ops",
    "sink": "sink",
    "elastic": "fault.elastic",
    "preemption": "fault.preemption",
    "spark": "clusters.spark",
    "ray": "clusters.ray",
    # process sets
    "ProcessSet": "process_sets",
    "global_process_set": "process_sets",
    "add_process_set": "process_sets",
    "remove_process_set": "process_sets",
    "process_set_included_op": "process_sets",
    # errors
    "HvdkitError": "errors",
    "NotInitializedError": "errors",
    "CollectiveError": "errors",
    "CollectiveMismatchError": "errors",
    "ConfigurationError": "errors",
    "ShardingError": "errors",
    "DataFormatError": "errors",
    "LaunchError": "errors",
    "InputPipelineError": "errors",
    "NotSupportedError": "errors",
}

__all__ = ["init", *_EXPORTS, "__version__"]


def init(backend: str | None = None, **kwargs) -> None:
    """Start hvdkit: :func:`hvdkit.runtime.init` plus what the layers above it need.

    Takes the arguments of :func:`hvdkit.runtime.init`. After the runtime is up
    it registers :class:`DistributedOptimizer` with Keras, makes Keras's
    ``BackupAndRestore`` refuse jobs of several ranks (pointing at
    :class:`Checkpointer`), makes a Keras optimizer that updates weights no hvdkit
    reduction averaged say so (``HVDKIT_UNREDUCED_UPDATE``, docs/divergence.md)
    and, under ``hvdkitrun`` or a worker, starts the heartbeat the launcher
    watches for its stall timeout (in an elastic job before Horovod starts, so
    that a rank frozen in its first start is found too).

    With ``HVDKIT_ROLE`` or ``MS_ROLE`` set (MindSpore's flow: the same
    script started once as ``MS_SCHED`` and once per worker as ``MS_WORKER``)
    the process takes that role here and never returns: the scheduler runs
    the job's scheduler and exits with the job's status; a worker registers
    and runs this script again as its rank (:mod:`hvdkit.launch.inprocess`).

    Example:
        >>> import hvdkit
        >>> hvdkit.init()
        >>> hvdkit.rank(), hvdkit.size()   # (0, 1) without a launcher
        (0, 1)
    """
    from . import config

    started = sys.modules.get(f"{__name__}.runtime")  # None: not imported, so not started
    if started is None or not started.is_initialized():
        # Before TensorFlow is imported (runtime does): a launch that is set up
        # wrongly fails in a fraction of a second.
        role = config.role()
        if role is not None:
            from .launch.inprocess import take_role

            take_role(role)  # exits with the job's status
        from .clusters.slurm import join_srun_step

        join_srun_step()  # srun's tasks: over Gloo hvdkit starts Horovod's rendezvous
    from . import runtime
    from ._comm import meeting as _meeting
    from ._comm import progress as _progress

    first = not runtime.is_initialized()
    # In an elastic job the heartbeat starts before Horovod does: a rank frozen
    # as the job first starts (or as it joins) then falls silent to its worker,
    # which stops it at the stall timeout, and the others meet the next world
    # (runtime.init) instead of waiting for a rank nobody reports lost.
    elastic = first and _meeting.enabled() and config.get(config.MONITOR_ADDR)
    launched_rank = config.get_int(config.HOROVOD_RANK, -1) if elastic else -1
    early = launched_rank >= 0
    if early:
        from .launch.heartbeat import start_sender_from_env

        start_sender_from_env(launched_rank, status=_progress.status)
    runtime.init(backend, **kwargs)
    if not first:
        return
    try:
        from . import optimizer  # optimizer: registers the class with Keras
        from .keras import callbacks
    except ImportError:  # Keras 2: collectives still work, the optimizer does not
        pass
    else:
        from .keras import _update_check

        callbacks.refuse_backup_and_restore()
        optimizer.route_loss_scaling()  # the one patch of Keras (hvdkit._compat)
        _update_check.install()  # Optimizer.apply: weights updated with no reduction
    if early:
        _progress.rank_changed(runtime.rank())  # a failed first start may renumber it
    elif config.get(config.MONITOR_ADDR):
        from .launch.heartbeat import start_sender_from_env

        start_sender_from_env(runtime.rank(), status=_progress.status)
    elif runtime.size() > 1:  # plain horovodrun/mpirun: at least warn about a long wait
        from .launch.heartbeat import stall_timeout

        _progress.start_watchdog(stall_timeout(), runtime.rank())


# Horovod's private names that its own test files call through `hvd.`; not public here.
_HOROVOD_PRIVATE = {"_executing_eagerly": "probes"}


def __getattr__(name: str):
    module_name = _EXPORTS.get(name) or _HOROVOD_PRIVATE.get(name)
    if module_name is None:
        raise AttributeError(f"module 'hvdkit' has no attribute {name!r}")
    module = importlib.import_module(f".{module_name}", __name__)
    value = module if module_name.rpartition(".")[2] == name else getattr(module, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


_keras_registry.install()


if TYPE_CHECKING:  # for type checkers and IDEs; at run time names load lazily
    from . import data, ops, sink
    from ._comm.compression import Compression
    from .clusters import ray, spark
    from .collectives import (
        Adasum,
        Average,
        Max,
        Min,
        Product,
        ReduceOp,
        Sum,
        allgather,
        allgather_object,
        allreduce,
        alltoall,
        broadcast,
        broadcast_,
        broadcast_object,
        broadcast_variables,
        grouped_allgather,
        grouped_allreduce,
        grouped_reducescatter,
        join,
        neighbor_exchange,
        reducescatter,
    )
    from .errors import (
        CollectiveError,
        CollectiveMismatchError,
        ConfigurationError,
        DataFormatError,
        HvdkitError,
        InputPipelineError,
        LaunchError,
        NotInitializedError,
        NotSupportedError,
        ShardingError,
    )
    from .fault import elastic, preemption
    from .fault.checkpoint import Checkpointer
    from .keras import callbacks
    from .keras.saving import load_model, save_model
    from .keras.sync_batch_norm import SyncBatchNormalization
    from .optimizer import DistributedGradientTape, DistributedOptimizer, reduce_gradients
    from .partial import PartialDistributedGradientTape, PartialDistributedOptimizer
    from .probes import (
        ccl_built,
        cuda_built,
        ddl_built,
        gloo_built,
        gloo_enabled,
        gpu_available,
        is_homogeneous,
        local_rank_op,
        local_size_op,
        mpi_built,
        mpi_enabled,
        mpi_threads_supported,
        nccl_built,
        rank_op,
        rocm_built,
        size_op,
        start_timeline,
        stop_timeline,
    )
    from .process_sets import (
        ProcessSet,
        add_process_set,
        global_process_set,
        process_set_included_op,
        remove_process_set,
    )
    from .runtime import (
        backend_name,
        barrier,
        cross_rank,
        cross_size,
        is_initialized,
        local_rank,
        local_size,
        rank,
        shutdown,
        size,
    )
