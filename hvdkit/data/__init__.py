"""Input pipelines for data-parallel training: every rank reads its own share.

* :func:`shard_indices`: which sample indices shard ``r`` of ``S`` reads
  (modes ``"pad"``, ``"drop"``, ``"uneven"``; shuffled per epoch);
  :func:`shard_weights`: which of them pad mode repeats (weight 0).
* :func:`shard`: the same for a list of files (file-level first), arrays, a
  reader or a ``tf.data.Dataset``, as a ``tf.data.Dataset``.
* :class:`ShardSampler` / :class:`ShardPositionCallback`: epochs and a
  resumable position inside an epoch.
* :func:`MnistDataset`, :func:`Cifar10Dataset` and their random-access
  :class:`MnistReader`, :class:`Cifar10Reader`: MindSpore-style readers
  with MindSpore's defaults (every split present, shuffled anew on every
  pass, all records unless asked to shard; ``num_shards="auto"``: this
  job's shard; ``num_samples`` per shard).
* :func:`get_dataset_size`: batches in a dataset (MindSpore's ``get_dataset_size()``).
* :func:`unshard`: every rank's results (``model.predict`` on its shard) back
  in dataset order, on every rank.

Example, on each of 2 ranks::

    import hvdkit as hvd
    hvd.init()
    ds = hvd.data.MnistDataset(DATA_PATH, "train", num_shards="auto")  # rank 0: 30,000
    ds = ds.batch(32)                                         # rank 1: the other 30,000
"""

from .readers import Cifar10Dataset, Cifar10Reader, MnistDataset, MnistReader
from .sampler import ShardPositionCallback, ShardSampler
from .sharding import MODES, ShardingWarning, shard, shard_indices, shard_weights
from .size import get_dataset_size
from .unshard import unshard

__all__ = [
    "MODES",
    "ShardingWarning",
    "shard_indices",
    "shard_weights",
    "shard",
    "ShardSampler",
    "ShardPositionCallback",
    "MnistReader",
    "Cifar10Reader",
    "MnistDataset",
    "Cifar10Dataset",
    "get_dataset_size",
    "unshard",
]
