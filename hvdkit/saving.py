"""Loading a Keras model for data-parallel training (Horovod's ``hvd.load_model``).

``keras.models.load_model`` alone already round-trips a model compiled with
``DistributedOptimizer`` once hvdkit is imported (:mod:`hvdkit._keras_registry`).
:func:`load_model` also takes a file saved by plain Keras, one process, and
makes sure the optimizer it returns averages gradients, keeping the loaded
optimizer state, so that training resumes where the file left off.
"""

from __future__ import annotations

import os

import keras

from .compression import Compressor
from .errors import ConfigurationError
from .optimizer import DistributedOptimizer

__all__ = ["load_model"]

_LSO = keras.optimizers.LossScaleOptimizer


def load_model(
    filepath: str | os.PathLike,
    custom_optimizers: list[type] | None = None,
    custom_objects: dict | None = None,
    compression: type[Compressor] | None = None,
    **kwargs,
) -> keras.Model:
    """Load a ``.keras`` model whose optimizer averages gradients over all ranks.

    Horovod's ``load_model``, for Keras 3. The file may come from hvdkit (its
    ``DistributedOptimizer`` and settings are restored as saved) or from plain
    Keras (its optimizer, with its loaded state, is wrapped in a
    ``DistributedOptimizer``; a ``LossScaleOptimizer`` keeps its loss scale).
    A model saved without an optimizer (``compile=False``, or never compiled)
    is returned as it is.

    Args:
        filepath: the ``.keras`` file.
        custom_optimizers: optimizer classes the file names that Keras does not
            know (Horovod's argument); they are added to ``custom_objects``.
        custom_objects: as in ``keras.models.load_model``.
        compression: ``hvdkit.Compression.none`` / ``.fp16`` for the gradient
            allreduce; ``None`` (default) keeps a saved hvdkit setting, else
            none. (Horovod's default is ``Compression.none``, which here would
            override a saved ``fp16``.)
        **kwargs: passed to ``keras.models.load_model`` (``compile``, ``safe_mode``).

    Returns:
        The model; ``model.optimizer`` is a ``DistributedOptimizer`` (or a
        ``LossScaleOptimizer`` around one).

    Example:
        >>> model = hvdkit.load_model("checkpoint.keras")  # on every rank
        >>> model.fit(x_mine, y_mine, epochs=10, initial_epoch=5)  # averages gradients
    """
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        if not isinstance(cls, type):
            raise ConfigurationError(
                f"load_model: custom_optimizers must list optimizer classes; got {cls!r}. "
                "Pass e.g. custom_optimizers=[MyOptimizer]."
            )
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects, **kwargs)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        return model
    dist = optimizer.inner_optimizer if isinstance(optimizer, _LSO) else optimizer
    if isinstance(dist, DistributedOptimizer):
        if compression is not None:
            dist.compression = compression  # read when the train step is traced
        return model
    _recompile_distributed(model, optimizer, compression)
    return model


def _recompile_distributed(model: keras.Model, optimizer, compression) -> None:
    """Compile ``model`` again as saved, with its loaded ``optimizer`` wrapped."""
    settings = {} if compression is None else {"compression": compression}
    if isinstance(optimizer, _LSO):
        wrapped = _LSO(
            DistributedOptimizer(optimizer.inner_optimizer, **settings),
            initial_scale=optimizer.initial_scale,
            dynamic_growth_steps=optimizer.dynamic_growth_steps,
            name=optimizer.name,
        )
    else:
        wrapped = DistributedOptimizer(optimizer, **settings)
    config = keras.saving.deserialize_keras_object(model.get_compile_config())
    config["optimizer"] = wrapped
    model.compile(**config)
    if isinstance(optimizer, _LSO) and optimizer.built:
        wrapped.build(model.trainable_variables)
        wrapped.step_counter.assign(optimizer.step_counter)
        wrapped.dynamic_scale.assign(optimizer.dynamic_scale)
