"""Layers kept local to each rank: Horovod's ``PartialDistributedGradientTape`` and
``PartialDistributedOptimizer``.

The gradients of the ``local_layers``' trainable variables are not reduced:
each rank applies its own (by default divided by the number of ranks, as
Horovod does, so that a rank's step on its local layer has the size of a
share of the averaged step). Every other gradient goes out in the same
buckets as :class:`~hvdkit.DistributedGradientTape`'s.

Example (a per-rank head on a shared body)::

    >>> with tf.GradientTape() as tape:
    ...     loss = loss_fn(y, model(x, training=True))
    >>> tape = hvdkit.PartialDistributedGradientTape(tape, local_layers=[model.layers[-1]])
    >>> grads = tape.gradient(loss, model.trainable_variables)
    >>> opt.apply(grads, model.trainable_variables)   # the head trains on this rank's data

With ``model.fit``, the optimizer does the same::

    >>> opt = hvdkit.PartialDistributedOptimizer(keras.optimizers.SGD(0.1),
    ...                                          local_layers=[model.layers[-1]])
    >>> model.compile(optimizer=opt, loss="mse")
"""

from __future__ import annotations

import keras
import tensorflow as tf

from . import process_sets, runtime
from ._autograph import not_converted
from ._comm import updates as _updates
from .backends import ReduceOp
from .errors import ConfigurationError
from .optimizer import DistributedGradientTape, DistributedOptimizer, reduce_gradients

__all__ = ["PartialDistributedGradientTape", "PartialDistributedOptimizer"]


def _layers(local_layers, what: str = "PartialDistributedGradientTape") -> list:
    """``local_layers`` as a list of Keras layers (``None``: none, one layer: that one)."""
    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        return [local_layers]
    if isinstance(local_layers, (str, bytes)) or not hasattr(local_layers, "__iter__"):
        bad = [local_layers]
    else:
        local_layers = list(local_layers)
        bad = [x for x in local_layers if not isinstance(x, keras.layers.Layer)]
    if bad:
        raise ConfigurationError(
            f"{what}: local_layers must be Keras layers; got "
            f"{', '.join(type(x).__name__ for x in bad)}. Pass e.g. "
            "local_layers=[model.layers[-1]]."
        )
    return local_layers


class PartialDistributedGradientTape(DistributedGradientTape):
    """A :class:`~hvdkit.DistributedGradientTape` that leaves some layers' gradients local.

    Args:
        tape: the ``tf.GradientTape`` that recorded the forward pass.
        local_layers: a Keras layer or a list of them whose trainable
            variables' gradients are not reduced (Horovod's argument).
        scale_local_gradients: divide the local gradients by the number of
            ranks that reduce (the job, or ``process_set``), as Horovod does
            by default.
        **kwargs: :class:`~hvdkit.DistributedGradientTape`'s arguments
            (``op``, ``compression``, ``process_set``, ...).

    Raises:
        ConfigurationError: an entry of ``local_layers`` is not a Keras layer;
            at ``gradient()``, a local layer none of whose variables is among
            the sources (it is not part of the model being trained).
    """

    def __init__(
        self,
        tape: tf.GradientTape,
        *,
        local_layers=None,
        scale_local_gradients: bool = True,
        **kwargs,
    ):
        super().__init__(tape, **kwargs)
        self._local_layers = _layers(local_layers)
        self._local_sources: list = []  # register_local_source's variables
        self.scale_local_gradients = scale_local_gradients

    def register_local_source(self, source) -> None:
        """Keep ``source``'s gradient local too (Horovod's method)."""
        self._local_sources.append(source)

    def _local_ids(self, sources: list) -> set[int]:
        """Ids of the sources whose gradients stay local; checks every local layer is there."""
        present = {id(s) for s in sources}
        for layer in self._local_layers:
            # read now, not at construction: a layer is built at its first call
            ids = {id(v) for v in layer.trainable_variables}
            if not ids & present:
                raise ConfigurationError(
                    f"PartialDistributedGradientTape: local layer {layer.name!r} has no "
                    "trainable variable among the sources passed to gradient(); pass layers "
                    "of the model being trained (e.g. model.layers[-1]), built by a first call."
                )
        local = {id(v) for layer in self._local_layers for v in layer.trainable_variables}
        return local | {id(s) for s in self._local_sources}

    @not_converted
    def gradient(self, target, sources, output_gradients=None, **kwargs):
        """Like ``tf.GradientTape.gradient``; shared gradients reduced, local ones kept."""
        grads = self._tape.gradient(target, sources, output_gradients=output_gradients, **kwargs)
        flat, variables = tf.nest.flatten(grads), tf.nest.flatten(sources)
        local = self._local_ids(variables)
        _updates.mark_local(v for v in variables if id(v) in local)  # not the unreduced mistake
        shared = [i for i, v in enumerate(variables) if id(v) not in local]
        reduced = reduce_gradients(
            [flat[i] for i in shared],
            variables=[variables[i] for i in shared],
            **self._reduce_kwargs,
        )
        out = list(flat)
        for i, g in zip(shared, reduced, strict=True):
            out[i] = g
        if self.scale_local_gradients:
            n = self._reducing_ranks()
            for i, v in enumerate(variables):
                if id(v) in local and out[i] is not None and n > 1:
                    out[i] = _divide(out[i], n)
        return tf.nest.pack_sequence_as(grads, out)

    @not_converted
    def get_local_and_global_gradients(self, target, sources, output_gradients=None):
        """``(local [(source, grad)], global [(source, grad)])`` (Horovod's method)."""
        grads = self.gradient(target, sources, output_gradients)
        variables = tf.nest.flatten(sources)
        local = self._local_ids(variables)
        pairs = list(zip(variables, tf.nest.flatten(grads), strict=True))
        return [p for p in pairs if id(p[0]) in local], [p for p in pairs if id(p[0]) not in local]

    def _reducing_ranks(self) -> int:
        ps = process_sets.resolve(
            self._reduce_kwargs["process_set"], "PartialDistributedGradientTape", member=False
        )
        return len(ps.ranks) if ps.process_set_id else runtime.size()


@keras.saving.register_keras_serializable(package="hvdkit", name="PartialDistributedOptimizer")
class PartialDistributedOptimizer(DistributedOptimizer):
    """A :class:`~hvdkit.DistributedOptimizer` that leaves some layers' gradients local.

    Horovod's ``PartialDistributedOptimizer`` (``horovod.keras``): the
    gradients of ``local_layers``' trainable variables, and of variables
    passed to :meth:`register_local_var`, are not reduced; each rank applies
    its own, divided by the number of ranks that reduce unless
    ``scale_local_gradients=False``. Every other gradient is reduced as by
    :class:`~hvdkit.DistributedOptimizer`.

    Args:
        optimizer, name: as :class:`~hvdkit.DistributedOptimizer`.
        local_layers: a Keras layer or a list of them.
        scale_local_gradients: divide the local gradients by the number of
            ranks (the job, or ``process_set``), as Horovod by default.
        **kwargs: :class:`~hvdkit.DistributedOptimizer`'s other arguments;
            ``op`` only ``Average`` or ``Sum`` (as Horovod).

    The local layers are not saved with the model (as ``process_set``): pass
    them again after loading.

    Raises:
        ConfigurationError: an entry of ``local_layers`` is not a Keras layer,
            or ``op`` is not Average or Sum.
    """

    def __init__(
        self,
        optimizer,
        name: str | None = None,
        *,
        local_layers=None,
        scale_local_gradients: bool = True,
        **kwargs,
    ):
        op = kwargs.get("op", ReduceOp.AVERAGE)
        if op not in (ReduceOp.AVERAGE, ReduceOp.SUM):
            raise ConfigurationError(
                f"PartialDistributedOptimizer: op={op!r}; only hvdkit.Average and hvdkit.Sum "
                "(as Horovod). Use DistributedOptimizer for Adasum."
            )
        super().__init__(optimizer, name, **kwargs)
        self._local_layers = _layers(local_layers, "PartialDistributedOptimizer")
        self._local_vars: list = []
        self.scale_local_gradients = scale_local_gradients

    def register_local_var(self, var) -> None:
        """Keep ``var``'s gradient local too (Horovod's method)."""
        self._local_vars.append(var)

    @not_converted
    def reduce(self, grads, variables=None):
        """Reduce the shared gradients; the local ones stay (scaled) as they are."""
        if self._skip_reduce or variables is None:
            return super().reduce(grads, variables)
        grads, variables = list(grads), list(variables)
        local = {id(v) for layer in self._local_layers for v in layer.trainable_variables}
        local |= {id(v) for v in self._local_vars}
        _updates.mark_local(v for v in variables if id(v) in local)  # left out of fingerprints
        shared = [i for i, v in enumerate(variables) if id(v) not in local]
        reduced = super().reduce([grads[i] for i in shared], [variables[i] for i in shared])
        out = list(grads)
        for i, g in zip(shared, reduced, strict=True):
            out[i] = g
        ps = process_sets.resolve(self.process_set, "PartialDistributedOptimizer", member=False)
        n = len(ps.ranks) if ps.process_set_id else runtime.size()
        if self.scale_local_gradients and n > 1:
            for i, v in enumerate(variables):
                if id(v) in local and out[i] is not None:
                    out[i] = _divide(out[i], n)
        return out

    def get_config(self):
        return {**super().get_config(), "scale_local_gradients": self.scale_local_gradients}


def _divide(grad, n: int):
    if isinstance(grad, tf.IndexedSlices):
        return tf.IndexedSlices(grad.values / n, grad.indices, grad.dense_shape)
    return grad / tf.cast(n, grad.dtype)
