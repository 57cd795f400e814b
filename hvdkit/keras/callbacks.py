"""Keras callbacks for data-parallel training (Horovod's names and meaning)."""

from __future__ import annotations

import logging

import keras
import numpy as np

from .. import collectives, runtime
from .._validate import is_number
from ..errors import ConfigurationError
from . import _job_metrics

__all__ = [
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "LearningRateWarmupCallback",
    "LearningRateScheduleCallback",
    "RankZeroOnly",
    "BestModelCheckpoint",
]

logger = logging.getLogger("hvdkit")


def _model_optimizer_variables(model) -> list:
    """Model weights plus optimizer state, building the optimizer if needed."""
    variables = list(model.weights)
    opt = getattr(model, "optimizer", None)
    if opt is not None:
        if not opt.built:
            opt.build(model.trainable_variables)
        variables += list(opt.variables)
    return variables


_SAID_LATE_BROADCAST = False  # the late-broadcast warning was given (rank 0, once a process)


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """Copy model weights *and* optimizer state from ``root_rank`` to all ranks.

    Runs once, before the first training step, so every rank starts from the
    same point — including a job resumed from a checkpoint that only
    ``root_rank`` loaded (its optimizer's iterations, moments and learning
    rate are broadcast too). If the model is not built on *every* rank when
    training starts (no input shape known on some), all ranks broadcast after
    the first batch instead; the ranks decide this together, so a model built
    on some ranks only (restored on rank 0 alone) cannot leave them waiting in
    different collectives.

    Args:
        root_rank: the rank whose variables every rank takes.
        device: Horovod's argument; TensorFlow places the broadcast.
        local_variables: a variable or a list of them that each rank keeps
            (Horovod's argument; e.g. a head trained with
            :class:`~hvdkit.PartialDistributedOptimizer`); more with
            :meth:`register_local_var`.

    Example:
        >>> model.fit(ds, callbacks=[hvdkit.callbacks.BroadcastGlobalVariablesCallback(0)])
    """

    def __init__(self, root_rank: int = 0, device: str = "", local_variables=None):
        super().__init__()
        self.root_rank = root_rank
        self.device = device
        self.broadcast_done = False
        if local_variables is None:
            local_variables = []
        elif hasattr(local_variables, "assign"):
            local_variables = [local_variables]
        local_variables = list(local_variables)
        bad = [v for v in local_variables if not hasattr(v, "assign")]
        if bad:
            raise ConfigurationError(
                "BroadcastGlobalVariablesCallback: local_variables must be variables; got "
                f"{', '.join(type(v).__name__ for v in bad)}. Pass e.g. "
                "model.layers[-1].variables."
            )
        self._local_vars = local_variables

    def register_local_var(self, var) -> None:
        """Leave ``var`` out of the broadcast: each rank keeps its own (Horovod's method)."""
        self._local_vars.append(var)

    def _broadcast(self):
        local = {id(v) for v in self._local_vars}
        variables = [v for v in _model_optimizer_variables(self.model) if id(v) not in local]
        collectives.broadcast_variables(variables, self.root_rank)
        self.broadcast_done = True

    def on_train_begin(self, logs=None):
        if self.broadcast_done:
            return
        # A collective decision: `model.built` can differ between ranks.
        built = np.array([int(bool(self.model.built))], dtype=np.int32)
        if collectives.allreduce(built, op=collectives.Min, name="hvdkit.bcast_built")[0]:
            self._broadcast()

    def on_train_batch_end(self, batch, logs=None):
        if not self.broadcast_done:
            global _SAID_LATE_BROADCAST
            if runtime.rank() == 0 and not _SAID_LATE_BROADCAST:  # once per job, not per rank
                _SAID_LATE_BROADCAST = True
                logger.warning(
                    "hvdkit: the model was not built before training, so weights were "
                    "broadcast after the first batch; give the model an Input shape to "
                    "start identical from step one."
                )
            self._broadcast()


class MetricAverageCallback(keras.callbacks.Callback):
    """Make every epoch's logs (``loss``, metrics, ``val_*``) and ``evaluate``'s the job's.

    From the start of ``fit`` (or ``evaluate``) to its end, the model's
    metric states are summed over the ranks whenever Keras makes the logs of
    an epoch or of an evaluation, before any callback sees them: every
    callback, *wherever it is in the list*, sees the same numbers on every
    rank (``EarlyStopping``, ``ReduceLROnPlateau`` and
    ``ModelCheckpoint(save_best_only=True)`` decide alike), and the numbers
    are those of one process on all the ranks' data: uneven shards are
    weighted by their rows (:mod:`hvdkit.keras._job_metrics`). With equal shards
    this is Horovod's rank average. Other scalar logs (added by callbacks
    or a custom ``train_step``) are averaged over the ranks.

    Example:
        >>> model.fit(x_mine, y_mine, validation_data=(xv_mine, yv_mine),
        ...           callbacks=[keras.callbacks.EarlyStopping(patience=2),
        ...                      hvdkit.callbacks.MetricAverageCallback()])
        >>> model.evaluate(xv_mine, yv_mine, callbacks=[hvdkit.callbacks.MetricAverageCallback()])
    """

    def _enter(self):
        _job_metrics.install(self.model)

    def _exit(self):
        _job_metrics.remove(self.model)

    def on_train_begin(self, logs=None):
        self._enter()

    def on_train_end(self, logs=None):
        self._exit()

    def on_test_begin(self, logs=None):
        self._enter()

    def on_test_end(self, logs=None):
        self._exit()

    def on_epoch_end(self, epoch, logs=None):
        if logs is None or runtime.size() == 1:
            return
        done = _job_metrics.job_keys(self.model)
        rest = {k: v for k, v in logs.items() if k not in done}
        logs.update(_job_metrics.average_scalar_logs(rest, "metrics"))


class LearningRateWarmupCallback(keras.callbacks.Callback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr``.

    Large global batches need a large learning rate but diverge if it is used
    from the start (Goyal et al., 2017). During the first ``warmup_epochs``
    epochs, at fractional epoch ``e = epoch + batch / steps_per_epoch``::

        lr(e) = initial_lr / size * (e * (size - 1) / warmup_epochs + 1)

    which reaches ``initial_lr`` when ``e = warmup_epochs``; afterwards the
    learning rate is left alone. Needs an optimizer created with a float
    learning rate (not a schedule).

    Args:
        initial_lr: learning rate after warm-up (usually ``base_lr * size()``).
        warmup_epochs: number of epochs of warm-up (may be fractional).
        momentum_correction: Horovod's option, kept in its position so that
            Horovod calls map correctly; only ``False`` is supported.
        steps_per_epoch: batches per epoch; ``None`` takes it from ``fit``.
        verbose: 1 prints a line on rank 0 when warm-up ends.

    Example:
        >>> cb = hvdkit.callbacks.LearningRateWarmupCallback(0.1 * hvdkit.size(), warmup_epochs=3)
    """

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: float = 5,
        momentum_correction: bool = False,
        steps_per_epoch: float | None = None,
        verbose: int = 0,
    ):
        super().__init__()
        if momentum_correction:
            raise ConfigurationError(
                "LearningRateWarmupCallback(momentum_correction=True) is not supported: Keras 3 "
                "optimizers keep momentum as a fixed Python float. Pass momentum_correction=False."
            )
        if warmup_epochs <= 0:
            raise ConfigurationError(f"warmup_epochs={warmup_epochs} must be positive.")
        _check_steps_per_epoch(steps_per_epoch)
        self.initial_lr = float(initial_lr)
        self.warmup_epochs = warmup_epochs
        self.steps_per_epoch = steps_per_epoch
        self.verbose = verbose
        self._epoch = 0
        self._done = False

    def learning_rate_at(self, epoch: float) -> float:
        """The warm-up learning rate at fractional epoch ``epoch``."""
        n = runtime.size()
        if epoch >= self.warmup_epochs:
            return self.initial_lr
        return self.initial_lr / n * (epoch * (n - 1) / self.warmup_epochs + 1)

    def on_train_begin(self, logs=None):
        if self.steps_per_epoch is None:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ConfigurationError(
                    "LearningRateWarmupCallback cannot tell the number of batches per "
                    "epoch (the dataset has no known length); pass steps_per_epoch=."
                )
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if self._done:
            return
        e = self._epoch + batch / self.steps_per_epoch
        try:
            self.model.optimizer.learning_rate = self.learning_rate_at(e)
        except TypeError as exc:
            raise ConfigurationError(
                "LearningRateWarmupCallback needs an optimizer with a float learning "
                "rate; this one uses a schedule. Build the warm-up into the schedule "
                "instead, or pass a float learning_rate."
            ) from exc
        if e >= self.warmup_epochs:
            self._done = True
            if self.verbose and runtime.rank() == 0:
                lr = f"{self.initial_lr:g}"
                print(f"\nEpoch {self._epoch + 1}: finished learning-rate warm-up at {lr}.")


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` for epochs in a window.

    Horovod's callback (used by its Keras ImageNet example to decay the rate
    at epochs 30, 60, 80). For epochs ``start_epoch <= epoch < end_epoch``
    (``end_epoch=None``: no end):

    - a number ``multiplier`` means ``multiplier ** (epoch - start_epoch)``;
      a callable is called with the epoch;
    - ``staircase=True`` sets the rate once, at the first batch of each
      epoch, with the integer epoch; ``staircase=False`` sets it before every
      batch with ``epoch + batch / steps_per_epoch``.

    Outside the window the rate is left alone, so several callbacks can each
    own one window. Every epoch's logs get the current rate as ``lr``.

    Args:
        initial_lr: the rate the multiplier scales (required, as in Horovod).
        multiplier: number or ``f(epoch) -> float``.
        start_epoch, end_epoch: the window (end exclusive).
        staircase: per epoch (``True``) or per batch (``False``).
        momentum_correction: only ``False``. Horovod's default is ``True``
            (scale momentum by the rate change for one batch), but Keras 3
            optimizers bake momentum into the traced train step, so it could
            not take effect; hvdkit defaults to ``False`` and refuses ``True``.
        steps_per_epoch: batches per epoch for ``staircase=False``; ``None``
            takes it from ``fit``.

    Example:
        >>> hvdkit.callbacks.LearningRateScheduleCallback(
        ...     initial_lr=0.1 * hvdkit.size(), multiplier=1e-1, start_epoch=30, end_epoch=60)
    """

    def __init__(
        self,
        initial_lr: float,
        multiplier,
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = False,
        steps_per_epoch: float | None = None,
    ):
        super().__init__()
        if initial_lr is None:
            raise ConfigurationError(
                "LearningRateScheduleCallback needs initial_lr (the rate the multiplier "
                "scales), as Horovod's does; pass e.g. initial_lr=0.1 * hvdkit.size()."
            )
        if momentum_correction:
            raise ConfigurationError(
                "LearningRateScheduleCallback(momentum_correction=True) is not supported: Keras 3 "
                "optimizers keep momentum as a fixed Python float. Pass momentum_correction=False."
            )
        if end_epoch is not None and end_epoch <= start_epoch:
            raise ConfigurationError(
                f"end_epoch={end_epoch} must be greater than start_epoch={start_epoch} (or None)."
            )
        _check_steps_per_epoch(steps_per_epoch)
        self.initial_lr = float(initial_lr)
        if callable(multiplier):
            self.multiplier = multiplier
        else:
            factor = float(multiplier)
            self.multiplier = lambda epoch: factor ** (epoch - start_epoch)
        self.start_epoch = start_epoch
        self.end_epoch = end_epoch
        self.staircase = staircase
        self.steps_per_epoch = steps_per_epoch
        self._epoch = 0

    def on_train_begin(self, logs=None):
        if not self.staircase and self.steps_per_epoch is None:
            steps = (self.params or {}).get("steps")
            if not steps:
                raise ConfigurationError(
                    "LearningRateScheduleCallback(staircase=False) cannot tell the number of "
                    "batches per epoch (the dataset has no known length); pass steps_per_epoch=."
                )
            self.steps_per_epoch = int(steps)

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def _in_window(self) -> bool:
        return self._epoch >= self.start_epoch and (
            self.end_epoch is None or self._epoch < self.end_epoch
        )

    def on_train_batch_begin(self, batch, logs=None):
        if not self._in_window():
            return
        if self.staircase:
            if batch != 0:
                return
            epoch = self._epoch
        else:
            epoch = self._epoch + batch / self.steps_per_epoch
        try:
            self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)
        except TypeError as exc:
            raise ConfigurationError(
                "LearningRateScheduleCallback needs an optimizer with a float learning rate; "
                "this one uses a schedule. Pass a float learning_rate."
            ) from exc

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


# Callbacks that change the training itself (stop it, change the learning rate or
# the weights, restore state): on rank 0 alone they would leave the ranks apart.
_DECIDING = (
    keras.callbacks.EarlyStopping,
    keras.callbacks.ReduceLROnPlateau,
    keras.callbacks.LearningRateScheduler,
    keras.callbacks.TerminateOnNaN,
    keras.callbacks.BackupAndRestore,
    keras.callbacks.SwapEMAWeights,
)


class RankZeroOnly(keras.callbacks.Callback):
    """Run the wrapped callback on rank 0 only (checkpoints, TensorBoard, CSV logs).

    Put it in the callbacks of *every* rank. On other ranks the callback is
    never called, not even ``set_model`` (where ``TensorBoard`` already writes
    its graph). At the end of ``fit`` all ranks wait for rank 0's callback to
    finish, so a file it wrote can be loaded on every rank right after ``fit``.
    Callbacks that change the training (``EarlyStopping``,
    ``ReduceLROnPlateau``, ``LearningRateScheduler``, ``TerminateOnNaN``,
    ``BackupAndRestore``, ``SwapEMAWeights``, hvdkit's own) are refused: they
    must run on every rank, and ``MetricAverageCallback`` makes them decide
    alike.

    Example:
        >>> ckpt = hvdkit.callbacks.RankZeroOnly(keras.callbacks.ModelCheckpoint("m.keras"))
    """

    def __init__(self, callback: keras.callbacks.Callback):
        super().__init__()
        if not isinstance(callback, keras.callbacks.Callback):
            raise ConfigurationError(
                f"RankZeroOnly wraps a keras.callbacks.Callback; got {type(callback).__name__}."
            )
        hvdkit_own = type(callback).__module__ == __name__
        if isinstance(callback, _DECIDING) or hvdkit_own:
            raise ConfigurationError(
                f"RankZeroOnly({type(callback).__name__}) would run it on rank 0 alone, but it "
                "changes the training (stops it, sets the learning rate or the weights, or "
                "restores state), so the ranks would part ways and the job would hang. Put it "
                "in the callbacks list of every rank; with hvdkit.callbacks."
                "MetricAverageCallback() anywhere in the list, every rank sees the same logs "
                "and decides the same."
            )
        self.callback = callback

    def _active(self) -> bool:
        return runtime.rank() == 0

    def set_model(self, model):
        super().set_model(model)
        if self._active():
            self.callback.set_model(model)

    def set_params(self, params):
        super().set_params(params)
        if self._active():
            self.callback.set_params(params)

    def _forward(self, hook: str, *args):
        if self._active():
            getattr(self.callback, hook)(*args)

    def on_train_begin(self, logs=None):
        self._forward("on_train_begin", logs)

    def on_train_end(self, logs=None):
        self._forward("on_train_end", logs)
        # fit returns on no rank before rank 0's callback has written its last file, so
        # that every rank can load what it saved (a ModelCheckpoint) right after fit
        runtime.barrier()

    def on_epoch_begin(self, epoch, logs=None):
        self._forward("on_epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._forward("on_epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._forward("on_train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self._forward("on_train_batch_end", batch, logs)

    def on_test_begin(self, logs=None):
        self._forward("on_test_begin", logs)

    def on_test_end(self, logs=None):
        self._forward("on_test_end", logs)

    def on_test_batch_begin(self, batch, logs=None):
        self._forward("on_test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self._forward("on_test_batch_end", batch, logs)

    def on_predict_begin(self, logs=None):
        self._forward("on_predict_begin", logs)

    def on_predict_end(self, logs=None):
        self._forward("on_predict_end", logs)

    def on_predict_batch_begin(self, batch, logs=None):
        self._forward("on_predict_batch_begin", batch, logs)

    def on_predict_batch_end(self, batch, logs=None):
        self._forward("on_predict_batch_end", batch, logs)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """Keep the best model so far (Horovod's name): decided job-wide, written by rank 0.

    A ``keras.callbacks.ModelCheckpoint`` with ``save_best_only=True``. At each
    save point the monitored value is averaged over the ranks first (a no-op
    when ``MetricAverageCallback`` already made it the job's), so every rank
    takes the same decision and keeps the same ``best``; only rank 0 writes
    the file.

    Args:
        monitor, verbose, save_weights_only, mode, save_freq: Horovod's and
            Keras's arguments, in Horovod's order.
        filepath: where to write (``.keras``, or ``.weights.h5`` with
            ``save_weights_only``). Horovod's constructor has none (its Spark
            estimator sets ``filepath`` later); here it may be set later too,
            but must be set before ``fit``.

    Raises:
        ConfigurationError: at the start of ``fit``, ``filepath`` is still ``None``.

    Example:
        >>> model.fit(ds, validation_data=val, callbacks=[
        ...     hvdkit.callbacks.MetricAverageCallback(),
        ...     hvdkit.callbacks.BestModelCheckpoint(filepath="best.keras")])
    """

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        save_weights_only: bool = False,
        mode: str = "auto",
        save_freq: str | int = "epoch",
        filepath: str | None = None,
    ):
        placeholder = "best.weights.h5" if save_weights_only else "best.keras"
        super().__init__(
            filepath=filepath if filepath is not None else placeholder,
            monitor=monitor,
            verbose=verbose if runtime.rank() == 0 else 0,
            save_best_only=True,
            save_weights_only=save_weights_only,
            mode=mode,
            save_freq=save_freq,
        )
        if filepath is None:
            self.filepath = None

    def on_train_begin(self, logs=None):
        if self.filepath is None:
            raise ConfigurationError(
                "BestModelCheckpoint has no filepath: pass filepath='best.keras' (or "
                "'.weights.h5' with save_weights_only=True), or set its .filepath before fit."
            )
        super().on_train_begin(logs)

    def _save_model(self, epoch, batch, logs):
        logs = dict(logs or {})
        current = logs.get(self.monitor)
        if current is not None and np.ndim(current) == 0 and runtime.size() > 1:
            mean = collectives.allreduce(np.array([float(current)]), name="hvdkit.best_model")
            logs[self.monitor] = float(mean[0])
        if runtime.rank() == 0:
            super()._save_model(epoch, batch, logs)
            return
        current = logs.get(self.monitor)  # the same decision as rank 0, without the write
        if current is not None and np.ndim(current) == 0:
            if self.monitor_op is None:
                self._set_monitor_op()
            if self._is_improvement(current, self.best):
                self.best = current


def refuse_backup_and_restore() -> None:
    """Make Keras's ``BackupAndRestore`` refuse to start in a job of more than one rank.

    Called by ``hvdkit.init()``. Every rank would write the same backup files
    at the same moment (HDF5 locks the file, or the writes interleave), and a
    job stopped between two ranks' writes would restore them at different
    epochs. ``hvdkit.Checkpointer`` is the replacement: rank 0 writes atomically,
    every rank restores the same step. Single-process jobs keep Keras's callback.
    """
    cls = keras.callbacks.BackupAndRestore
    if getattr(cls.on_train_begin, "_hvdkit_refusal", False):
        return
    keras_on_train_begin = cls.on_train_begin

    def on_train_begin(self, logs=None):
        if runtime.is_initialized() and runtime.size() > 1:
            raise ConfigurationError(
                f"keras.callbacks.BackupAndRestore({self.backup_dir!r}) is not supported in a "
                f"job of {runtime.size()} ranks: every rank would write the same backup files "
                "at once, and a job stopped between two ranks' writes would restore them at "
                "different epochs. Use hvdkit.Checkpointer (whole training state, written "
                "atomically by rank 0, the same step restored on every rank) with hvdkitrun "
                "--max-restarts; see docs/fault-tolerance.md."
            )
        return keras_on_train_begin(self, logs)

    on_train_begin._hvdkit_refusal = True
    cls.on_train_begin = on_train_begin


def _check_steps_per_epoch(value) -> None:
    """Refuse a ``steps_per_epoch`` that is not a number >= 1 (``None``: from ``fit``).

    A float is accepted, as Horovod's callbacks accept it (``len(x) / batch``
    is common in ported scripts); it only sets the fractional epoch.
    """
    if value is None:
        return
    if not is_number(value):
        raise ConfigurationError(
            f"steps_per_epoch={value!r} is not a number of batches; pass one (or None to take "
            "it from fit). Horovod's third argument is momentum_correction."
        )
    if value < 1:
        raise ConfigurationError(f"steps_per_epoch={value} must be >= 1 or None.")
