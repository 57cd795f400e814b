"""The Keras callback of :meth:`hvdkit.Checkpointer.callback`: count steps, save on schedule.

Keras calls ``on_train_batch_end`` with the index of the last batch of each
step (once per ``steps_per_execution``, or once per sink in
:func:`hvdkit.sink.train`), counted from 0 in every epoch; the callback turns
that into the Checkpointer's step count and calls
:meth:`~hvdkit.Checkpointer.maybe_save` with it.

Example:
    >>> model.fit(dataset, callbacks=[CheckpointCallback(ckpt, batch_size=32)])
"""

from __future__ import annotations

import keras

from ..data.sampler import ShardPositionCallback
from ..errors import ConfigurationError

__all__ = ["CheckpointCallback"]


class CheckpointCallback(keras.callbacks.Callback):
    """Counts ``ckpt``'s steps and saves on its schedule during ``fit``.

    Args:
        ckpt: The :class:`~hvdkit.Checkpointer` (not imported here: it imports this).
        batch_size: Advance ``ckpt.sampler`` by it after each batch (a
            ShardPositionCallback run first); ``None`` when one runs before
            this callback: then the first step checks that the sampler advanced.

    Raises:
        ConfigurationError: ``batch_size`` is given and ``ckpt`` has no sampler.
    """

    def __init__(self, ckpt, batch_size: int | None):
        super().__init__()
        if batch_size is not None and ckpt.sampler is None:
            raise ConfigurationError(
                "Checkpointer.callback: batch_size is for advancing the sampler, but "
                "this Checkpointer has none; drop batch_size or pass sampler=."
            )
        self.ckpt = ckpt
        self.position = None
        if batch_size is not None:
            self.position = ShardPositionCallback(ckpt.sampler, batch_size)
        self._batch = -1
        self._before = None

    def set_model(self, model):
        super().set_model(model)
        if self.position is not None:
            self.position.set_model(model)

    def on_train_begin(self, logs=None):
        if self.position is not None:
            self.position.on_train_begin(logs)
        s = self.ckpt.sampler
        self._before = None if s is None or self.position is not None else (s.epoch, s.position)

    def on_epoch_begin(self, epoch, logs=None):
        if self.position is not None:
            self.position.on_epoch_begin(epoch, logs)
        self._batch = -1
        if self.ckpt.sampler is None:
            self.ckpt.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.position is not None:
            self.position.on_train_batch_end(batch, logs)
        s = self.ckpt.sampler
        if self._before is not None:
            if (s.epoch, s.position) == self._before:
                raise ConfigurationError(
                    "Checkpointer.callback(): the sampler did not advance in the first step, "
                    "so its saved position would be stale. List "
                    "hvdkit.data.ShardPositionCallback(sampler, batch_size) before "
                    "ckpt.callback() in callbacks=, or use ckpt.callback(batch_size=...)."
                )
            self._before = None
        step = self.ckpt.step + batch - self._batch
        self._batch = batch
        self.ckpt.maybe_save(step)
