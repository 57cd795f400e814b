"""hvdkit: data-parallel training for TensorFlow 2 / Keras 3 on Horovod.

A Horovod user's script needs only its import changed::

    import hvdkit as hvd          # was: import horovod.tensorflow.keras as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size()))
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(ds, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])

Without a launcher the same script runs as a job of size 1.
"""

from . import callbacks
from .backends import ReduceOp
from .collectives import (
    Average,
    Max,
    Min,
    Product,
    Sum,
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
    neighbor_exchange,
    reducescatter,
)
from .compression import Compression
from .errors import (
    CollectiveError,
    CollectiveMismatchError,
    ConfigurationError,
    DataFormatError,
    HvdkitError,
    LaunchError,
    NotInitializedError,
    ShardingError,
)
from .optimizer import DistributedGradientTape, DistributedOptimizer, reduce_gradients
from .runtime import (
    backend_name,
    barrier,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
)

__version__ = "0.1.0"

__all__ = [
    # runtime
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "barrier",
    "backend_name",
    # collectives
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
    # training
    "DistributedOptimizer",
    "DistributedGradientTape",
    "reduce_gradients",
    "Compression",
    "callbacks",
    # errors
    "HvdkitError",
    "NotInitializedError",
    "CollectiveError",
    "CollectiveMismatchError",
    "ConfigurationError",
    "ShardingError",
    "DataFormatError",
    "LaunchError",
    "__version__",
]
