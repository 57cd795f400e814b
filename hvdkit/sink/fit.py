"""The Keras form of sink mode: :func:`train` (MindSpore's ``model.train`` with a sink)."""

from __future__ import annotations

import weakref
from typing import Any

import keras
import tensorflow as tf

from .. import _compat, runtime
from ..errors import ConfigurationError
from .loop import SinkLoop, check_sink_size
from .pipeline import agreed_length, check_dataset, describe_length, endless

# model -> (compile token, steps, jit_compile, SinkLoop): train() called once
# per epoch (a new shard each epoch) reuses the traced loop.
_KERAS_LOOPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _keras_loop(model: keras.Model, steps: int, jit: bool) -> SinkLoop:
    token = _compat.keras_compile_token(model)
    cached = _KERAS_LOOPS.get(model)
    if cached is not None and cached[0] is token and cached[1:3] == (steps, jit):
        return cached[3]
    model_ref = weakref.ref(model)  # the cache must not keep the model alive
    loop = SinkLoop(
        lambda data: model_ref().train_step(data),
        steps,
        jit_compile=jit,
        autograph=False,  # as Keras: train_step is plain TensorFlow code
        unpack=False,
        counted_from="since this train() call began",
    )
    _KERAS_LOOPS[model] = (token, steps, jit, loop)
    return loop


def train(
    model: keras.Model,
    epochs: int | None = None,
    dataset: tf.data.Dataset | None = None,
    callbacks: list[keras.callbacks.Callback] | None = None,
    dataset_sink_mode: bool = True,
    sink_size: int = -1,
    *,
    epoch: int | None = None,
    train_dataset: tf.data.Dataset | None = None,
    **fit_kwargs: Any,
) -> keras.callbacks.History:
    """Train a compiled Keras model in sink mode, with MindSpore's meaning of the arguments.

    In sink mode every epoch is **one sink**: one host call that runs its
    steps in a graph loop, so ``on_train_batch_*`` and ``on_epoch_*``
    callbacks, the progress bar and the epoch's logged loss come once per sink.

    * ``sink_size=-1``: an epoch (one sink) is the whole dataset, ``L`` steps.
    * ``sink_size=N > 0``: an epoch is ``N`` steps; the next epoch continues
      where the last stopped and the dataset cycles at its end, so epoch ``e``
      (0-based) trains on batches ``e*N .. e*N+N-1`` modulo ``L``.
    * ``dataset_sink_mode=False``: plain ``model.fit(dataset, epochs=...,
      callbacks=...)``; ``sink_size`` is ignored.

    It is ``model.fit(dataset.repeat(), epochs=epochs, steps_per_epoch=S,
    callbacks=callbacks, **fit_kwargs)`` with ``steps_per_execution=S``,
    where ``S`` is ``sink_size`` or ``L``, and with hvdkit's sink loop in
    place of Keras's for that call (it pins errors to a step and measures the
    wait for input); the model's ``steps_per_execution`` and compiled
    functions are restored afterwards. With validation data, evaluation also
    runs ``S`` steps per call.

    Every rank must call this together: the per-rank dataset lengths are
    compared (allgather) before training, in both modes.

    MindSpore's ``model.train(epoch, train_dataset, callbacks=...,
    dataset_sink_mode=..., sink_size=...)`` keeps its argument names:
    ``hvdkit.sink.train(model, epoch=10, train_dataset=ds, ...)`` is the same
    call as ``hvdkit.sink.train(model, 10, ds, ...)``. Unlike MindSpore 2.x
    (``dataset_sink_mode=False``), sink mode is the default here.

    Args:
        model: a compiled ``keras.Model`` (``run_eagerly=False``; in a job of
            several processes ``jit_compile=False``).
        epochs: as ``fit``'s: train until this epoch (with ``initial_epoch=``).
            MindSpore's name ``epoch=`` works too.
        dataset: a ``tf.data.Dataset`` of batches (``(x, y)`` or
            ``(x, y, sample_weight)``), finite or, with ``sink_size > 0``,
            infinite or of unknown length. MindSpore's name ``train_dataset=``
            works too.
        callbacks: Keras callbacks, as for ``fit``.
        dataset_sink_mode: ``True`` for sink mode.
        sink_size: ``-1`` (whole dataset per epoch) or steps per epoch (>= 1).
        **fit_kwargs: passed to ``fit`` (``verbose``, ``initial_epoch``,
            ``validation_data``, ...); not ``steps_per_epoch`` in sink mode.

    Returns:
        The ``History`` returned by ``fit``.

    Raises:
        ConfigurationError: the model is not compiled, runs eagerly or uses
            XLA in a multi-process job; ``sink_size`` is 0 or below -1;
            ``sink_size=-1`` with a dataset of infinite or unknown length;
            ``steps_per_epoch`` given in sink mode; ``epochs``/``dataset``
            missing, or given twice (once by MindSpore's name).
        ShardingError: the ranks' datasets have different numbers of batches.
        InputPipelineError: the input pipeline failed during training; the
            message names the step and quotes TensorFlow's error.

    Example:
        >>> model.compile(optimizer=hvdkit.DistributedOptimizer(opt), loss=loss)
        >>> hist = hvdkit.sink.train(model, 10, ds, callbacks=cbs, sink_size=100)
        >>> len(hist.history["loss"])   # one entry per sink = per epoch
        10
    """
    epochs = _one_of("epochs", epochs, "epoch", epoch)
    dataset = _one_of("dataset", dataset, "train_dataset", train_dataset)
    if not isinstance(model, keras.Model):
        raise ConfigurationError(f"train needs a keras.Model; got {type(model).__name__}.")
    if not getattr(model, "compiled", False):
        raise ConfigurationError(
            "train: the model is not compiled; call model.compile(optimizer=..., loss=...) first."
        )
    check_dataset(dataset, "train")
    sink_size = check_sink_size(
        sink_size, True, "use -1 (an epoch is the whole dataset) or a number of steps >= 1."
    )
    if dataset_sink_mode and "steps_per_epoch" in fit_kwargs:
        raise ConfigurationError(
            f"train: steps_per_epoch={fit_kwargs['steps_per_epoch']!r} conflicts with sink "
            f"mode, where an epoch is one sink of sink_size steps (sink_size={sink_size}). "
            "Pass sink_size=<steps per epoch> instead, or dataset_sink_mode=False."
        )
    length = agreed_length(dataset, "train")
    # A dataset brings its own order; Keras would warn that shuffle=True is ignored.
    fit_kwargs.setdefault("shuffle", False)
    if not dataset_sink_mode:
        return model.fit(dataset, epochs=epochs, callbacks=callbacks, **fit_kwargs)

    if model.run_eagerly:
        raise ConfigurationError(
            "train: the model was compiled with run_eagerly=True, but sink mode runs its "
            "steps in a graph loop. Compile with run_eagerly=False, or pass "
            "dataset_sink_mode=False to debug eagerly."
        )
    if sink_size > 0:
        steps = sink_size
    elif length > 0:
        steps = length
    else:
        raise ConfigurationError(
            f"train: sink_size=-1 makes an epoch the whole dataset, but its length is "
            f"{describe_length(length)}"
            + (" (it has no batches)" if length == 0 else "")
            + ". Pass sink_size=<steps per epoch>, or state a finite length with "
            "dataset.apply(tf.data.experimental.assert_cardinality(n))."
        )
    jit = bool(model.jit_compile)
    _compat.refuse_jit_in_job(
        "train: the model is compiled with",
        jit,
        runtime.size(),
        "Compile with model.compile(..., jit_compile=False).",
    )
    loop = _keras_loop(model, steps, jit)
    loop.reset_counters()
    loop.first_epoch = int(fit_kwargs.get("initial_epoch", 0))
    with _compat.keras_train_function(model, loop, steps):
        return model.fit(
            endless(dataset),
            epochs=epochs,
            steps_per_epoch=steps,
            callbacks=callbacks,
            **fit_kwargs,
        )


def _one_of(name: str, value: Any, alias: str, alias_value: Any) -> Any:
    """The argument given as ``name`` or as MindSpore's ``alias``; exactly one is required."""
    if value is not None and alias_value is not None:
        raise ConfigurationError(
            f"train: {name}={value!r} and {alias}={alias_value!r} are the same argument "
            f"({alias} is MindSpore's name for it); pass one of them."
        )
    if value is None and alias_value is None:
        raise ConfigurationError(f"train: pass {name} (or MindSpore's {alias}=).")
    return alias_value if value is None else value
