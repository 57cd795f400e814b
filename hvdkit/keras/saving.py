"""Loading a Keras model for data-parallel training (Horovod's ``hvd.load_model``).

``keras.models.load_model`` alone already round-trips a model compiled with
``DistributedOptimizer`` once hvdkit is imported (:mod:`hvdkit.keras._registry`).
:func:`load_model` also takes a file saved by plain Keras, one process, and
makes sure the optimizer it returns averages gradients, keeping the loaded
optimizer state, so that training resumes where the file left off.
"""

from __future__ import annotations

import os

import keras

from .. import collectives, runtime
from .._comm.compression import Compressor
from ..errors import ConfigurationError
from ..optimizer import DistributedOptimizer
from ._registry import REGISTERED_NAME

__all__ = ["load_model", "save_model"]

_LSO = keras.optimizers.LossScaleOptimizer


def save_model(model: keras.Model, filepath: str | os.PathLike, root_rank: int = 0, **kwargs):
    """Save ``model`` from ``root_rank`` only; return on every rank once the file is complete.

    The pattern "save on one rank, load on all" without a race: call it on
    every rank (it is a collective), then load on every rank. Rank
    ``root_rank`` writes a temporary file beside ``filepath`` and renames it,
    so no rank ever reads a half-written file; a failure to save raises the
    same error on every rank. The ranks must see one filesystem at
    ``filepath`` (one machine, or a shared one); otherwise only ``root_rank``
    has the file and the others should receive weights by broadcast instead.

    Args:
        model: the model (every rank passes its own; ``root_rank``'s is saved).
        filepath: a ``.keras`` path (or any path ``model.save`` accepts).
        root_rank: the rank that writes.
        **kwargs: passed to ``model.save``.

    Example:
        >>> hvdkit.save_model(model, "my_model.keras")     # on every rank
        >>> model = hvdkit.load_model("my_model.keras")    # on every rank: the file is there
    """
    failure = None
    if runtime.rank() == root_rank:
        path = os.fspath(filepath)
        folder, name = os.path.split(os.path.abspath(path))
        stem, ext = os.path.splitext(name)
        tmp = os.path.join(folder, f".{stem}.tmp-{os.getpid()}{ext}")  # keeps the suffix
        try:
            model.save(tmp, **kwargs)
            os.replace(tmp, path)
        except Exception as exc:  # every rank learns of it below, instead of waiting
            failure = f"{type(exc).__name__}: {exc}"
            if os.path.exists(tmp):
                os.remove(tmp)
    failure = collectives.broadcast_object(failure, root_rank)
    if failure is not None:
        raise ConfigurationError(
            f"save_model: rank {root_rank} could not save {os.fspath(filepath)!r} ({failure}); "
            "fix the path or the model and call it again on every rank."
        )


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
    # in a scope too: Keras deserializes the compile config without our custom_objects,
    # and a script may have emptied the global registry (the Keras saving guide does)
    objects.setdefault(REGISTERED_NAME, DistributedOptimizer)
    with keras.saving.CustomObjectScope(objects):
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
