"""How many elements a dataset has: MindSpore's ``dataset.get_dataset_size()``."""

from __future__ import annotations

import tensorflow as tf

from ..errors import ConfigurationError

__all__ = ["get_dataset_size"]


def get_dataset_size(dataset: tf.data.Dataset) -> int:
    """Elements in one pass over ``dataset``: after ``.batch(...)``, the number of batches.

    MindSpore's ``dataset.get_dataset_size()``, for a ``tf.data.Dataset``.
    When TensorFlow knows the length (``dataset.cardinality()``) that is the
    answer; when it does not (after ``filter``, for example), the dataset is
    read once to count, as MindSpore does.

    Args:
        dataset: a finite ``tf.data.Dataset``.

    Returns:
        The number of elements, an int ``>= 0``.

    Raises:
        ConfigurationError: ``dataset`` is not a ``tf.data.Dataset``, or it
            repeats forever.

    Example:
        >>> ds = hvdkit.data.MnistDataset(DATA_PATH, "train", num_shards="auto").batch(32)
        >>> steps = hvdkit.data.get_dataset_size(ds)   # 938 on each of 2 ranks (60,000 images)
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigurationError(
            f"get_dataset_size needs a tf.data.Dataset; got {type(dataset).__name__}."
        )
    n = int(dataset.cardinality())
    if n == int(tf.data.INFINITE_CARDINALITY):
        raise ConfigurationError(
            "get_dataset_size: the dataset repeats forever (cardinality INFINITE), so it has "
            "no size; ask before .repeat(), or use .take(n)."
        )
    if n == int(tf.data.UNKNOWN_CARDINALITY):
        n = int(dataset.reduce(tf.constant(0, tf.int64), lambda count, _: count + 1))
    return n
