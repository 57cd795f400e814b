"""Batch normalization whose batch statistics cover the whole job (Horovod's name).

Horovod 0.28.1's ``SyncBatchNormalization`` subclasses ``tf.keras`` 2's layer
and overrides a method Keras 3 no longer has, so on Keras 3 it normalises each
rank's batch alone. This one is a Keras 3 layer.
"""

from __future__ import annotations

import keras
import tensorflow as tf

from .. import collectives, runtime
from .._comm import op_names as _op_names
from ..errors import ConfigurationError

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="hvdkit")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` with mean and variance over every rank's batch.

    In training, each rank's normalisation uses the mean and (biased)
    variance of the union of all ranks' batches, so 2 ranks with half a batch
    each get the same outputs and moving statistics as 1 process with the
    whole batch. Ranks may hold batches of different sizes: the statistics
    are weighted by row counts (Horovod averages per-rank moments equally,
    which is the same only for equal batches). Two small allreduces per call
    (counts and sums, then squared deviations from the job-wide mean: no
    cancellation as in ``E[x²] - E[x]²``). Inference uses the moving
    statistics and communicates nothing. In a job of size 1 it is Keras's
    layer. Every rank must call it the same number of times.

    Args:
        fused: Horovod's argument; only ``False`` (Horovod raises for
            ``True`` and ``None`` too).
        **kwargs: as ``keras.layers.BatchNormalization`` (``axis``,
            ``momentum``, ``epsilon``, ``center``, ``scale``, ...), except
            ``synchronized`` (Keras's own, for ``tf.distribute``) and
            ``renorm``.

    Example:
        >>> x = hvdkit.SyncBatchNormalization()(keras.layers.Dense(64)(inputs))
    """

    def __init__(self, fused: bool = False, **kwargs):
        if fused is not False:
            raise ConfigurationError(
                f"SyncBatchNormalization does not support fused={fused!r} (as Horovod); "
                "leave fused at its default False."
            )
        if kwargs.get("synchronized"):
            raise ConfigurationError(
                "SyncBatchNormalization already synchronises over hvdkit's job; "
                "synchronized=True is Keras's tf.distribute option. Drop it."
            )
        if kwargs.get("renorm"):
            raise ConfigurationError(
                "SyncBatchNormalization(renorm=True) is not supported; use renorm=False."
            )
        super().__init__(**kwargs)

    def _moments(self, inputs, mask):
        if runtime.size() == 1:
            return super()._moments(inputs, mask)
        axes = list(self._reduction_axes)
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            weights = tf.cast(tf.broadcast_to(mask[..., None], tf.shape(inputs)), inputs.dtype)
        count = tf.reduce_sum(weights, axis=axes)
        total = tf.reduce_sum(weights * inputs, axis=axes)
        count, total = tf.unstack(_job_sum(tf.stack([count, total])))
        # An all-masked job has count 0: keep Keras's epsilon guard for that case.
        denom = count if mask is None else count + keras.backend.epsilon()
        mean = total / denom
        shape = [1 if i in axes else -1 for i in range(len(inputs.shape))]
        squared = tf.reduce_sum(weights * tf.square(inputs - tf.reshape(mean, shape)), axis=axes)
        variance = _job_sum(squared) / denom
        return mean, variance


def _job_sum(x: tf.Tensor) -> tf.Tensor:
    """Sum of ``x`` over ranks, forward and backward under rank-stable Horovod names.

    Horovod's own gradient of an allreduce names its allreduce after the
    gradient tensor, whose name holds the layer's per-process Keras name; a rank
    that built one more layer first would wait forever (see hvdkit._comm.op_names).
    """
    name = _op_names.stable_name("sync_batch_norm")

    def job_sum(t, label):
        if name is None:  # eager: Horovod names eager calls itself
            return collectives.allreduce(t, op=collectives.Sum)
        return collectives.grouped_allreduce(
            [t], op=collectives.Sum, name=f"{name}.{label}", ignore_name_scope=True
        )[0]

    @tf.custom_gradient
    def summed(t):
        return job_sum(t, "forward"), lambda dy: job_sum(dy, "backward")

    return summed(x)
