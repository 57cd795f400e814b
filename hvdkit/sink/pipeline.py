"""The input side of a sink: staging batches on the device, repeating, equal lengths.

MindSpore's *data sink* is :func:`prefetch_to_device`. A sink traverses its
dataset endlessly (:func:`endless`), and every rank must have as many batches
as every other (:func:`agreed_length`).
"""

from __future__ import annotations

import weakref
from typing import Any

import tensorflow as tf

from .. import collectives, runtime
from .._validate import check_int
from ..errors import ConfigurationError, ShardingError

INFINITE = int(tf.data.INFINITE_CARDINALITY)
UNKNOWN = int(tf.data.UNKNOWN_CARDINALITY)

# Datasets made by prefetch_to_device -> (source, device, buffer_size), so a
# sink can put its .repeat() before the device stage, which must stay last.
_STAGED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prefetch_to_device(
    dataset: tf.data.Dataset, device: str | None = None, buffer_size: int | None = None
) -> tf.data.Dataset:
    """Last stage of a tf.data pipeline: stage upcoming batches on ``device``.

    While a step runs, the next ``buffer_size`` batches are produced and, for
    a GPU, copied to it (TensorFlow's ``prefetch_to_device``, which is
    ``copy_to_device`` followed by ``prefetch``), so the copy overlaps with
    compute. For the CPU the batches already are where the step reads them
    and the stage is ``dataset.prefetch(buffer_size)``.

    Keep it last: a sink that needs to repeat the dataset rebuilds this stage
    after its ``.repeat()``.

    Args:
        dataset: the batched pipeline; elements keep their structure and shapes.
        device: ``"/gpu:0"``, ``"/cpu:0"``, ... ``None`` picks this process's
            GPU (``local_rank() % visible GPUs``; after ``hvdkit.init()``
            pinned one GPU per process that is ``/gpu:0``) when there is one,
            else the CPU.
        buffer_size: batches to stage (>= 1); ``None`` lets tf.data choose.

    Returns:
        A ``tf.data.Dataset`` with the same elements as ``dataset``.

    Raises:
        ConfigurationError: ``dataset`` is not a ``tf.data.Dataset``, ``device``
            is not a CPU or a visible GPU, or ``buffer_size`` is not a
            positive int.

    Example:
        >>> ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(32)
        >>> ds = hvdkit.sink.prefetch_to_device(ds)   # GPU if present, else CPU
        >>> next(iter(ds))[0].device                  # on a CPU-only machine
        '/job:localhost/replica:0/task:0/device:CPU:0'
    """
    check_dataset(dataset, "prefetch_to_device")
    if buffer_size is not None:
        buffer_size = check_int(
            "buffer_size",
            buffer_size,
            minimum=1,
            message=f"prefetch_to_device: buffer_size={buffer_size!r} must be a positive int "
            "(batches to stage), or None to let tf.data choose.",
        )
    target = _resolve_device(device)
    if tf.DeviceSpec.from_string(target).device_type == "CPU":
        staged = dataset.prefetch(tf.data.AUTOTUNE if buffer_size is None else buffer_size)
    else:  # pragma: no cover - needs a GPU
        staged = dataset.apply(tf.data.experimental.prefetch_to_device(target, buffer_size))
    _STAGED[staged] = (dataset, target, buffer_size)
    return staged


def _resolve_device(device: str | None) -> str:
    gpus = tf.config.list_logical_devices("GPU")
    if device is None:
        if not gpus:
            return "/device:CPU:0"
        local = runtime.local_rank() if runtime.is_initialized() else 0
        return gpus[local % len(gpus)].name
    try:
        spec = tf.DeviceSpec.from_string(device)
    except (TypeError, ValueError):
        spec = None
    kind = (spec.device_type or "").upper() if spec is not None else ""
    if kind not in ("CPU", "GPU"):
        raise ConfigurationError(
            f"prefetch_to_device: device={device!r} is not a CPU or GPU device name; "
            "use e.g. '/gpu:0' or '/cpu:0', or None for this process's GPU (else CPU)."
        )
    index = spec.device_index or 0
    if kind == "GPU" and index >= len(gpus):
        raise ConfigurationError(
            f"prefetch_to_device: device={device!r}, but this process sees "
            f"{len(gpus)} GPU(s) {[g.name for g in gpus]}; pass one of those, '/cpu:0', "
            "or device=None (hvdkit.init() pins one GPU per process as /gpu:0)."
        )
    return tf.DeviceSpec(device_type=kind, device_index=index).to_string()


def endless(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """``dataset`` repeated forever, cycling at its end, device stage kept last."""
    staged = _STAGED.get(dataset)
    if staged is not None:
        source, device, buffer_size = staged
        return prefetch_to_device(endless(source), device, buffer_size)
    if int(dataset.cardinality()) == INFINITE:
        return dataset
    return dataset.repeat()


def check_dataset(dataset: Any, what: str) -> None:
    if not isinstance(dataset, tf.data.Dataset):
        raise ConfigurationError(
            f"{what} needs a tf.data.Dataset of batches; got {type(dataset).__name__}. "
            "Wrap arrays as tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)."
        )


def describe_length(n: int) -> str:
    return {INFINITE: "infinite", UNKNOWN: "unknown"}.get(n, str(n))


def agreed_length(dataset: tf.data.Dataset, what: str) -> int:
    """This rank's number of batches, after checking that every rank has the same.

    Runs an allgather, so every rank must call it together.
    """
    n = int(dataset.cardinality())
    lengths = collectives.allgather_object(n) if runtime.size() > 1 else [n]
    if len(set(lengths)) > 1:
        listing = ", ".join(f"rank {r}: {describe_length(k)}" for r, k in enumerate(lengths))
        hint = ""
        if UNKNOWN in lengths:
            hint = (
                " Where the length is unknown (after filter(), for example), state it "
                "with dataset.apply(tf.data.experimental.assert_cardinality(n))."
            )
        raise ShardingError(
            f"{what}: the ranks' datasets have different numbers of batches ({listing}). "
            "Every rank must run the same number of steps per sink, or the ranks with "
            "more steps wait forever in the gradient allreduce. Give every rank an equal "
            "shard (hvdkit.data.shard or shard_indices with mode='pad' or 'drop') and "
            f"the same batch size.{hint}"
        )
    return n
